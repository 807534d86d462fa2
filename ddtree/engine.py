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
same verdict and go through ``ddtree.commit``.

The request-level API follows vLLM's ``LLMEngine``: ``add_request`` / ``step`` / ``abort``; ``generate`` and
``stream`` drive that loop for callers that want results (and may run side by side: each stream steps
the engine, which advances every request).
"""

from __future__ import annotations

import copy
import itertools
import random
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ddtree.budget import AcceptanceCalibration, CostModel, choose_counts
from ddtree.capture import (
    StaticInputs,
    batch_ladder,
    check_batch_buckets,
    check_buckets,
    compile_forward,
    mark_static,
    node_ladder,
    pick,
    tree_mask,
)
from ddtree.commit import OutputState, TokenLogprobs, pack_accepted, token_logprobs
from ddtree.drafter import DFlashDrafter
from ddtree.errors import DDTreeError
from ddtree.forward import TargetForward
from ddtree.kv_cache import KVCache
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
    METHODS,
    SamplingParams,
    check_accept_thresholds,
    check_speculative_options,
    lossy_threshold_fields,
)
from ddtree.sampling import SamplingTensors, filtered_probs, sample_rows, sample_trees
from ddtree.stats import mean_acceptance_length
from ddtree.tree import DraftTree, build_ddtree_tree, compile_ddtree_retrieve
from ddtree.verify import first_child_chain, follow_verified_tree, tree_verify_inputs

STAGES = ("draft", "tree", "inputs", "verify", "accept", "commit")


def check_engine_options(
    method: str, budget: int, topk: int | None, has_drafter: bool
) -> tuple[str, int, int | None]:
    method, budget, topk = check_speculative_options(method, budget, topk)
    if method != "ar" and not has_drafter:
        raise DDTreeError(f"method {method!r} needs a drafter; pass one or use method 'ar'")
    return method, budget, topk


def _fast_low_precision(device: torch.device) -> torch.dtype:
    """bfloat16 where matmuls run it natively (CUDA with bf16, CPUs with AVX512-BF16), else float32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    native = device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()
    return torch.bfloat16 if native else torch.float32


def _with_mlp_dtype(drafter: DFlashDrafter, dtype: torch.dtype) -> DFlashDrafter:
    """``drafter``, or a copy of it whose MLP weights are ``dtype`` (the caller's module is left alone)."""
    if all(p.dtype == dtype for layer in drafter.layers for p in layer.mlp.parameters()):
        return drafter
    drafter = copy.deepcopy(drafter)
    for layer in drafter.layers:
        layer.mlp.to(dtype)
    return drafter


@dataclass
class GenerationStats:
    """What a response cost. ``acceptance_lengths`` has one entry per round: accepted drafts + 1.

    Stage, prefill and decode seconds are the wall time of the batched forwards and rounds the request
    took part in (shared with its batch companions). Stage seconds are measured only when the engine
    profiles (``Engine(profile=True)``): timing a stage on an accelerator means waiting for it.
    """

    method: str
    budget: int | str  # "auto": chosen per round (see drafted_nodes)
    prompt_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    drafted_nodes: list[int] = field(default_factory=list)  # drafted nodes verified per round
    stage_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    accept_thresholds: tuple[float, float] = (1.0, 1.0)  # (single, acc); below 1.0 the output is lossy

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def tau(self) -> float:
        """Mean acceptance length (tokens committed per target forward after prefill)."""
        return mean_acceptance_length(self.acceptance_lengths)

    @property
    def decode_tokens_per_second(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        out = {
            "method": self.method,
            "budget": self.budget,
            "prompt_tokens": self.prompt_tokens,
            "rounds": self.rounds,
            "tau": self.tau,
            "acceptance_lengths": list(self.acceptance_lengths),
            "drafted_nodes": list(self.drafted_nodes),
            "stage_seconds": dict(self.stage_seconds),
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "decode_tokens": self.decode_tokens,
            "decode_tokens_per_second": self.decode_tokens_per_second,
        }
        return out | lossy_threshold_fields(*self.accept_thresholds)


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str
    stats: GenerationStats
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # aligned with token_ids when requested
    request_id: str = ""


@dataclass
class StreamDelta:
    """What one step added to one request: new token ids and the newly stable text (may be empty)."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    stats: GenerationStats
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # aligned with token_ids when requested


@dataclass
class Request:
    """One request's decoding state, public so a scheduler can see it.

    While it runs, the target cache row ``row`` holds its tokens at columns [0, start) and the root (the
    last committed token, not yet in the cache) sits at position ``start``; a drafting request also owns
    drafter cache row ``draft_row`` holding [0, draft_len) and the target features of the tokens the drafter
    has not consumed yet.
    """

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    method: str
    budget: int | str
    topk: int | None
    output: OutputState
    stats: GenerationStats
    generator: torch.Generator
    row: int = -1
    draft_row: int = -1
    start: int = 0
    root: int = -1
    draft_len: int = 0
    features: list[torch.Tensor] = field(default_factory=list)  # [C_i, F * H] per round not drafted on
    auto_width: int = 8  # budget "auto": drafted nodes chosen last time (sizes the next candidate tree)

    @property
    def drafts(self) -> bool:
        return self.method != "ar"

    @property
    def auto(self) -> bool:
        return self.budget == AUTO


@dataclass
class VerifyBatch:
    """Inputs of the round's ONE target forward: every row's tree, padded to the widest (N nodes), or with
    fixed shapes to a batch bucket and a node bucket.

    Row b's node j sits at position start_b + depth_j, writes its keys/values at column start_b + j and sees
    the row's committed columns [0, start_b) plus its own ancestors (``capture.tree_mask``). Padding nodes
    and rows write to the scratch column, see only committed columns (a dummy row: column 0) and are never
    read or committed.
    """

    ids: torch.Tensor  # [B, N] int64
    positions: torch.Tensor  # [B, N] int64
    cols: torch.Tensor  # [B, N] int64
    starts: torch.Tensor  # [B] int64, committed columns per row
    anc: torch.Tensor  # [B, N, N] bool, the tree block of the mask
    span: int  # columns attention reads: max_b (start_b + N_b), or the whole row with fixed shapes
    rows: int  # real rows (the first ``rows`` of the batch)
    nodes: int  # real nodes of the widest tree


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
        self.max_prefill_tokens = max_prefill_tokens
        self.auto_max_budget = auto_max_budget
        # When on, sampled rows build their tree from the drafter's distribution under the request's own
        # sampling transform (verification is unchanged). Off by default: measured, it did not pay.
        self.sampling_aware_trees = sampling_aware_trees
        self.cost = cost_model or CostModel()  # measured at the first auto round, then kept current
        self.calibration = AcceptanceCalibration()
        self._costs_measured = False
        self.auto_skip = 0  # rounds left in which "auto" rows run plain (no drafter pass)
        self._auto_backoff = 0  # length of the last such stretch: 1, 2, 4, ... AUTO_MAX_BACKOFF
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.forward = TargetForward(target)
        # The drafter only proposes tokens, so rounding in its matmuls cannot change what is emitted. Its
        # LM head (a copy of the target's) and its MLPs, the largest matmuls of a draft pass, run in
        # `draft_dtype`: bf16 reads half the bytes and runs natively where supported (attention and norms
        # stay in the model's dtype: bf16 is slower there on CPUs).
        draft_dtype = draft_dtype or _fast_low_precision(self.device)
        self.draft_head = self.lm_head.weight.detach().to(draft_dtype)  # [V, H]
        self.draft_head_bias = (
            None if self.lm_head.bias is None else self.lm_head.bias.detach().to(draft_dtype)
        )
        self.drafter = None if drafter is None else _with_mlp_dtype(drafter.eval(), draft_dtype)
        self.eos_token_ids = eos_token_ids(target, tokenizer)
        # Fixed caches, sized once: a row per running request, the whole context per row.
        self.cache = self.forward.new_cache(max_batch_size, self.max_model_len)
        self.draft_cache = None
        if self.drafter is not None:
            attn = self.drafter.layers[0].self_attn
            self.draft_cache = KVCache(
                len(self.drafter.layers),
                max_batch_size,
                attn.num_kv_heads,
                attn.head_dim,
                self.max_model_len + self.drafter.block_size,  # the block sits after the context
                next(attn.parameters()).dtype,
                self.device,
            )
        self.profile = profile  # time every stage (waits for the device at each stage boundary)
        self._setup_shapes(compile, fixed_shapes, batch_buckets, node_buckets, span_buckets)
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # index = target cache row
        self._drafting: list[Request] = []  # index = drafter cache row
        self._ids = itertools.count()
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

    # -- fixed shapes and compilation (ddtree.capture) ---------------------------------------------------

    def _setup_shapes(
        self,
        compile: bool,
        fixed_shapes: bool | None,
        batch_buckets: list[int] | None,
        node_buckets: list[int] | None,
        span_buckets: list[int] | None,
    ) -> None:
        """Choose the shapes every round is padded to and, with ``compile``, compile and capture them all.

        Attention reads a span bucket of leading cache columns: by default the whole row (one graph per
        batch and node bucket); more buckets make short rows read less (the CPU, long contexts) at the
        price of more graphs."""
        self.fixed_shapes = compile if fixed_shapes is None else bool(fixed_shapes)
        if compile and not self.fixed_shapes:
            raise DDTreeError("compile=True needs fixed shapes (fixed_shapes=False was given)")
        self.compiled = bool(compile)
        self.warmup_seconds = 0.0
        self.max_drafted = self.max_model_len  # drafted nodes a tree may hold (with fixed shapes: a bucket)
        self._inputs = StaticInputs(self.device, static=compile and self.device.type == "cuda")
        self._verify_forward = self._verify_forward_eager
        self._draft_forward = self._draft_forward_eager
        if not self.fixed_shapes:
            if batch_buckets is not None or node_buckets is not None or span_buckets is not None:
                raise DDTreeError("batch, node and span buckets need fixed shapes (compile=True)")
            return
        deepest = self.budget if self.budget != AUTO else self.auto_max_budget
        if self.drafter is not None:
            deepest = max(deepest, self.drafter.block_size - 1)  # the dflash chain
        buckets = check_batch_buckets("batch_buckets", batch_buckets, self.max_batch_size)
        self.batch_buckets = buckets or batch_ladder(self.max_batch_size)
        self.node_buckets = check_buckets("node_buckets", node_buckets) or node_ladder(deepest)
        self.max_drafted = self.node_buckets[-1] - 1
        whole = self.cache.capacity + 1  # the last span bucket is always the whole row
        spans = check_buckets("span_buckets", span_buckets, whole) or ()
        self.span_buckets = tuple(sorted({*spans, whole}))
        if self.budget != AUTO and self.method == "ddtree":
            self._check_captured_budget(self.budget)
        if compile:
            shapes = len(self.batch_buckets) * len(self.node_buckets) * len(self.span_buckets)
            caches = [self.cache] + ([self.draft_cache] if self.draft_cache is not None else [])
            if self.device.type == "cuda":
                mark_static([buf for c in caches for buf in (*c.keys, *c.values)])
            self._verify_forward = compile_forward(self._verify_forward_eager, self.device, shapes)
            self._draft_forward = compile_forward(self._draft_forward_eager, self.device, shapes)
            self.warm_up()

    def _check_captured_budget(self, budget: int | str) -> None:
        if self.fixed_shapes and budget != AUTO and budget > self.max_drafted:
            raise DDTreeError(
                f"budget {budget} exceeds the largest node bucket ({self.max_drafted} drafted nodes); "
                "start the engine with node_buckets that hold it"
            )

    def warm_up(self) -> float:
        """Run (and so compile and, on CUDA, capture) every fixed shape once with dummy rows, which write
        only the scratch column; returns the seconds it took (also in ``warmup_seconds``)."""
        t = time.perf_counter()
        replays = 3 if self.device.type == "cuda" else 1  # CUDA graph trees record on the second call
        with torch.inference_mode():
            for b, span in itertools.product(self.batch_buckets, self.span_buckets):
                for n in self.node_buckets:
                    batch = self._verify_inputs([], [], shape=(b, n, span))
                    for _ in range(replays):
                        self._verify_forward(
                            batch.ids, batch.positions, batch.cols, batch.starts, batch.anc, batch.span
                        )
                if self.drafter is not None:
                    bs = self.drafter.block_size
                    for _ in range(replays):
                        self._draft_pass([None] * b, b, bs, slice(0, b), True, self._draft_span(span + bs))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.warmup_seconds += time.perf_counter() - t
        return self.warmup_seconds

    def _verify_forward_eager(
        self,
        ids: torch.Tensor,  # [B, N]
        positions: torch.Tensor,  # [B, N]
        cols: torch.Tensor,  # [B, N]
        starts: torch.Tensor,  # [B]
        anc: torch.Tensor,  # [B, N, N]
        span: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The round's target forward over cache rows [0, B): final hidden states [B, N, H] and drafter
        features [B, N, F * H] (with fixed shapes whenever there is a drafter: one graph per shape)."""
        drafting = self.drafter is not None and (self.fixed_shapes or bool(self._drafting))
        write = self.cache.at(slice(0, ids.shape[0]), cols, span)
        mask = tree_mask(starts, anc, span)  # [B, 1, N, span]
        return self.forward(ids, positions, write, mask, self.drafter.target_layer_ids if drafting else None)

    def _draft_forward_eager(
        self,
        block: torch.Tensor,  # [B, S] root, MASK ...
        features: torch.Tensor,  # [B, C, F * H] context features not yet cached (right-padded)
        ctx_positions: torch.Tensor,  # [B, C]
        ctx_cols: torch.Tensor,  # [B, C]; padding: scratch
        block_positions: torch.Tensor,  # [B, S]
        block_cols: torch.Tensor,  # [B, S]; a drafting row's columns are its positions; idle: scratch
        ends: torch.Tensor,  # [B] columns each row's block attends to: [0, end)
        where: slice | torch.Tensor,
        span: int,
    ) -> torch.Tensor:
        """One drafter pass: the block's final hidden states [B, S, H]."""
        write = self.draft_cache.at(where, torch.cat((ctx_cols, block_cols), dim=1), span)
        visible = torch.arange(span, device=ends.device)[None] < ends[:, None]  # [B, span]
        mask = visible[:, None, None]  # [B, 1, 1, span]
        return self.drafter(self.embed(block), features, block_positions, ctx_positions, write, mask)

    # -- request-level API -------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def running(self) -> list[Request]:
        """The running requests, in cache-row order (their state is public; the engine owns it)."""
        return list(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._running or self._waiting)

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
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if any(r.request_id == request_id for r in itertools.chain(self._waiting, self._running)):
            raise DDTreeError(f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else random.SystemRandom().randrange(1 << 62)
        self._waiting.append(
            Request(
                request_id=request_id,
                prompt_ids=prompt_ids,
                params=params,
                method=method,
                budget=budget,
                topk=topk,
                output=OutputState(params, self.eos_token_ids, self.tokenizer),
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
        request = next((r for r in self._waiting if r.request_id == request_id), None)
        if request is not None:
            self._waiting.remove(request)
        else:
            request = next((r for r in self._running if r.request_id == request_id), None)
            if request is None:
                return False
            self._release(request)
        request.output.finish_reason = "abort"
        self._route([self._delta(request, len(request.output.token_ids))])
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
            # Prefill first (vLLM's default schedule): a new request waits for at most the current step and
            # its own prefill, and running requests for at most one prefill between two rounds.
            if self._waiting and len(self._running) < self.max_batch_size:
                deltas = self._admit()
            else:
                deltas = self._round() if self._running else []
        self._route(deltas)

    def _route(self, deltas: list[StreamDelta]) -> None:
        """Each delta to its request's stream, or to the next ``step``'s return value."""
        for delta in deltas:
            queue = self._followed.get(delta.request_id)
            (self._unclaimed if queue is None else queue).append(delta)

    # -- admission ---------------------------------------------------------------------------------------

    def _admit(self) -> list[StreamDelta]:
        """Prefill waiting requests (FIFO) into free rows, as one padded forward of at most
        ``max(max_prefill_tokens, the first prompt)`` tokens, so running requests wait for at most one
        such forward per step."""
        batch: list[Request] = []
        while self._waiting and len(self._running) + len(batch) < self.max_batch_size:
            longest = max([len(r.prompt_ids) for r in batch] + [len(self._waiting[0].prompt_ids)])
            if batch and longest * (len(batch) + 1) > self.max_prefill_tokens:
                break
            batch.append(self._waiting.popleft())
        return self._prefill(batch) if batch else []

    def _prefill(self, batch: list[Request]) -> list[StreamDelta]:
        t0 = self._now()
        b, first_row = len(batch), len(self._running)
        lengths = torch.tensor([len(r.prompt_ids) for r in batch], device=self.device)  # [B]
        p = int(lengths.max())
        ids = torch.zeros(b, p, dtype=torch.int64, device=self.device)  # [B, P] right-padded
        for i, r in enumerate(batch):
            ids[i, : len(r.prompt_ids)] = torch.tensor(r.prompt_ids, device=self.device)
        cols = torch.arange(p, device=self.device).expand(b, p)  # [B, P]
        real = cols < lengths[:, None]  # [B, P]
        causal = cols[0][None, :, None] >= cols[0][None, None, :]  # [1, P, P] query i sees key j <= i
        mask = (causal & real[:, None, :])[:, None]  # [B, 1, P, P]
        write = self.cache.at(
            slice(first_row, first_row + b), torch.where(real, cols, self.cache.scratch), span=p
        )
        drafting = any(r.drafts for r in batch)
        feature_layers = self.drafter.target_layer_ids if drafting else None
        hidden, features = self.forward(ids, cols, write, mask, feature_layers)  # [B, P, H], [B, P, F * H]
        logits = self.lm_head(hidden[torch.arange(b, device=self.device), lengths - 1])  # [B, V]
        roots = self._pick(logits, batch)
        deltas = []
        seconds = self._now() - t0
        for i, (r, root) in enumerate(zip(batch, roots, strict=True)):
            r.row, r.start, r.root = first_row + i, len(r.prompt_ids), root
            self._running.append(r)
            if r.drafts:
                r.draft_row, r.draft_len = len(self._drafting), 0
                r.features = [features[i, : r.start]]  # [P_i, F * H]
                self._drafting.append(r)
            want = r.params.logprobs is not None
            r.output.write(
                [root], token_logprobs(logits[i : i + 1], [root], r.params.logprobs) if want else None
            )
            r.stats.prefill_seconds = seconds
            deltas.append(self._delta(r, 0))
        self._ingest([r for r in batch if r.drafts])
        for r in batch:
            if r.output.finish_reason is not None:
                self._release(r)
        return deltas

    def _ingest(self, rows: list[Request]) -> None:
        """Give the drafter the new rows' prompts now, in the prefill's step (whose shapes vary anyway), so a
        round's drafter pass only ever sees what one round commits."""
        if rows:
            first = rows[0].draft_row  # admitted rows take the last drafter rows, in order
            self._draft_pass(
                rows, len(rows), max(r.start for r in rows), slice(first, first + len(rows)), fixed=False
            )

    def _pick(self, logits: torch.Tensor, batch: list[Request]) -> list[int]:
        """The first token of each request, straight from the prefill logits [B, V]."""
        roots = logits.argmax(dim=-1).tolist()
        sampled = [i for i, r in enumerate(batch) if not r.params.greedy]
        if sampled:
            probs = filtered_probs(
                logits[sampled][:, None], SamplingTensors.from_params([batch[i].params for i in sampled])
            )[:, 0]  # [S, V]
            coins = torch.stack([torch.rand((), generator=batch[i].generator) for i in sampled])  # [S]
            for i, token in zip(sampled, sample_rows(probs, coins), strict=True):
                roots[i] = token
        return roots

    def _release(self, r: Request) -> None:
        """Free a request's rows, keeping the running rows contiguous: the last row moves into the gap."""
        last = self._running.pop()
        if last is not r:
            self.cache.copy_row(last.row, r.row, last.start)
            last.row = r.row
            self._running[r.row] = last
        if r.drafts:
            last = self._drafting.pop()
            if last is not r:
                self.draft_cache.copy_row(last.draft_row, r.draft_row, last.draft_len)
                last.draft_row = r.draft_row
                self._drafting[r.draft_row] = last
        r.row = r.draft_row = -1
        r.features = []

    # -- the round ---------------------------------------------------------------------------------------

    def _round(self) -> list[StreamDelta]:
        """Draft, build every row's tree, verify all trees in one target forward, accept, commit.

        Stages are timed (waiting for the device at each boundary) only when profiling or when "auto" rows
        need the cost model; otherwise the round waits only where the host needs device results (the draft
        logits for the trees, the verify results for the accept step).
        """
        rows = list(self._running)  # in cache-row order
        timing = self.profile or any(r.auto for r in rows)
        t_round = self._now(timing)
        seconds = dict.fromkeys(STAGES, 0.0)
        # "auto" rows skip the drafter during a stretch of plain rounds (drafting did not pay lately).
        drafting = [r for r in self._drafting if not (r.auto and self.auto_skip)]
        self.auto_skip = max(self.auto_skip - 1, 0)
        with self._stage(seconds, "draft", timing):
            draft_logits = self._draft(drafting) if drafting else {}
        with self._stage(seconds, "tree", timing):
            trees = [self._tree(r, draft_logits.get(r.request_id)) for r in rows]
            if any(r.auto and r.request_id in draft_logits for r in rows):
                trees = self._choose_auto(rows, trees, len(drafting))
        with self._stage(seconds, "inputs", timing):
            batch = self._verify_inputs(rows, trees)
            sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
            retrieves = {
                i: compile_ddtree_retrieve(trees[i].parents, trees[i].logw)
                if trees[i].num_nodes > 1
                else None
                for i in sampled
            }
        with self._stage(seconds, "verify", timing):
            hidden, features = self._verify_forward(
                batch.ids, batch.positions, batch.cols, batch.starts, batch.anc, batch.span
            )  # [B', N', H], [B', N', F * H]: padded with fixed shapes
            hidden = hidden[: batch.rows, : batch.nodes]  # [B, N, H]
            features = None if features is None else features[: batch.rows, : batch.nodes]
            # The LM head closes the target forward. Sampling reads every node's distribution; the greedy
            # walk reads only the nodes it accepts.
            greedy_heads = self._greedy_heads(rows, trees, hidden)
            probs = None
            if sampled:
                logits = self.lm_head(hidden[sampled])  # [S, N, V]
                probs = filtered_probs(logits, SamplingTensors.from_params([rows[i].params for i in sampled]))
        with self._stage(seconds, "accept", timing):
            verdicts = self._accept(rows, trees, greedy_heads, sampled, retrieves, probs)
        self._learn(rows, trees, verdicts)
        with self._stage(seconds, "commit", timing):
            deltas = self._commit(rows, verdicts, hidden, features)
        elapsed = self._now(timing) - t_round
        if timing:
            self.cost.observe(batch.ids.numel(), seconds["verify"], len(drafting), seconds["draft"], elapsed)
        for r in rows:
            for name, value in seconds.items():
                r.stats.stage_seconds[name] += value
            r.stats.decode_seconds += elapsed
        return deltas

    def _draft(self, rows: list[Request]) -> dict[str, torch.Tensor]:
        """One drafter pass over these rows' [root, MASK x (block_size - 1)]; returns each row's draft
        logits [depth, V] (depth as deep as its tree can grow).

        A row's context may hold the features of several rounds (budget "auto" skips the drafter while
        drafting does not pay): the pass catches up on all of them, so the drafter's cache ends up exactly
        as if it had drafted every round. With fixed shapes the pass covers every drafting row (those not
        drafting this round idle in it), padded to a batch bucket, with a context of one block: a longer
        backlog repeats the same pass, and the last one drafts.
        """
        if self.fixed_shapes:
            drafting = {id(r) for r in rows}
            slots = [r if id(r) in drafting else None for r in self._drafting]
            b = pick(self.batch_buckets, len(slots))
            hidden = self._draft_pass(slots, b, self.drafter.block_size, slice(0, b), fixed=True)
            while any(r.features for r in rows):
                hidden = self._draft_pass(slots, b, self.drafter.block_size, slice(0, b), fixed=True)
            index = [r.draft_row for r in rows]
        else:
            cache_rows = [r.draft_row for r in rows]
            contiguous = cache_rows == list(range(cache_rows[0], cache_rows[0] + len(rows)))
            where = (
                slice(cache_rows[0], cache_rows[0] + len(rows))
                if contiguous
                else torch.tensor(cache_rows, device=self.device)
            )
            width = max(sum(x.shape[0] for x in r.features) for r in rows)
            hidden = self._draft_pass(rows, len(rows), width, where, fixed=False)
            index = list(range(len(rows)))
        depths = [self._draft_depth(r) for r in rows]
        hidden = hidden[index, 1 : 1 + max(depths)].to(self.draft_head.dtype)  # [B, depth, H]
        logits = F.linear(hidden, self.draft_head, self.draft_head_bias).float()  # [B, depth, V]
        return {r.request_id: logits[i, : depths[i]] for i, r in enumerate(rows)}

    def _draft_pass(
        self,
        slots: list[Request | None],
        b: int,
        c: int,
        where: slice | torch.Tensor,
        fixed: bool,
        span: int | None = None,
    ) -> torch.Tensor:
        """One drafter forward over ``b`` cache rows (``fixed``: a captured shape and span bucket).

        Slot i (its request, or None to idle) consumes up to ``c`` of its pending context features and
        places its block right after them. Returns the blocks' hidden states [b, S, H]; a row's drafts are
        valid once its whole context is consumed.

        Idle and padding rows write only the scratch column and see column 0, so they stay finite and
        change nothing.
        """
        bs, device = self.drafter.block_size, self.device
        scratch = self.draft_cache.scratch
        width = len(self.drafter.target_layer_ids) * self.embed.embedding_dim
        features = torch.zeros(b, c, width, dtype=self.dtype, device=device)  # [b, C, F * H]
        block = np.full((b, bs), self.drafter.mask_token_id, dtype=np.int64)  # [b, S]
        ctx_positions = np.zeros((b, c), dtype=np.int64)
        ctx_cols = np.full((b, c), scratch, dtype=np.int64)
        block_cols = np.full((b, bs), scratch, dtype=np.int64)
        block_positions = np.broadcast_to(np.arange(bs), (b, bs))
        ends = np.ones(b, dtype=np.int64)
        for i, r in enumerate(slots):
            if r is None:
                continue
            pending = torch.cat(r.features) if len(r.features) > 1 else r.features[0] if r.features else None
            k = 0 if pending is None else min(c, pending.shape[0])
            if k:
                features[i, :k] = pending[:k]
                ctx_cols[i, :k] = ctx_positions[i, :k] = r.draft_len + np.arange(k)
                r.draft_len += k
                r.features = [pending[k:]] if pending.shape[0] > k else []
            block[i, 0] = r.root
            block_cols[i] = r.draft_len + np.arange(bs)  # after the consumed context
            ends[i] = r.draft_len + bs
        inputs = self._inputs.load(
            fixed,
            block=block,
            features=features,
            ctx_positions=ctx_positions,
            ctx_cols=ctx_cols,
            block_positions=np.where(block_cols == scratch, block_positions, block_cols),
            block_cols=block_cols,
            ends=ends,
        )
        if fixed:
            span = span or self._draft_span(int(ends.max()))
        else:
            span = int(ends.max())
        return (self._draft_forward if fixed else self._draft_forward_eager)(*inputs, where, span)

    def _draft_span(self, needed: int) -> int:
        """The drafter's span bucket for ``needed`` columns: a verify span bucket (its context) plus the
        S columns of the block after it, within the drafter's row."""
        whole = self.draft_cache.capacity + 1
        return min(
            pick(self.span_buckets, max(needed - self.drafter.block_size, 1)) + self.drafter.block_size, whole
        )

    def _room(self, r: Request) -> int:
        """Tree nodes row r can still hold: its cache columns from ``start`` to the capacity."""
        return self.max_model_len - r.start

    def _budget(self, r: Request) -> int:
        """Nodes of the tree built this round; for "auto", candidates: a few more than chosen last time
        (building candidates costs host time whether or not they are verified)."""
        return min(self.auto_max_budget, r.auto_width + 4) if r.auto else r.budget

    def _draft_depth(self, r: Request) -> int:
        # A tree of `budget` nodes is at most `budget` deep: deeper rows would never be read.
        block = self.drafter.block_size - 1
        depth = block if r.method == "dflash" else min(self._budget(r), block)
        return max(1, min(depth, self._room(r) - 1))

    def _tree(self, r: Request, draft_logits: torch.Tensor | None) -> DraftTree:
        """Row r's tree: the root alone (``ar``, or no draft this round), the argmax chain (``dflash``) or
        the best-first tree (``ddtree``; with budget "auto", of ``auto_max_budget`` candidates)."""
        # Drafted nodes that fit in the row and in the largest node bucket (a tree never changes the output).
        room = min(self._room(r) - 1, self.max_drafted)
        if draft_logits is None or room < 1:
            return DraftTree.root_only(r.root)
        if r.method == "dflash":
            depth = min(draft_logits.shape[0], room)
            return build_ddtree_tree(draft_logits, depth, topk=1, root_token=r.root)
        if self.sampling_aware_trees and not r.params.greedy:
            sampling = SamplingTensors.from_params([r.params], draft_logits.device)
            draft_logits = filtered_probs(draft_logits[None], sampling)[
                0
            ].log()  # [depth, V], -inf = filtered
        return build_ddtree_tree(draft_logits, min(self._budget(r), room), topk=r.topk, root_token=r.root)

    def _choose_auto(self, rows: list[Request], trees: list[DraftTree], draft_rows: int) -> list[DraftTree]:
        """Cut every "auto" row's candidate tree to the prefix of its pop order that maximises the batch's
        expected tokens per second (ddtree.budget), and start a stretch of plain rounds for the auto rows
        when even the best pick loses to a round without the drafter."""
        if not (self._costs_measured or self.cost.frozen):
            self._measure_costs()
        auto = [i for i, r in enumerate(rows) if r.auto and trees[i].num_nodes > 1]
        base = float(len(rows))  # every row commits at least its bonus token
        for i, tree in enumerate(trees):
            if i not in auto and tree.num_nodes > 1:
                base += self._expected_accepts(rows[i], tree.logw[1:].exp().numpy()).sum()
        widest_fixed = max((t.num_nodes for i, t in enumerate(trees) if i not in auto), default=1)
        b = len(rows)

        def seconds(total: np.ndarray, widest: np.ndarray) -> np.ndarray:
            width = np.maximum(widest + 1, widest_fixed)  # the forward pads every row to the widest tree
            return self.cost.round_seconds(b * width, draft_rows)

        probs = [trees[i].logw[1:].exp().numpy() for i in auto]  # [n_i] path probabilities, pop order
        gains = [self._expected_accepts(rows[i], p) for i, p in zip(auto, probs, strict=True)]
        counts = choose_counts(probs, gains, base, seconds)
        # Drafting pays when the chosen trees beat a plain round that skips the drafter altogether.
        chosen_gain = base + sum(g[:k].sum() for g, k in zip(gains, counts, strict=True))
        widest = max(counts, default=0)
        rate = chosen_gain / seconds(np.array(sum(counts)), np.array(widest))
        plain_rate = base / self.cost.round_seconds(b * widest_fixed, draft_rows - len(auto))
        # The drafter pass costs about the same for one row as for all, so the stretch is batch-wide.
        if rate < plain_rate:  # back off: 1, 2, 4, ... plain rounds, then probe again
            self._auto_backoff = min(max(2 * self._auto_backoff, 1), self.AUTO_MAX_BACKOFF)
            self.auto_skip = self._auto_backoff
        else:
            self._auto_backoff = 0
        out = list(trees)
        for i, k in zip(auto, counts, strict=True):
            out[i] = trees[i].prefix(k + 1)
            rows[i].auto_width = k
        return out

    AUTO_MAX_BACKOFF = 128  # the longest stretch of plain rounds before "auto" rows draft again

    def _expected_accepts(self, r: Request, probs: np.ndarray) -> np.ndarray:
        return self.calibration.calibrate("greedy" if r.params.greedy else "sampled", probs)

    def _learn(self, rows: list[Request], trees: list[DraftTree], verdicts: list) -> None:
        """Record each row's drafted nodes and calibrate draft path probabilities against what the target
        accepted (ddtree rows)."""
        for r, tree, (nodes, _) in zip(rows, trees, verdicts, strict=True):
            r.stats.drafted_nodes.append(tree.num_nodes - 1)
            if r.method != "ddtree" or tree.num_nodes == 1:
                continue
            accepted = np.zeros(tree.num_nodes - 1, dtype=bool)
            accepted[[j - 1 for j in nodes[1:]]] = True
            kind = "greedy" if r.params.greedy else "sampled"
            self.calibration.observe(kind, tree.logw[1:].exp().numpy(), accepted)

    def _measure_costs(self) -> None:
        """Seed the cost model with a few timed forwards in a free cache row (none free: online fit only)."""
        self._costs_measured = True
        row = len(self._running)
        if row >= self.max_batch_size:
            return
        for tokens in (1, 8, 32, 8, 1, 32):
            ids = torch.zeros(1, tokens, dtype=torch.int64, device=self.device)
            cols = torch.arange(tokens, device=self.device)[None]
            mask = torch.ones(1, 1, tokens, tokens, dtype=torch.bool, device=self.device)
            t = self._now()
            with torch.inference_mode():
                self.forward(ids, cols, self.cache.at(slice(row, row + 1), cols, tokens), mask)
            self.cost.verify.observe(tokens, self._now() - t)

    def _verify_inputs(
        self, rows: list[Request], trees: list[DraftTree], shape: tuple[int, int, int] | None = None
    ) -> VerifyBatch:
        """Every row's tree as one padded batch: to the widest tree, or with fixed shapes to the buckets
        that hold the batch (``shape`` = rows, nodes, span forces one, for the warm-up)."""
        sizes = [t.num_nodes for t in trees]
        b, n = len(rows), max(sizes, default=1)
        starts = np.array([r.start for r in rows], dtype=np.int64)  # [B]
        needed = int(max((s + m for s, m in zip(starts, sizes, strict=True)), default=1))
        if shape is not None:
            bp, np_, span = shape
        elif self.fixed_shapes:
            bp, np_ = pick(self.batch_buckets, b), pick(self.node_buckets, n)
            span = pick(self.span_buckets, needed)
        else:
            bp, np_, span = b, n, needed
        all_starts = np.ones(bp, dtype=np.int64)  # a dummy row sees column 0 (a masked-out row is NaN)
        all_starts[:b] = starts
        ids = np.zeros((bp, np_), dtype=np.int64)
        positions = np.repeat(all_starts[:, None], np_, axis=1)  # [B, N]; padding sits at the root's position
        cols = np.full((bp, np_), self.cache.scratch, dtype=np.int64)  # [B, N]
        anc = np.zeros((bp, np_, np_), dtype=bool)  # [B, N, N]; padding sees committed columns only
        for i, (tree, start, m) in enumerate(zip(trees, starts, sizes, strict=True)):
            tree_ids, tree_positions, tree_anc = tree_verify_inputs(tree, int(start))  # [m], [m], [m, m]
            ids[i, :m], positions[i, :m], anc[i, :m, :m] = tree_ids, tree_positions, tree_anc
            cols[i, :m] = np.arange(start, start + m)
        tensors = self._inputs.load(
            self.fixed_shapes, ids=ids, positions=positions, cols=cols, starts=all_starts, anc=anc
        )
        return VerifyBatch(*tensors, span=span, rows=b, nodes=n)

    def _greedy_heads(
        self, rows: list[Request], trees: list[DraftTree], hidden: torch.Tensor
    ) -> dict[int, Callable[[int], int]]:
        """For each greedy row i, the target's argmax at its node j, from the final hidden states [B, N, H].

        On an accelerator one head over all greedy rows is one kernel and one transfer. On the CPU the head's
        cost grows with its rows, and the walk usually accepts along the first-child chain (the drafter's
        top token at each depth): those rows of every greedy tree go through the head together, and a node
        off the chain gets its row when the walk reaches it (counted in the accept stage).
        """
        greedy = [i for i, r in enumerate(rows) if r.params.greedy]
        if not greedy:
            return {}
        if self.device.type != "cpu":
            argmax = self.lm_head(hidden[greedy]).argmax(dim=-1).tolist()  # [G, N]
            return {i: argmax[k].__getitem__ for k, i in enumerate(greedy)}
        chains = {i: first_child_chain(trees[i]) for i in greedy}
        row_idx = torch.tensor([i for i in greedy for _ in chains[i]], device=self.device)
        node_idx = torch.tensor([j for i in greedy for j in chains[i]], device=self.device)
        argmax = iter(self.lm_head(hidden[row_idx, node_idx]).argmax(dim=-1).tolist())
        heads = {}
        for i in greedy:
            known = {j: next(argmax) for j in chains[i]}

            def target_token(j: int, known: dict[int, int] = known, i: int = i) -> int:
                if j not in known:
                    known[j] = int(self.lm_head(hidden[i, j : j + 1]).argmax())
                return known[j]

            heads[i] = target_token
        return heads

    def _accept(
        self,
        rows: list[Request],
        trees: list[DraftTree],
        greedy_heads: dict[int, Callable[[int], int]],
        sampled: list[int],
        retrieves: dict,
        probs: torch.Tensor | None,
    ) -> list[tuple[list[int], list[int]]]:
        """Per row: (accepted nodes, root first; emitted tokens, bonus last)."""
        verdicts: list = [None] * len(rows)
        for i, head in greedy_heads.items():
            verdicts[i] = follow_verified_tree(trees[i], head)
        if sampled:
            # Each row draws from its own generator, in the same order alone or in a batch.
            coins, finals = [], []
            for i in sampled:
                coins.append(torch.rand(trees[i].num_nodes, generator=rows[i].generator, device=self.device))
                finals.append(torch.rand((), generator=rows[i].generator, device=self.device))
            drawn = sample_trees(
                [trees[i] for i in sampled],
                [retrieves[i] for i in sampled],
                probs,
                coins,
                torch.stack(finals),
                threshold_single=self.accept_threshold_single,
                threshold_acc=self.accept_threshold_acc,
            )
            for i, verdict in zip(sampled, drawn, strict=True):
                verdicts[i] = verdict
        return verdicts

    def _commit(
        self,
        rows: list[Request],
        verdicts: list[tuple[list[int], list[int]]],
        hidden: torch.Tensor,
        features: torch.Tensor | None,
    ) -> list[StreamDelta]:
        """Pack every row's accepted keys/values after its committed tokens, write its tokens and keep its
        accepted nodes' drafter features."""
        pack_accepted(self.cache, list(range(len(rows))), [r.start for r in rows], [v[0] for v in verdicts])
        deltas = []
        for i, (r, (nodes, tokens)) in enumerate(zip(rows, verdicts, strict=True)):
            logprobs = None
            if r.params.logprobs is not None:
                logprobs = token_logprobs(self.lm_head(hidden[i, nodes]), tokens, r.params.logprobs)
            before = len(r.output.token_ids)
            taken = r.output.write(tokens, logprobs)
            m = len(nodes)
            if r.drafts:  # [N, F * H] -> [m, F * H]; a first-child chain needs no gather
                # Rows that skipped the drafter this round keep their earlier unconsumed features too.
                # A copy: the forward's output buffer is reused by the next round (CUDA graphs).
                r.features.append(features[i, :m].clone() if nodes[-1] == m - 1 else features[i, nodes])
            r.start += m
            r.root = tokens[-1]
            r.stats.acceptance_lengths.append(len(tokens))
            r.stats.decode_tokens += taken
            deltas.append(self._delta(r, before))
        for r in rows:
            if r.output.finish_reason is not None:
                self._release(r)
        return deltas

    def _delta(self, r: Request, before: int) -> StreamDelta:
        """What request r's output gained since it held ``before`` tokens."""
        return StreamDelta(
            request_id=r.request_id,
            token_ids=r.output.token_ids[before:],
            text=r.output.new_text(),
            finish_reason=r.output.finish_reason,
            stats=r.stats,
            logprobs=r.output.logprobs[before:],
        )

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


__all__ = ["METHODS", "STAGES", "Engine", "GenerationResult", "GenerationStats", "Request", "StreamDelta"]
