"""The engine: a continuously batched loop of rounds, draft -> tree -> verify -> accept -> commit.

Every running request is a row. A step either admits waiting requests with one batched prefill (when a
row is free) or runs ONE round for every running row (one drafter forward over the rows that draft, one
target forward over all rows' trees). Each row keeps its own method, budget, sampling parameters, random
generator and KV length, so a request's output is the same alone or in any batch. Three methods share the
round and differ only in the tree they verify:
  ``ddtree`` the best-first tree of the ``budget`` most probable draft prefixes,
  ``dflash`` the drafter's argmax chain (linear speculative decoding),
  ``ar``     the root alone (plain autoregressive decoding; no drafter pass).
Greedy rows accept by walking the target's argmax; sampled rows by tree rejection sampling. Both produce the
same verdict and go through one commit path.

Who owns what (``docs/design.md``): ``Scheduler`` who runs and in which cache row; ``ModelRunner`` the
weights, caches, fixed shapes and forwards; ``Proposer`` the drafter pass and each row's tree; ``Verifier``
the verify batch, heads, acceptance and commit; ``AutoBudget`` the ``budget="auto"`` choice. This facade
holds the request API (vLLM's ``LLMEngine``: ``add_request`` / ``step`` / ``abort``; ``generate`` and
``stream`` drive that loop for callers that want results) and reads a step top to bottom.
"""

from __future__ import annotations

import itertools
import random
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ddtree.budget import CostModel
from ddtree.commit import OutputState, token_logprobs
from ddtree.drafter import DFlashDrafter
from ddtree.engine.auto_budget import AutoBudget
from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.proposer import Proposer
from ddtree.engine.request import STAGES, GenerationResult, GenerationStats, Request, StreamDelta
from ddtree.engine.scheduler import Scheduler
from ddtree.engine.verifier import Verifier, delta_of
from ddtree.errors import DDTreeError
from ddtree.models import (
    DEFAULT_DRAFTER,
    DEFAULT_TARGET,
    check_pair,
    eos_token_ids,
    load_drafter,
    load_target,
)
from ddtree.params import (
    AUTO,
    SamplingParams,
    check_accept_thresholds,
    check_speculative_options,
)


def check_engine_options(
    method: str, budget: int, topk: int | None, has_drafter: bool
) -> tuple[str, int, int | None]:
    method, budget, topk = check_speculative_options(method, budget, topk)
    if method != "ar" and not has_drafter:
        raise DDTreeError(f"method {method!r} needs a drafter; pass one or use method 'ar'")
    return method, budget, topk


class Engine:
    """Lossless speculative decoding of ``target`` with a DFlash ``drafter``, for a batch of requests."""

    def __init__(
        self,
        target,
        drafter: DFlashDrafter | None = None,
        tokenizer=None,
        method: str = "ddtree",
        budget: int = 16,
        topk: int | None = None,
        draft_dtype: torch.dtype | None = None,
        max_batch_size: int = 16,
        max_model_len: int | None = None,
        max_prefill_tokens: int = 512,
        accept_threshold_single: float = 1.0,
        accept_threshold_acc: float = 1.0,
        auto_max_budget: int = 64,
        sampling_aware_trees: bool = False,
        cost_model: CostModel | None = None,
        compile: bool = False,
        fixed_shapes: bool | None = None,
        batch_buckets: list[int] | None = None,
        node_buckets: list[int] | None = None,
        span_buckets: list[int] | None = None,
        profile: bool = False,
    ) -> None:
        self.target = target.eval()
        self.tokenizer = tokenizer
        if drafter is not None:
            check_pair(target, drafter)
        self.method, self.budget, self.topk = check_engine_options(method, budget, topk, drafter is not None)
        self.accept_threshold_single, self.accept_threshold_acc = check_accept_thresholds(
            accept_threshold_single, accept_threshold_acc
        )
        context = int(getattr(target.config, "max_position_embeddings", 1 << 30))
        for name, value in (
            ("max_batch_size", max_batch_size),
            ("max_prefill_tokens", max_prefill_tokens),
            ("auto_max_budget", auto_max_budget),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise DDTreeError(f"{name} must be an integer >= 1, got {value!r}")
        if max_model_len is not None and (
            isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or not 2 <= max_model_len
        ):
            raise DDTreeError(f"max_model_len must be an integer >= 2, got {max_model_len!r}")
        if max_model_len is not None and max_model_len > context:
            raise DDTreeError(
                f"max_model_len {max_model_len} exceeds the target's context of {context} tokens"
            )
        self.max_model_len = max_model_len or context
        self.max_batch_size = max_batch_size
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        self.profile = profile  # time every stage (waits for the device at each stage boundary)
        self.runner = ModelRunner(target, drafter, max_batch_size, self.max_model_len, draft_dtype)
        self.scheduler = Scheduler(max_batch_size, max_prefill_tokens)
        self.proposer = Proposer(self.runner, auto_max_budget, sampling_aware_trees)
        self.verifier = Verifier(self.runner, self.accept_threshold_single, self.accept_threshold_acc)
        self.auto = AutoBudget(self.runner, self.scheduler, cost_model, self._now)
        deepest = self.budget if self.budget != AUTO else auto_max_budget
        self.runner.setup_shapes(
            compile, fixed_shapes, max_batch_size, deepest, batch_buckets, node_buckets, span_buckets
        )
        if self.budget != AUTO and self.method == "ddtree":
            self._check_captured_budget(self.budget)
        self.warmup_seconds = 0.0
        if compile:
            self.warm_up()
        self._followed: dict[str, deque[StreamDelta]] = {}  # request id -> deltas its stream has not read
        self._unclaimed: list[StreamDelta] = []  # deltas the next `step` returns

    @classmethod
    def from_pretrained(
        cls,
        target_dir: str | Path | None = None,
        drafter_dir: str | Path | None = None,
        method: str = "ddtree",
        budget: int = 16,
        topk: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        **engine_options,
    ) -> Engine:
        """Load a target (and drafter) from local directories; with neither, the built-in pair."""
        if target_dir is None and drafter_dir is None:
            target_dir, drafter_dir = DEFAULT_TARGET, DEFAULT_DRAFTER
        check_engine_options(method, budget, topk, drafter_dir is not None)  # fail before loading weights
        target, tokenizer = load_target(target_dir, device=device, dtype=dtype)
        drafter = (
            load_drafter(drafter_dir).to(device=device, dtype=dtype) if drafter_dir is not None else None
        )
        return cls(target, drafter, tokenizer, method=method, budget=budget, topk=topk, **engine_options)

    # -- what the parts own, as attributes callers already use ---------------------------------------------

    device = property(lambda self: self.runner.device)
    dtype = property(lambda self: self.runner.dtype)
    drafter = property(lambda self: self.runner.drafter)
    embed = property(lambda self: self.runner.embed)
    lm_head = property(lambda self: self.runner.lm_head)
    draft_head = property(lambda self: self.runner.draft_head)
    forward = property(lambda self: self.runner.forward)
    cache = property(lambda self: self.runner.cache)
    draft_cache = property(lambda self: self.runner.draft_cache)
    fixed_shapes = property(lambda self: self.runner.fixed_shapes)
    compiled = property(lambda self: self.runner.compiled)
    max_drafted = property(lambda self: self.runner.max_drafted)
    batch_buckets = property(lambda self: self.runner.batch_buckets)
    node_buckets = property(lambda self: self.runner.node_buckets)
    span_buckets = property(lambda self: self.runner.span_buckets)
    cost = property(lambda self: self.auto.cost)
    calibration = property(lambda self: self.auto.calibration)

    def _check_captured_budget(self, budget: int | str) -> None:
        if budget != AUTO:
            self.runner.check_captured_budget(budget)

    def warm_up(self) -> float:
        """Run (and so compile and, on CUDA, capture) every fixed shape once with dummy rows, which write
        only the scratch column; returns the seconds it took (also in ``warmup_seconds``)."""
        runner = self.runner
        t = time.perf_counter()
        replays = 3 if self.device.type == "cuda" else 1  # CUDA graph trees record on the second call
        with torch.inference_mode():
            for b, span in itertools.product(runner.batch_buckets, runner.span_buckets):
                for n in runner.node_buckets:
                    batch = self.verifier.inputs([], [], shape=(b, n, span))
                    for _ in range(replays):
                        runner.verify_forward(*batch.forward_args(), True)
                if self.drafter is not None:
                    bs = self.drafter.block_size
                    for _ in range(replays):
                        self.proposer.draft_pass(
                            [None] * b, b, bs, slice(0, b), True, runner.draft_span(span + bs)
                        )
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_seconds += time.perf_counter() - t
        return self.warmup_seconds

    # -- request-level API -------------------------------------------------------------------------------
    # -- request-level API -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def running(self) -> list[Request]:
        """The running requests, in cache-row order (their state is public; the engine owns it)."""
        return list(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        method: str | None = None,
        budget: int | None = None,
        topk: int | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; it starts (prefill) at a coming ``step``. Bad input raises ``DDTreeError`` here,
        before anything runs, and leaves the other requests alone."""
        params = params or SamplingParams()
        method, budget, topk = check_engine_options(
            method or self.method,
            self.budget if budget is None else budget,
            self.topk if topk is None else topk,
            self.drafter is not None,
        )
        if method == "ddtree":
            self._check_captured_budget(budget)
        prompt_ids = self.encode(prompt)
        if len(prompt_ids) + params.max_new_tokens > self.max_model_len:
            raise DDTreeError(
                f"prompt ({len(prompt_ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context of {self.max_model_len} tokens (max_model_len)"
            )
        request_id = self.scheduler.new_id(request_id)
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(1 << 62)
        self.scheduler.waiting.append(
            Request(
                request_id=request_id,
                prompt_ids=prompt_ids,
                params=params,
                method=method,
                budget=budget,
                topk=topk,
                output=OutputState(params, self.eos_token_ids, self.tokenizer if params.detokenize else None),
                stats=GenerationStats(
                    method=method,
                    budget=budget if method == "ddtree" else 0,
                    prompt_tokens=len(prompt_ids),
                    accept_thresholds=(self.accept_threshold_single, self.accept_threshold_acc),
                ),
                generator=torch.Generator(device=self.device).manual_seed(seed),
            )
        )
        return request_id

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request (its row is free for the next step); False if unknown.

        As in vLLM, the request's last delta carries finish_reason "abort" (its stream's, or the next
        ``step``'s)."""
        request = self.scheduler.remove_waiting(request_id)
        if request is None:
            request = self.scheduler.find(request_id)
            if request is None:
                return False
            self._release(request)
        request.output.finish_reason = "abort"
        self._route([delta_of(request, len(request.output.token_ids))])
        return True

    def step(self) -> list[StreamDelta]:
        """Admit waiting requests with one batched prefill when a row is free; otherwise run one round for
        every running request.

        Returns one delta per request that changed (requests followed by ``stream`` / ``generate`` get
        theirs there instead); the last delta of a request carries its finish_reason.
        """
        self._advance()
        out, self._unclaimed = self._unclaimed, []
        return out

    def generate(
        self,
        prompt: str | list[int] | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
        method: str | None = None,
        budget: int | None = None,
        topk: int | None = None,
    ) -> GenerationResult | list[GenerationResult]:
        """One prompt -> one result; a list of prompts -> results in input order, decoded as one
        continuously batched run (``params`` may be one for all or one per prompt)."""
        if isinstance(prompt, (list, tuple)) and not prompt:
            raise DDTreeError("generate() got an empty list: give a prompt (text or token ids) or prompts")
        single = isinstance(prompt, str) or not isinstance(prompt[0], (str, list, tuple))
        prompts = [prompt] if single else list(prompt)
        if isinstance(params, (list, tuple)):
            if len(params) != len(prompts):
                raise DDTreeError(f"got {len(params)} sampling params for {len(prompts)} prompts")
            all_params = list(params)
        else:
            all_params = [params] * len(prompts)
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, all_params, strict=True):
                ids.append(self.add_request(p, sp, method=method, budget=budget, topk=topk))
        except DDTreeError:
            for request_id in ids:
                self.abort(request_id)
            raise
        results = []
        for stream in [self._follow(request_id) for request_id in ids]:  # every row decodes meanwhile
            result = GenerationResult([], "", "", None, [], ids[len(results)])
            for delta in stream:
                result.token_ids += delta.token_ids
                result.text += delta.text
                result.logprobs += delta.logprobs
                result.finish_reason, result.stats = delta.finish_reason, delta.stats
            results.append(result)
        return results[0] if single else results

    def stream(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        method: str | None = None,
        budget: int | None = None,
        topk: int | None = None,
    ) -> Iterator[StreamDelta]:
        """Yield one delta per step until the request finishes (the last one carries finish_reason).

        Bad input raises here, not at the first ``next``. Iterating steps the engine, so every other
        request advances too (a stream's deltas wait in its own queue until it is read); closing the
        iterator early aborts the request.
        """
        return self._follow(self.add_request(prompt, params, method=method, budget=budget, topk=topk))

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise DDTreeError("a text prompt needs a tokenizer; pass token ids instead")
            # verbose=False: an over-long prompt gets our DDTreeError, not transformers' warning first
            ids = self.tokenizer.encode(prompt, add_special_tokens=False, verbose=False)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise DDTreeError("prompt is empty")
        vocab = self.embed.num_embeddings
        if any(t < 0 or t >= vocab for t in ids):
            raise DDTreeError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _follow(self, request_id: str) -> Iterator[StreamDelta]:
        """The deltas of one request, stepping the engine whenever none is waiting (eagerly registered, so
        nothing is lost between this call and the first ``next``)."""
        queue = self._followed[request_id] = deque()
        return self._drain(request_id, queue)

    def _drain(self, request_id: str, queue: deque[StreamDelta]) -> Iterator[StreamDelta]:
        done = False
        try:
            while not done:
                while not queue:
                    self._advance()  # an abort from elsewhere queues the request's last delta
                delta = queue.popleft()
                done = delta.finish_reason is not None
                yield delta
        finally:
            if not done:
                self.abort(request_id)  # its "abort" delta goes to this queue, read by nobody
            del self._followed[request_id]

    def _advance(self) -> None:
        with torch.inference_mode():
            if self.scheduler.admits():
                deltas = self._prefill(self.scheduler.admit())
            else:
                deltas = self._round() if self.scheduler.running else []
        self._route(deltas)

    def _route(self, deltas: list[StreamDelta]) -> None:
        """Each delta to its request's stream, or to the next ``step``'s return value."""
        for delta in deltas:
            queue = self._followed.get(delta.request_id)
            (self._unclaimed if queue is None else queue).append(delta)

    # -- a step ------------------------------------------------------------------------------------------

    def _prefill(self, batch: list[Request]) -> list[StreamDelta]:
        """The admitted requests' prompts in one forward; each gets its first token (and, drafting, its
        prompt's features into the drafter's cache)."""
        t0 = self._now()
        logits, features = self.runner.prefill(
            [r.prompt_ids for r in batch], batch[0].row, features=any(r.drafts for r in batch)
        )  # [B, V], [B, P, F * H]
        roots = self.verifier.first_tokens(logits, batch)
        deltas = []
        seconds = self._now() - t0
        for i, (r, root) in enumerate(zip(batch, roots, strict=True)):
            r.start, r.root = len(r.prompt_ids), root
            if r.drafts:
                r.features = [features[i, : r.start]]  # [P_i, F * H]
            want = r.params.logprobs is not None
            r.output.write(
                [root], token_logprobs(logits[i : i + 1], [root], r.params.logprobs) if want else None
            )
            r.stats.prefill_seconds = seconds
            deltas.append(delta_of(r, 0))
        self.proposer.ingest([r for r in batch if r.drafts])
        self._release_finished(batch)
        return deltas

    def _round(self) -> list[StreamDelta]:
        """Draft, build every row's tree, verify all trees in one target forward, accept, commit.

        Stages are timed (waiting for the device at each boundary) only when profiling or when "auto" rows
        need the cost model; otherwise the round waits only where the host needs device results (the draft
        logits for the trees, the verify results for the accept step).
        """
        rows = list(self.scheduler.running)  # in cache-row order
        timing = self.profile or any(r.auto for r in rows)
        t_round = self._now(timing)
        seconds = dict.fromkeys(STAGES, 0.0)
        drafting = self.scheduler.drafting_this_round()
        with self._stage(seconds, "draft", timing):
            draft_logits = self.proposer.draft(drafting, self.scheduler.drafting) if drafting else {}
        with self._stage(seconds, "tree", timing):
            trees = [self.proposer.tree(r, draft_logits.get(r.request_id)) for r in rows]
            if any(r.auto and r.request_id in draft_logits for r in rows):
                trees = self.auto.choose(rows, trees, len(drafting))
        with self._stage(seconds, "inputs", timing):
            batch = self.verifier.inputs(rows, trees)
            sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
            retrieves = self.verifier.retrieves(trees, sampled)
        with self._stage(seconds, "verify", timing):
            # Features whenever a row drafts, and always with fixed shapes (one graph per shape).
            want = self.runner.fixed_shapes or bool(self.scheduler.drafting)
            hidden, features = self.runner.verify_forward(*batch.forward_args(), want)
            hidden = hidden[: batch.rows, : batch.nodes]  # [B, N, H] (padded with fixed shapes)
            features = None if features is None else features[: batch.rows, : batch.nodes]  # [B, N, F * H]
            # The LM head closes the target forward. Sampling reads every node's distribution; the greedy
            # walk reads only the nodes it accepts.
            greedy_heads = self.verifier.greedy_heads(rows, trees, hidden)
            probs = self.verifier.sampled_probs(rows, sampled, hidden) if sampled else None
        with self._stage(seconds, "accept", timing):
            verdicts = self.verifier.accept(rows, trees, greedy_heads, sampled, retrieves, probs)
        self.auto.learn(rows, trees, verdicts)
        with self._stage(seconds, "commit", timing):
            deltas = self.verifier.commit(rows, verdicts, hidden, features)
            self._release_finished(rows)
        elapsed = self._now(timing) - t_round
        if timing:
            self.auto.observe(batch.ids.numel(), seconds["verify"], len(drafting), seconds["draft"], elapsed)
        for r in rows:
            for name, value in seconds.items():
                r.stats.stage_seconds[name] += value
            r.stats.decode_seconds += elapsed
        return deltas

    def _release_finished(self, rows: list[Request]) -> None:
        for r in rows:
            if r.output.finish_reason is not None:
                self._release(r)

    def _release(self, r: Request) -> None:
        """Free a running request's rows: the scheduler keeps them contiguous, the runner copies the moves."""
        self.runner.move_rows(self.scheduler.release(r))

    # -- timing -----------------------------------------------------------------------------------------

    def _now(self, sync: bool = True) -> float:
        if sync and self.device.type == "cuda":  # a stage's time is only known once its kernels finished
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def _stage(self, seconds: dict[str, float], name: str, timing: bool):
        if not timing:
            yield
            return
        t = self._now()
        yield
        seconds[name] += self._now() - t
