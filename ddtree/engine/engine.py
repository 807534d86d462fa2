"""The engine: a continuously batched loop of rounds, draft -> tree -> verify -> accept -> commit.

Every running request is a row with its own KV blocks. A step either prefills (chunks of waiting or
half-prefilled prompts, one batched forward) or runs ONE round for every decoding row (one drafter forward
over the rows that draft, one target forward over all rows' trees). Each row keeps its own method,
budget, sampling parameters, random generator and KV length, so a request's output is the same alone or
in any batch. Three methods share the round and differ only in the tree they verify:
  ``ddtree`` the best-first tree of the ``budget`` most probable draft prefixes,
  ``dflash`` the drafter's argmax chain (linear speculative decoding),
  ``ar``     the root alone (plain autoregressive decoding; no drafter pass).
Greedy rows accept by walking the target's argmax; sampled rows by tree rejection sampling. Both produce the
same verdict and go through one commit path.

Who owns what (``docs/design.md``): ``Scheduler`` who runs, chunked prefill and preemption, with the
``BlockManager``'s KV blocks; ``ModelRunner`` the weights, paged caches, fixed shapes and forwards;
``Proposer`` the drafter pass and each row's tree; ``Verifier`` the verify batch, heads, acceptance and
commit; ``AutoBudget`` the ``budget="auto"`` choice. This facade holds the request API (vLLM's
``LLMEngine``: ``add_request`` / ``step`` / ``abort``; ``generate`` and ``stream`` drive that loop for
callers that want results) and reads a step top to bottom.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ddtree import startup
from ddtree.budget import CostModel
from ddtree.config import EngineConfig
from ddtree.drafter import DFlashDrafter
from ddtree.engine.auto_budget import AutoBudget
from ddtree.engine.block_manager import BlockManager
from ddtree.engine.clock import StageClock
from ddtree.engine.launch import check_world, start_tensor_parallel
from ddtree.engine.memory import CacheConfig
from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.proposer import Proposer
from ddtree.engine.request import GenerationResult, GenerationStats, Request, StepOutput, StreamDelta
from ddtree.engine.scheduler import Chunk, Scheduler, delta_of
from ddtree.engine.step_channel import StepChannel, TensorParallelError, close_channel
from ddtree.engine.verifier import SAMPLE_ENTRIES, Verifier, VerifyBatch
from ddtree.errors import DDTreeError
from ddtree.logprobs import TokenLogprobs, token_logprobs
from ddtree.models import (
    DEFAULT_DRAFTER,
    DEFAULT_TARGET,
    check_device,
    check_pair,
    check_target_attention,
    eos_token_ids,
    load_drafter,
    load_target,
    media_token_ids,
)
from ddtree.output import OutputState
from ddtree.params import AUTO, SamplingParams, StructuredOutputs, check_speculative_options
from ddtree.penalties import RequestPenalties
from ddtree.tree import PaddedTrees, TreeShape, beam_plan, draft_candidates
from ddtree.verify import Accepted

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from ddtree.grammar import GrammarCompiler, GrammarState


def check_engine_options(
    method: str, budget: int, topk: int | None, has_drafter: bool
) -> tuple[str, int, int | None]:
    method, budget, topk = check_speculative_options(method, budget, topk)
    if method != "ar" and not has_drafter:
        raise DDTreeError(f"method {method!r} needs a drafter; pass one or use method 'ar'")
    return method, budget, topk


def moving(average: float | None, value: float, weight: float = 0.2) -> float:
    """An exponential moving average's next value (the first value starts it)."""
    return value if average is None else (1 - weight) * average + weight * value


class Engine:
    """Lossless speculative decoding of ``target`` with a DFlash ``drafter``, for a batch of requests."""

    def __init__(
        self,
        target,
        drafter: DFlashDrafter | None = None,
        tokenizer=None,
        config: EngineConfig | None = None,
        *,
        cost_model: CostModel | None = None,
        channel: StepChannel | None = None,
        **options,
    ) -> None:
        """``config`` (``ddtree.config.EngineConfig``: every option, its default and its check) with
        ``options`` (its fields as keywords) over it. ``cost_model``: budget "auto"'s starting costs
        (measured at the first auto round when None).
        ``channel``: rank 0's step channel when ``target`` is its tensor-parallel shard (built by
        ``from_pretrained(tensor_parallel_size=N)``, which starts the other ranks)."""
        config = EngineConfig.build(config, **options)
        if config.tensor_parallel_size != 1 and channel is None:
            raise DDTreeError(
                "tensor_parallel_size needs Engine.from_pretrained(TARGET_DIR, DRAFTER_DIR, "
                "tensor_parallel_size=N): every rank loads its own shard from the target's directory"
            )
        self.config = config
        self.target = target.eval()
        self.tokenizer = tokenizer
        if drafter is not None:
            check_pair(target, drafter, tokenizer)
        check_engine_options(config.method, config.budget, config.topk, drafter is not None)
        context = int(getattr(target.config, "max_position_embeddings", 1 << 30))
        if config.max_model_len is not None and config.max_model_len > context:
            raise DDTreeError(
                f"max_model_len {config.max_model_len} exceeds the target's context of {context} tokens"
            )
        check_target_attention(target.config.to_dict(), "target", config.max_model_len or context)
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        self._grammars: GrammarCompiler | None = None  # made at the first structured-output request
        cache_config = CacheConfig(config.block_size, config.kv_cache_memory, config.gpu_memory_utilization)
        deepest = config.budget if config.budget != AUTO else config.auto_max_budget
        if drafter is not None:
            deepest = max(deepest, drafter.block_size - 1)
        self.runner = ModelRunner(
            target,
            drafter,
            config.max_num_seqs,
            config.max_model_len or context,
            config.max_num_batched_tokens,
            deepest + 1,
            cache_config,
            config.max_model_len is not None,
            config.draft_dtype,
            channel=channel,
        )
        self.max_model_len = self.runner.max_model_len  # lowered to what the KV budget holds, if unset
        self.blocks = BlockManager(
            self.runner.num_blocks, config.block_size, prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.blocks, config.max_num_seqs, config.max_num_batched_tokens, self.runner.draft_block
        )
        self.proposer = Proposer(self.runner, config.auto_max_budget, config.sampling_aware_trees)
        self.verifier = Verifier(self.runner, config.accept_threshold_single, config.accept_threshold_acc)
        self.auto = AutoBudget(self.runner, self.scheduler, cost_model)
        self.runner.setup_shapes(config, deepest)
        if config.budget != AUTO and config.method == "ddtree":
            self._check_captured_budget(config.budget)
        self.warmup_seconds = 0.0
        if config.compile:
            self.warm_up()
        # Measured, to cut prefill chunks while requests decode (``_pace_prefill``).
        self._token_seconds: float | None = None  # moving average of a prefill step's seconds per token
        self._round_seconds: float | None = None  # moving average of a round's seconds
        self._followed: dict[str, deque[StreamDelta]] = {}  # request id -> deltas its stream has not read
        self._unclaimed: list[StreamDelta] = []  # deltas the next `step` returns

    # -- the options, as attributes callers already use (``config`` holds them all) -----------------------

    method = property(lambda self: self.config.method)
    budget = property(lambda self: self.config.budget)
    topk = property(lambda self: self.config.topk)
    accept_threshold_single = property(lambda self: self.config.accept_threshold_single)
    accept_threshold_acc = property(lambda self: self.config.accept_threshold_acc)
    auto_max_budget = property(lambda self: self.config.auto_max_budget)
    max_num_seqs = property(lambda self: self.config.max_num_seqs)
    prefill_gap_rounds = property(lambda self: self.config.prefill_gap_rounds)

    @property
    def profile(self) -> bool:
        return self.config.profile

    @profile.setter
    def profile(self, on: bool) -> None:
        """Time every stage from the next step on (each stage then waits for the device)."""
        self.config = replace(self.config, profile=on)

    @classmethod
    def from_pretrained(
        cls,
        target_dir: str | Path | None = None,
        drafter_dir: str | Path | None = None,
        config: EngineConfig | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype = "auto",
        trust_remote_code: bool = False,
        **options,
    ) -> Engine:
        """Load a target (and drafter) from local directories; with neither, the built-in pair. ``config``
        and ``options`` as for ``Engine``, checked before any weight is read.

        ``dtype`` "auto" is the checkpoint's, except a small bf16 / fp16 model on a CPU without native bf16
        matmuls, where float32 is faster (``docs/models.md``).

        ``tensor_parallel_size`` N > 1 shards the target over N ranks (``ddtree.engine.launch``): this
        process is rank 0 and spawns ranks 1..N-1 (gloo on the CPU; NCCL on GPUs 0..N-1), or, started by
        torchrun, joins its ranks; there a rank other than 0 serves rank 0's steps and exits when it stops.
        ``close()`` (or ``with``) ends them.

        ``trust_remote_code`` lets a tokenizer that ships as code in the checkpoint (Kimi's) run; the model
        is always transformers' own class."""
        if target_dir is None and drafter_dir is None:
            target_dir, drafter_dir = DEFAULT_TARGET, DEFAULT_DRAFTER
        config = EngineConfig.build(config, **options)
        check_engine_options(config.method, config.budget, config.topk, drafter_dir is not None)
        device = check_device(device)
        tp, max_model_len = config.tensor_parallel_size, config.max_model_len
        check_world(tp, device)
        channel = None
        with startup.phase("weights"):
            if tp > 1:
                target, tokenizer, channel = start_tensor_parallel(
                    target_dir, dtype, device, max_model_len, tp, trust_remote_code
                )
                device = channel.device
            else:
                target, tokenizer = load_target(
                    target_dir,
                    device=device,
                    dtype=dtype,
                    max_model_len=max_model_len,
                    trust_remote_code=trust_remote_code,
                )
        try:
            drafter = None
            if drafter_dir is not None:
                dtype = next(target.parameters()).dtype  # "auto" resolved
                with startup.phase("weights"):
                    drafter = load_drafter(drafter_dir, max_model_len).to(device=device, dtype=dtype)
            engine = cls(target, drafter, tokenizer, config, channel=channel)
        except BaseException:
            if channel is not None:
                close_channel(channel)
            raise
        if channel is not None and channel.ranks is not None:
            channel.ranks.watch()
        return engine

    # -- tensor parallelism ------------------------------------------------------------------------------

    @property
    def tensor_parallel_size(self) -> int:
        return self.config.tensor_parallel_size

    def watch_ranks(self, callback) -> None:
        """Call ``callback(reason)`` (from a watcher thread) if a tensor-parallel rank dies."""
        channel = self.runner.channel
        if channel is not None and channel.ranks is not None:
            channel.ranks.callbacks.append(callback)
            if channel.ranks.failure is not None:
                callback(channel.ranks.failure)

    def close(self) -> None:
        """End the other tensor-parallel ranks (nothing to do in one process); the engine runs no more."""
        self.runner.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- what the parts own, as attributes callers already use ---------------------------------------------

    device = property(lambda self: self.runner.device)
    dtype = property(lambda self: self.runner.dtype)
    kv_cache_bytes_per_token = property(lambda self: self.runner.kv_cache_bytes_per_token)
    drafter = property(lambda self: self.runner.drafter)
    embed = property(lambda self: self.runner.embed)
    lm_head = property(lambda self: self.runner.lm_head)
    draft_head = property(lambda self: self.runner.draft_head)
    forward = property(lambda self: self.runner.forward)
    cache = property(lambda self: self.runner.cache)
    draft_cache = property(lambda self: self.runner.draft_cache)
    max_batch_size = property(lambda self: self.max_num_seqs)  # the older name
    fixed_shapes = property(lambda self: self.runner.fixed_shapes)
    compiled = property(lambda self: self.runner.compiled)
    max_drafted = property(lambda self: self.runner.max_drafted)
    batch_buckets = property(lambda self: self.runner.batch_buckets)
    node_buckets = property(lambda self: self.runner.node_buckets)
    span_buckets = property(lambda self: self.runner.span_buckets)
    attention = property(lambda self: self.runner.attention)
    cost = property(lambda self: self.auto.cost)
    calibration = property(lambda self: self.auto.calibration)

    def kv_cache_summary(self) -> dict:
        """The KV pool in the numbers a deployment sizes by (the server's start-up log, ``--stats``):
        tokens it holds, the target's bytes per token (all layers; MLA's latent or GQA's keys and values),
        how many requests at ``max_model_len`` fit at once (the drafter's pool shares the blocks), and
        whether full blocks are shared between requests (prefix caching)."""
        runner = self.runner
        return {
            "kv_cache_tokens": (self.blocks.num_blocks - 1) * self.blocks.block_size,
            "kv_cache_bytes_per_token": self.kv_cache_bytes_per_token,
            "kv_cache_layout": "MLA latent" if runner.cache.layout.is_latent else "GQA keys and values",
            "max_concurrency": (self.blocks.num_blocks - 1) / runner.width,
            "prefix_caching": self.blocks.prefix_caching,
        }

    def _check_captured_budget(self, budget: int | str) -> None:
        if budget != AUTO:
            self.runner.check_captured_budget(budget)

    def warm_up(self) -> float:
        """Run (and so compile and, on CUDA, capture) every fixed shape once with dummy rows, which write
        only the scratch column; returns the seconds it took (also in ``warmup_seconds``)."""
        runner = self.runner
        t = time.perf_counter()
        replays = 3 if self.device.type == "cuda" else 1  # CUDA graph trees record on the second call
        with torch.inference_mode(), startup.phase("compile"):
            for b, span in itertools.product(runner.batch_buckets, runner.span_buckets):
                for n in runner.node_buckets:
                    batch = self.verifier.inputs([], None, shape=(b, n, span))
                    for _ in range(replays):
                        hidden, _ = runner.verify(*batch.forward_args(True))
                    if span == runner.span_buckets[0] and runner.round_compiled and self.drafter is not None:
                        self._warm_round_graphs(hidden, batch)
                if self.drafter is not None:
                    bs, tables = self.drafter.block_size, runner.block_tables([], b)
                    for _ in range(replays):
                        self.proposer.draft_pass([None] * b, bs, tables, True, span)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_seconds += time.perf_counter() - t
        return self.warmup_seconds

    def _warm_round_graphs(self, hidden: torch.Tensor, batch: VerifyBatch) -> None:
        """Run the round's graphs of one bucket (``hidden`` [Bp, Np, H]: its verify forward's output, from
        ``batch``) on dummy trees with the inputs' dtypes and strides of a real round, so no round
        compiles. The dummy rows' KV pack moves within the scratch block."""
        runner, device = self.runner, self.device
        b, n = hidden.shape[:2]
        vocab = runner.lm_head.weight.shape[0]
        sizes = torch.zeros(b, dtype=torch.int64, device=device)
        if n > 1:
            shape = TreeShape.bucket(n, self.drafter.block_size - 1, vocab)
            logits = torch.zeros(b, shape.depths, vocab, device=device)  # the positions a bucket's trees read
            vals, ids = draft_candidates(logits, shape.k)
            allowed = torch.zeros(b, shape.depths, dtype=torch.int64, device=device)
            roots = torch.zeros_like(sizes)  # a distinct tensor: a graph is compiled for its inputs' aliasing
            trees = runner.tree_graph(vals, ids, roots, allowed, sizes, beam_plan(shape, device))[:3]
        else:  # a tree cut to its root (budget "auto" choosing plain rounds)
            trees = [torch.zeros(b, 1, dtype=torch.int64, device=device) for _ in range(3)]
        padded = PaddedTrees(*trees, sizes)
        runner.inputs_graph(padded, sizes + 1, runner.cache.scratch, runner.tree_depth(n))
        verdicts = Accepted(*self.verifier.greedy_padded(padded, hidden, vocab))
        self.verifier.pack(verdicts.head(b), batch)
        if b * n * vocab <= SAMPLE_ENTRIES:
            probs = self.verifier.padded_probs([SamplingParams(temperature=1.0)] * b, hidden)  # [Bp, Np, V]
            coins = torch.zeros(b, n, device=device)
            self.verifier.sample_padded(padded, probs, coins, coins[:, 0].contiguous(), vocab)

    # -- request-level API -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def running(self) -> list[Request]:
        """The running requests, in admission order (their state is public; the engine owns it)."""
        return list(self.scheduler.running)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

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
        cache_salt: str | None = None,
    ) -> str:
        """Queue a request; it starts (prefill) at a coming ``step``. Bad input raises ``DDTreeError`` here,
        before anything runs, and leaves the other requests alone. Requests with different ``cache_salt``s
        never share prefix-cache blocks."""
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
        grammar = None if params.structured_outputs is None else self._grammar(params.structured_outputs)
        penalties = RequestPenalties.of(
            params, prompt_ids, self.eos_token_ids, self.tokenizer, self.vocab_size
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
                auto_width=self.auto.start_width,
                cache_salt=cache_salt,
                grammar=grammar,
                penalties=penalties,
            )
        )
        return request_id

    @property
    def vocab_size(self) -> int:
        """Tokens the target scores (its LM head's rows; may exceed the tokenizer's)."""
        return self.runner.lm_head.weight.shape[0]

    def check_structured_outputs(self, spec: StructuredOutputs) -> None:
        """Compile ``spec``'s grammar now (cached for ``add_request``): a server calls it off the engine
        thread, so a slow or bad constraint never holds a step. Raises DDTreeError on a bad one."""
        self._grammar_compiler().compile(spec)

    def _grammar(self, spec: StructuredOutputs) -> GrammarState:
        """A new request's place at the start of its grammar, compiled (and cached) now, so that a bad
        constraint fails ``add_request`` and nothing else."""
        return self._grammar_compiler().state(spec)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise DDTreeError("structured outputs need the target's tokenizer; this target has none")
        if self._grammars is None:
            from ddtree.grammar import GrammarCompiler  # xgrammar: only for engines that need it

            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        return self._grammars

    def reset_prefix_cache(self) -> None:
        """Forget the cached prefixes no running request holds (vLLM's ``reset_prefix_cache``): the next
        requests prefill cold, as when comparing configurations on the same prompts."""
        self.blocks.reset()

    def abort(self, request_id: str) -> bool:
        """Drop a waiting or running request (its row is free for the next step); False if unknown.

        As in vLLM, the request's last delta carries finish_reason "abort" (its stream's, or the next
        ``step``'s)."""
        request = self.scheduler.abort(request_id)
        if request is None:
            return False
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
                result.error = delta.error
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

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; text gets the tokenizer's special tokens (a BOS for Llama) as HF and
        vLLM add them, unless it already has them (a rendered chat template: ``add_special_tokens=False``)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise DDTreeError("a text prompt needs a tokenizer; pass token ids instead")
            # verbose=False: an over-long prompt gets our DDTreeError, not transformers' warning first
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens, verbose=False)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise DDTreeError("prompt is empty")
        vocab = self.embed.num_embeddings
        if any(t < 0 or t >= vocab for t in ids):
            raise DDTreeError(f"prompt token ids must be in [0, {vocab})")
        media = media_token_ids(self.target).intersection(ids)
        if media:
            raise DDTreeError(
                f"prompt holds image/video placeholder token ids {sorted(media)}: ddtree serves this "
                "model's text backbone only; send text"
            )
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
            chunks = self.scheduler.schedule_prefill()
            if chunks:
                deltas = self._isolated(chunks, [c.request for c in chunks], self._prefill)
            elif self.scheduler.decoding:
                rows = self.scheduler.schedule_round(self.proposer.columns)  # blocks taken; may preempt
                drafting = self.scheduler.drafting_this_round(rows)

                def round_of(part: list[Request]) -> list[StreamDelta]:
                    return self._round(part, [r for r in drafting if r in part])

                deltas = self._isolated(rows, rows, round_of)
            else:
                deltas = []
        self._route(deltas)

    def _isolated(self, parts: list, requests: list[Request], run: Callable[[list], list[StreamDelta]]):
        """``run(parts)``, a step over ``requests`` (``parts[i]`` is ``requests[i]``'s share: a chunk or the
        row). When it raises, the failure is traced to the requests it came from: each share runs again
        alone (the step changed no request before failing; its sampled rows' generators are rewound first,
        so a seeded row draws the coins it would have drawn) and a request whose share fails alone ends
        with finish_reason "error"; the others' shares make this step. Only a failure every share repeats
        alone (the device, not a request) escapes, as does a tensor-parallel rank's."""
        coins = [(r.generator, r.generator.get_state()) for r in requests if r.params.temperature > 0]
        try:
            return run(parts)
        except TensorParallelError:
            raise
        except Exception as exc:
            first = exc
        deltas: list[StreamDelta] = []
        failed: list[tuple[Request, Exception]] = [(requests[0], first)]
        if len(parts) > 1:
            log.warning("a step of %d requests failed (%s); running each alone", len(parts), first)
            for generator, state in coins:
                generator.set_state(state)
            failed = []
            for part, request in zip(parts, requests, strict=True):
                try:
                    deltas += run([part])
                except TensorParallelError:
                    raise
                except Exception as exc:
                    failed.append((request, exc))
            if len(failed) == len(parts):
                raise first
        for request, exc in failed:
            log.error("request %s failed in a step and ends alone: %s", request.request_id, exc)
            deltas.append(self.scheduler.fail(request, exc))
        return deltas

    def _route(self, deltas: list[StreamDelta]) -> None:
        """Each delta to its request's stream, or to the next ``step``'s return value."""
        for delta in deltas:
            queue = self._followed.get(delta.request_id)
            (self._unclaimed if queue is None else queue).append(delta)

    # -- a step ------------------------------------------------------------------------------------------

    def _prefill(self, chunks: list[Chunk]) -> list[StreamDelta]:
        """Prompt chunks in one forward (and, drafting, their features into the drafter's cache). A request
        whose prefill ends gets its first token; a preempted one resumes with its last emitted token."""
        t0 = time.perf_counter()  # the last step ended with a sync: the device is not behind
        batch = [c.request for c in chunks]
        logits, features = self.runner.prefill(
            [
                (r.prefill_ids[r.computed : r.computed + c.tokens], r.computed)
                for r, c in zip(batch, chunks, strict=True)
            ],
            self.runner.block_tables(batch),
            features=any(r.drafts for r in batch),
        )  # [B, V], [B, P, F * H]
        drafting = [i for i, r in enumerate(batch) if r.drafts]
        self.proposer.ingest(
            [batch[i] for i in drafting], [features[i, : chunks[i].tokens] for i in drafting]
        )
        first = [i for i, c in enumerate(chunks) if c.last and not c.request.output.token_ids]
        tokens: list[list[int]] = [[] for _ in batch]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(batch)
        for i, t in zip(
            first, self.verifier.first_tokens(logits[first], [batch[i] for i in first]), strict=True
        ):
            tokens[i] = [t]
            if batch[i].params.logprobs is not None:
                logprobs[i] = token_logprobs(logits[i : i + 1], [t], batch[i].params.logprobs)
        seconds = self._now() - t0
        self._token_seconds = moving(
            self._token_seconds, seconds / (len(chunks) * max(c.tokens for c in chunks))
        )
        self._pace_prefill()
        return self.scheduler.update_from_output(
            StepOutput(
                rows=batch,
                tokens=tokens,
                logprobs=logprobs,
                consumed=[c.tokens if c.request.drafts else 0 for c in chunks],
                features=[None] * len(batch),
                prefilled=[c.tokens for c in chunks],
                seconds=seconds,
            )
        )

    def _round(self, rows: list[Request], drafting: list[Request]) -> list[StreamDelta]:
        """Draft, build every row's tree, verify all trees in one target forward, accept, commit.

        From the draft to the verdicts the round runs on the device; the host waits twice: for the trees'
        depth (``Verifier.accept``, while the verify forward runs) and for the verdicts
        (``Verifier.verdicts``). Rows with budget "auto" add one copy (their trees' draft log-probs) and
        time the stages, as profiling does (``StageClock``: CUDA events read after the round's last sync,
        so timing adds no wait). The scheduler then applies the round to its rows.
        """
        clock = StageClock(self.device, self.profile or any(r.auto for r in rows))
        t_round = time.perf_counter()  # the last step ended with a sync: the device is not behind
        with clock.stage("draft"):
            drafted, consumed = (
                self.proposer.draft(drafting) if drafting else (None, [])
            )  # [D, block_size - 1, H]
        with clock.stage("tree"):
            trees = self.proposer.trees(rows, drafting, drafted)  # the draft head, then the trees
            seen = None
            if any(r.auto for r in drafting):
                trees, seen = self.auto.choose(rows, trees, len(drafting))
        with clock.stage("inputs"):
            batch = self.verifier.inputs(rows, trees)
        with clock.stage("verify"):
            # Features whenever a row drafts, and always with fixed shapes (one graph per shape).
            want = self.runner.fixed_shapes or any(r.drafts for r in rows)
            padded, features = self.runner.verify(*batch.forward_args(want))  # [Bp, Np, H]
            hidden = padded[: batch.rows, : batch.nodes]  # [B, N, H] (padded with fixed shapes)
            features = None if features is None else features[: batch.rows, : batch.nodes]  # [B, N, F * H]
        with clock.stage("accept"):
            accepted = self.verifier.accept(rows, trees, hidden, padded)  # the LM head closes the forward
        with clock.stage("commit"):
            verdicts = self.verifier.verdicts(rows, accepted, hidden, features, batch)
            status = self.auto.learn(rows, trees.sizes, seen, verdicts)
            eaten = {id(r): k for r, k in zip(drafting, consumed, strict=True)}
            deltas = self.scheduler.update_from_output(
                StepOutput(
                    rows=rows,
                    tokens=verdicts.tokens,
                    logprobs=verdicts.logprobs,
                    consumed=[eaten.get(id(r), 0) for r in rows],
                    features=verdicts.features,
                    drafted_nodes=[int(m) - 1 for m in trees.sizes],
                    auto_widths={} if seen is None else seen.widths,
                    auto_skip=None if seen is None else seen.skip,
                    auto_status=status,
                )
            )
        elapsed = time.perf_counter() - t_round
        self._round_seconds = moving(self._round_seconds, elapsed)
        self._pace_prefill()
        seconds = clock.seconds()
        if clock.enabled:
            self.auto.observe(batch.ids.numel(), seconds["verify"], len(drafting), seconds["draft"], elapsed)
        self.scheduler.record_round_time(rows, seconds, elapsed)
        return deltas

    def _pace_prefill(self) -> None:
        """While requests decode, a prefill step's tokens are what ``prefill_gap_rounds`` rounds' time
        prefills (both measured), so a long prompt arriving delays the running streams by a few rounds per
        step however fast or slow the machine; at least one KV block a step. ``max_num_batched_tokens``
        still caps it. (A step's fixed cost makes small chunks dearer per token: the chunk settles where
        fixed + tokens x cost per token fills the rounds' time.)"""
        known = self._round_seconds is not None and self._token_seconds is not None
        if self.prefill_gap_rounds is not None and known:
            tokens = int(self.prefill_gap_rounds * self._round_seconds / self._token_seconds)
            self.scheduler.decode_chunk = max(self.blocks.block_size, tokens)

    # -- timing -----------------------------------------------------------------------------------------

    def _now(self) -> float:
        """The host clock once the device has caught up (the prefill's end, the auto budget's calibration
        forwards); a round's stages use ``StageClock`` instead, which does not wait."""
        return self.runner.now()
