"""The models and their memory: the target's and drafter's weights, the KV caches, the fixed shapes and
their compiled forwards. Everything that runs a model goes through here; nothing here decides who runs.

Three forwards: the prefill (a batch of prompts, any shape), the round's verify forward (every row's tree)
and the drafter pass. With fixed shapes the last two run at a few padded shapes (``ddtree.capture``), each
compiled (CUDA graphs on CUDA) and warmed up once at start-up.
"""

from __future__ import annotations

import copy

import torch

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
from ddtree.drafter import DFlashDrafter
from ddtree.engine.scheduler import RowMove
from ddtree.errors import DDTreeError
from ddtree.forward import TargetForward
from ddtree.kv_cache import KVCache


def fast_low_precision(device: torch.device) -> torch.dtype:
    """bfloat16 where matmuls run it natively (CUDA with bf16, CPUs with AVX512-BF16), else float32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    native = device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()
    return torch.bfloat16 if native else torch.float32


def with_mlp_dtype(drafter: DFlashDrafter, dtype: torch.dtype) -> DFlashDrafter:
    """``drafter``, or a copy of it whose MLP weights are ``dtype`` (the caller's module is left alone)."""
    if all(p.dtype == dtype for layer in drafter.layers for p in layer.mlp.parameters()):
        return drafter
    drafter = copy.deepcopy(drafter)
    for layer in drafter.layers:
        layer.mlp.to(dtype)
    return drafter


class ModelRunner:
    """The target and drafter on one device, with a fixed KV cache row per running request."""

    def __init__(
        self,
        target,
        drafter: DFlashDrafter | None,
        max_batch_size: int,
        max_model_len: int,
        draft_dtype: torch.dtype | None = None,
    ) -> None:
        self.target = target
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.forward = TargetForward(target)
        # The drafter only proposes tokens, so rounding in its matmuls cannot change what is emitted. Its
        # LM head (a copy of the target's) and its MLPs, the largest matmuls of a draft pass, run in
        # `draft_dtype`: bf16 reads half the bytes and runs natively where supported (attention and norms
        # stay in the model's dtype: bf16 is slower there on CPUs).
        draft_dtype = draft_dtype or fast_low_precision(self.device)
        self.draft_head = self.lm_head.weight.detach().to(draft_dtype)  # [V, H]
        self.draft_head_bias = (
            None if self.lm_head.bias is None else self.lm_head.bias.detach().to(draft_dtype)
        )
        self.drafter = None if drafter is None else with_mlp_dtype(drafter.eval(), draft_dtype)
        self.max_model_len = max_model_len
        # Fixed caches, sized once: a row per running request, the whole context per row.
        self.cache = self.forward.new_cache(max_batch_size, max_model_len)
        self.draft_cache = None
        if self.drafter is not None:
            attn = self.drafter.layers[0].self_attn
            self.draft_cache = KVCache(
                len(self.drafter.layers),
                max_batch_size,
                attn.num_kv_heads,
                attn.head_dim,
                max_model_len + self.drafter.block_size,  # the block sits after the context
                next(attn.parameters()).dtype,
                self.device,
            )
        self.fixed_shapes = False
        self.compiled = False
        self.max_drafted = max_model_len  # drafted nodes a tree may hold (with fixed shapes: a bucket)
        self.inputs = StaticInputs(self.device, static=False)
        self.verify_forward = self.verify_forward_eager
        self.draft_forward = self.draft_forward_eager

    def setup_shapes(
        self,
        compile: bool,
        fixed_shapes: bool | None,
        max_batch_size: int,
        deepest: int,
        batch_buckets: list[int] | None,
        node_buckets: list[int] | None,
        span_buckets: list[int] | None,
    ) -> None:
        """Choose the shapes every round is padded to (``deepest``: the most drafted nodes a configured tree
        asks for) and, with ``compile``, compile the two round forwards (the engine then warms them up).

        Attention reads a span bucket of leading cache columns: by default the whole row (one graph per
        batch and node bucket); more buckets make short rows read less (the CPU, long contexts) at the
        price of more graphs."""
        self.fixed_shapes = compile if fixed_shapes is None else bool(fixed_shapes)
        if compile and not self.fixed_shapes:
            raise DDTreeError("compile=True needs fixed shapes (fixed_shapes=False was given)")
        self.compiled = bool(compile)
        self.inputs = StaticInputs(self.device, static=compile and self.device.type == "cuda")
        if not self.fixed_shapes:
            if batch_buckets is not None or node_buckets is not None or span_buckets is not None:
                raise DDTreeError("batch, node and span buckets need fixed shapes (compile=True)")
            return
        if self.drafter is not None:
            deepest = max(deepest, self.drafter.block_size - 1)  # the dflash chain
        buckets = check_batch_buckets("batch_buckets", batch_buckets, max_batch_size)
        self.batch_buckets = buckets or batch_ladder(max_batch_size)
        self.node_buckets = check_buckets("node_buckets", node_buckets) or node_ladder(deepest)
        self.max_drafted = self.node_buckets[-1] - 1
        whole = self.cache.capacity + 1  # the last span bucket is always the whole row
        spans = check_buckets("span_buckets", span_buckets, whole) or ()
        self.span_buckets = tuple(sorted({*spans, whole}))
        if compile:
            shapes = len(self.batch_buckets) * len(self.node_buckets) * len(self.span_buckets)
            caches = [self.cache] + ([self.draft_cache] if self.draft_cache is not None else [])
            if self.device.type == "cuda":
                mark_static([buf for c in caches for buf in (*c.keys, *c.values)])
            self.verify_forward = compile_forward(self.verify_forward_eager, self.device, shapes)
            self.draft_forward = compile_forward(self.draft_forward_eager, self.device, shapes)

    def check_captured_budget(self, budget: int) -> None:
        if self.fixed_shapes and budget > self.max_drafted:
            raise DDTreeError(
                f"budget {budget} exceeds the largest node bucket ({self.max_drafted} drafted nodes); "
                "start the engine with node_buckets that hold it"
            )

    def prefill(
        self, prompts: list[list[int]], first_row: int, features: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompts into cache rows ``first_row ..``, as one right-padded causal forward: the logits of each
        prompt's last position [B, V] and, when ``features``, every position's drafter features
        [B, P, F * H]."""
        b = len(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)  # [B]
        p = int(lengths.max())
        ids = torch.zeros(b, p, dtype=torch.int64, device=self.device)  # [B, P] right-padded
        for i, prompt in enumerate(prompts):
            ids[i, : len(prompt)] = torch.tensor(prompt, device=self.device)
        cols = torch.arange(p, device=self.device).expand(b, p)  # [B, P]
        real = cols < lengths[:, None]  # [B, P]
        causal = cols[0][None, :, None] >= cols[0][None, None, :]  # [1, P, P] query i sees key j <= i
        mask = (causal & real[:, None, :])[:, None]  # [B, 1, P, P]
        write = self.cache.at(
            slice(first_row, first_row + b), torch.where(real, cols, self.cache.scratch), span=p
        )
        feature_layers = self.drafter.target_layer_ids if features else None
        hidden, feats = self.forward(ids, cols, write, mask, feature_layers)  # [B, P, H], [B, P, F * H]
        return self.lm_head(hidden[torch.arange(b, device=self.device), lengths - 1]), feats  # [B, V]

    def verify_forward_eager(
        self,
        ids: torch.Tensor,  # [B, N]
        positions: torch.Tensor,  # [B, N]
        cols: torch.Tensor,  # [B, N]
        starts: torch.Tensor,  # [B]
        anc: torch.Tensor,  # [B, N, N]
        span: int,
        features: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The round's target forward over cache rows [0, B): final hidden states [B, N, H] and, when
        ``features`` (always with fixed shapes and a drafter: one graph per shape), drafter features
        [B, N, F * H]."""
        features = self.drafter is not None and (self.fixed_shapes or features)
        write = self.cache.at(slice(0, ids.shape[0]), cols, span)
        mask = tree_mask(starts, anc, span)  # [B, 1, N, span]
        return self.forward(ids, positions, write, mask, self.drafter.target_layer_ids if features else None)

    def draft_forward_eager(
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

    def draft_span(self, needed: int) -> int:
        """The drafter's span bucket for ``needed`` columns: a verify span bucket (its context) plus the
        S columns of the block after it, within the drafter's row."""
        whole = self.draft_cache.capacity + 1
        return min(
            pick(self.span_buckets, max(needed - self.drafter.block_size, 1)) + self.drafter.block_size, whole
        )

    def move_rows(self, moves: list[RowMove]) -> None:
        """Copy the rows the scheduler moved (a released row's gap filled by the last row)."""
        for m in moves:
            (self.draft_cache if m.drafter else self.cache).copy_row(m.src, m.dst, m.length)

    def timed_forward(self, row: int, tokens: int, now) -> float:
        """Seconds of a ``tokens``-token forward in a free cache row (the auto budget's cost model)."""
        ids = torch.zeros(1, tokens, dtype=torch.int64, device=self.device)
        cols = torch.arange(tokens, device=self.device)[None]
        mask = torch.ones(1, 1, tokens, tokens, dtype=torch.bool, device=self.device)
        t = now()
        with torch.inference_mode():
            self.forward(ids, cols, self.cache.at(slice(row, row + 1), cols, tokens), mask)
        return now() - t
