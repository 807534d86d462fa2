"""The models and their memory: the target's and drafter's weights and the paged KV caches (planned by
``memory.plan_pool``). Everything that runs a model goes through here; nothing here decides who runs.

Three forwards: the prefill (a batch of prompt chunks, any shape), the round's verify forward (every row's
tree) and the drafter pass; the last two run at the round's shapes (``RoundShapes``), with fixed shapes
each compiled (CUDA graphs on CUDA) and warmed up once at start-up.

Under tensor parallelism (``ddtree.engine.step_channel``) rank 0's runner holds the drafter, the LM head
and its shard of the target; every other rank's runner (``ModelRunner.worker``) holds its shard alone,
and the ``@replicated`` methods, which touch the target, run on every rank with the same arguments.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from ddtree.config import EngineConfig
from ddtree.engine.memory import CacheConfig, KVPlan, StepModel, plan_pool, pool_bytes, pool_layouts
from ddtree.engine.round_shapes import RoundShapes
from ddtree.engine.step_channel import StepChannel, close_channel, replicated
from ddtree.model import invariance
from ddtree.model.capture import compile_forward, mark_static, tree_mask, upload
from ddtree.model.forward import Float32Linear, TargetForward
from ddtree.model.invariance import ExactRows
from ddtree.model.kv_cache import KVLayout, PagedKVCache, pack_buffers
from ddtree.model.precision import (
    FLOAT32_PREFILL_TOKENS,
    HALF_PRECISION,
    draft_parts,
    emulated_half,
    head_floor_rows,
)
from ddtree.speculative.dflash2 import DFlash2Drafter
from ddtree.speculative.drafter import DFlashDrafter


class ModelRunner:
    """The target and drafter on one device, with paged KV caches the block tables of requests index."""

    def __init__(
        self,
        target,
        drafter: DFlashDrafter | None,
        max_num_seqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        max_nodes: int,
        cache_config: CacheConfig,
        explicit_len: bool,
        draft_dtype: torch.dtype | None = None,
        channel: StepChannel | None = None,
        pool: tuple[KVPlan, int] | None = None,
    ) -> None:
        """``channel``: this rank's step channel under tensor parallelism (``target`` is then its shard);
        ``pool``: a worker rank's KV plan and drafter block, rank 0's (``rank_worker.worker_runner``)."""
        self.target, self.channel = target, channel
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        self.embed, self.lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        # where rows may be exact (``exact_rows``): in float32 a row's company moves its logits ~1e-7
        self.low_precision = self.dtype in HALF_PRECISION
        self._exact: tuple[tuple[tuple[int, ...], int], ExactRows] | None = None  # the last exact rows asked
        if self.low_precision:
            invariance.install(target)
        self.forward = TargetForward(target, None if channel is None else channel.tp)
        self.head_floor_rows = head_floor_rows(self.device, self.lm_head.weight)
        self.drafter, self.draft_head, self.draft_head_bias = draft_parts(drafter, self.lm_head, draft_dtype)
        # Columns a pass writes after its context; a worker's are rank 0's (its block tables have that width)
        self.draft_block = pool[1] if pool is not None else 0 if drafter is None else drafter.block_size
        self.block_size = cache_config.block_size
        steps = (max_num_batched_tokens, max_num_seqs, max_nodes)
        model = StepModel(self.forward, self.lm_head, self.dtype, self.device, self.drafter, self.block_size)
        plan, self.profiled_activation_bytes = pool[0] if pool else None, None  # the largest step's peak
        if pool is None:
            args = (cache_config, self.request_blocks, steps, max_model_len, explicit_len)
            plan, self.profiled_activation_bytes = plan_pool(model, target.config, *args, channel is None)
        layouts = pool_layouts(replace(model, wide=plan.wide))
        self.kv_cache_bytes_per_token, self.block_bytes = pool_bytes(layouts, self.block_size)
        self.allocate(plan, layouts)
        self.verify_forward, self.draft_forward = self.verify_forward_eager, self.draft_forward_eager
        if channel is not None and channel.leader:  # the other ranks build their runners like this one
            channel.send("init", (steps, cache_config, plan, self.draft_block))

    def request_blocks(self, length: int) -> int:
        """Block-table entries of a request of ``length`` tokens: its context, then the widest of the
        round's tree and the drafter's block."""
        return -(-(length + max(self.draft_block, 1)) // self.block_size)

    def allocate(self, plan: KVPlan, layouts: list[tuple[int, KVLayout, torch.dtype]]) -> None:
        """The paged KV pools of ``plan`` (the target's, then the drafter's) and the round's shapes over
        their rows (nano-vllm's runner: allocation, then capture in ``setup_shapes``)."""
        self.num_blocks, self.max_model_len = plan.num_blocks, plan.max_model_len
        self.width = self.request_blocks(self.max_model_len)
        caches = [
            PagedKVCache(n, self.num_blocks, self.block_size, self.width, layout, dt, self.device)
            for n, layout, dt in layouts
        ]
        self.cache = caches[0]
        self.draft_cache = caches[1] if self.drafter is not None else None
        self.kv_cache_bytes = sum(c.nbytes() for c in caches)
        deepest = 0 if self.drafter is None else self.drafter.block_size - 1
        lattice = isinstance(self.drafter, DFlash2Drafter)
        self.shapes = RoundShapes(self.device, self.block_size, self.width, deepest, lattice)

    def close(self) -> None:
        """Rank 0 under tensor parallelism: end the other ranks (``ranks.close_channel``); a later forward
        raises. Once, and nothing to do in one process."""
        channel = self.channel
        if channel is not None and channel.leader and not channel.closed:
            close_channel(channel)

    @replicated
    def setup_shapes(self, config: EngineConfig, deepest: int) -> None:
        """Choose the shapes every round is padded to (``RoundShapes.setup``) and, with ``compile``,
        compile the verify and drafter forwards at them (the engine then warms them up)."""
        shapes = self.shapes.setup(config, deepest)
        if shapes:
            if self.device.type == "cuda":
                caches = [c for c in (self.cache, self.draft_cache) if c is not None]
                mark_static([buf for c in caches for buf in c.buffers])
            self.verify_forward = compile_forward(self.verify_forward_eager, self.device, shapes)
            self.draft_forward = compile_forward(self.draft_forward_eager, self.device, shapes)

    @replicated
    def prefill(
        self,
        chunks: list[tuple[list[int], int]],
        tables: np.ndarray,
        features: bool,
        scored: tuple = (),
        exact: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """Prompt chunks (tokens, and the columns already cached before them) into the rows whose block
        tables are ``tables``, as one right-padded causal forward: the logits of each chunk's last position
        [B, V], when ``features`` every position's drafter features [B, P, F * H], and the final hidden
        states of every position [L_i, H] of the rows ``scored`` (prompt logprobs). The rows ``exact`` are
        computed batch-invariantly (``ddtree.model.invariance``), their last positions' logits too."""
        b, device = len(chunks), self.device
        lengths = np.array([len(ids) for ids, _ in chunks])  # [B]
        offsets = np.array([offset for _, offset in chunks])[:, None]  # [B, 1]
        p = int(lengths.max())
        ids = np.zeros((b, p), dtype=np.int64)  # [B, P] right-padded
        for i, (chunk, _) in enumerate(chunks):
            ids[i, : len(chunk)] = chunk
        positions = offsets + np.arange(p)  # [B, P]
        ends = offsets + lengths[:, None]  # [B, 1] columns cached after this chunk
        cols = np.where(positions < ends, positions, self.cache.scratch)  # padding writes the scratch
        span = self.shapes.span(int(ends.max()))
        ids_t, positions_t, cols_t, ends_t, tables_t = (
            upload(x, device) for x in (ids, positions, cols, ends, tables)
        )
        keys = torch.arange(span, device=device)  # [span]
        # Query i sees the cached columns and the chunk's up to itself; a padding query sees the whole
        # chunk (finite, never read).
        mask = ((keys <= positions_t[:, :, None]) & (keys < ends_t[:, :, None]))[:, None]  # [B, 1, P, span]
        write = self.cache.at(tables_t, cols_t, span)
        feature_layers = self.drafter.target_layer_ids if features and self.drafter is not None else None
        upcast = emulated_half(device, self.dtype) and ids.size >= FLOAT32_PREFILL_TOKENS
        rows = self.exact_rows(exact, b)
        with Float32Linear() if upcast and rows is None else contextlib.nullcontext():
            # MLA expands keys/values from the latent here: many queries per row (``ddtree.model.forward``)
            hidden, feats = self.forward(ids_t, positions_t, write, mask, feature_layers, False, rows)
        if self.channel is not None and not self.channel.leader:
            return None, None, []  # rank 0 alone reads the logits
        last = upload(lengths - 1, device)
        with rows.linear() if rows is not None else contextlib.nullcontext():
            logits = self.lm_head(hidden[torch.arange(b, device=device), last])  # [B, V]
        return logits, feats, [hidden[i, : lengths[i]] for i in scored]

    @replicated
    def verify(
        self,
        ids: torch.Tensor,  # [B, N]
        positions: torch.Tensor,  # [B, N]
        cols: torch.Tensor,  # [B, N]
        starts: torch.Tensor,  # [B]
        anc: torch.Tensor,  # [B, N, N]
        tables: torch.Tensor,  # [B, width + 1]
        span: int,
        features: bool,
        exact: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The round's target forward (``verify_forward``: compiled with fixed shapes), through this round's
        flex block mask when ``attention="flex"``. A round with ``exact`` rows (batch indices) runs
        eagerly over SDPA's dense mask, which their float64 attention reads (``ddtree.model.invariance``)."""
        rows = self.exact_rows(exact, ids.shape[0])
        if rows is not None:
            args = (ids, positions, cols, starts, anc, tables, span, features)
            return self.verify_forward_eager(*args, exact=rows)
        block_mask = self.shapes.block_mask(self.cache, tables, starts, anc, ids.shape[1])
        return self.verify_forward(ids, positions, cols, starts, anc, tables, span, features, block_mask)

    def exact_rows(self, exact: tuple[int, ...], batch: int) -> ExactRows | None:
        """The forward's exact rows on the device (None: none, or a float32 target). In float32 a row's
        company moves its logits in the last bits only (~1e-7), so a seeded sample flips only at a CDF
        tie that close (none seen: ``test_seeded_equality.py``); bf16's 2^-8 flips one within 48 tokens
        for every prompt measured, so there the exact path pays for itself (``model.invariance``)."""
        if not exact or not self.low_precision:
            return None
        # The round's forward and its acceptance ask for the same rows, and a batch keeps them round after
        # round: one upload serves until they change (the indices are only read)
        if self._exact is None or self._exact[0] != (exact, batch):
            rows = upload(np.asarray(exact, dtype=np.int64), self.device)  # pinned: no wait
            self._exact = ((exact, batch), ExactRows(rows, batch))
        return self._exact[1]

    @replicated(deferred=True)
    def pack(
        self,
        tables: torch.Tensor,  # [B, width + 1]
        starts: torch.Tensor,  # [B]
        path: torch.Tensor,  # [B, S]
        lengths: torch.Tensor,  # [B]
        bucket: bool,
    ) -> None:
        """Each row's accepted keys/values right after its committed tokens (``kv_cache.pack_buffers``).
        ``bucket``: the shapes are a fixed-shape round's ([batch bucket, its tree depth bound + 1]), which
        go through the bucket's graph; other shapes run eagerly."""
        pack = self.shapes.pack_graph if bucket else pack_buffers
        pack(self.cache.buffers, tables, starts, path, lengths, self.cache.scratch, self.block_size)

    def verify_forward_eager(
        self,
        ids: torch.Tensor,  # [B, N]
        positions: torch.Tensor,  # [B, N]
        cols: torch.Tensor,  # [B, N]
        starts: torch.Tensor,  # [B]
        anc: torch.Tensor,  # [B, N, N]
        tables: torch.Tensor,  # [B, width + 1]
        span: int,
        features: bool,
        block_mask: BlockMask | None = None,
        exact: ExactRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The round's target forward over every row's tree: final hidden states [B, N, H] and, when
        ``features`` (always with fixed shapes and a drafter: one graph per shape), drafter features
        [B, N, F * H]. With a ``block_mask`` (flex), attention reads the pool through it."""
        features = self.drafter is not None and (self.shapes.fixed or features)
        if block_mask is None:
            write = self.cache.at(tables, cols, span)
            mask = tree_mask(starts, anc, span)  # [B, 1, N, span]
        else:
            write, mask = self.cache.at(tables, cols, None), block_mask
        layers = self.drafter.target_layer_ids if features else None
        return self.forward(ids, positions, write, mask, layers, exact=exact)

    def draft_forward_eager(
        self,
        block: torch.Tensor,  # [B, S] root, MASK ...
        features: torch.Tensor,  # [B, C, F * H] context features not yet cached (right-padded)
        ctx_positions: torch.Tensor,  # [B, C]
        ctx_cols: torch.Tensor,  # [B, C]; padding: scratch
        block_positions: torch.Tensor,  # [B, S]
        block_cols: torch.Tensor,  # [B, S]; a drafting row's columns are its positions; idle: scratch
        ends: torch.Tensor,  # [B] columns each row's block attends to: [0, end)
        tables: torch.Tensor,  # [B, width + 1]
        span: int,
        block_mask: BlockMask | None = None,
    ) -> torch.Tensor:
        """One drafter pass: the block's final hidden states [B, S, H]."""
        cols = torch.cat((ctx_cols, block_cols), dim=1)
        if block_mask is None:
            write = self.draft_cache.at(tables, cols, span)
            visible = torch.arange(span, device=ends.device)[None] < ends[:, None]  # [B, span]
            mask = visible[:, None, None]  # [B, 1, 1, span]
        else:
            write, mask = self.draft_cache.at(tables, cols, None), block_mask
        return self.drafter(self.embed(block), features, block_positions, ctx_positions, write, mask)

    def now(self) -> float:
        """The host clock once the device has caught up."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @replicated
    def timed_forward(self, rows: int, width: int, context: int) -> float:
        """Seconds of a forward of ``rows`` rows x ``width`` tokens, each reading ``context`` columns, that
        writes only the scratch block (the auto budget's cost model: each row of a round reads its own
        context, work a one-row forward does not show: 6 ms for one row here, 37 for 16 rows of ~600)."""
        ids = torch.zeros(rows, width, dtype=torch.int64, device=self.device)
        cols = torch.arange(width, device=self.device).repeat(rows, 1)  # [rows, width]
        tables = torch.zeros(rows, self.width + 1, dtype=torch.int64, device=self.device)
        span = self.shapes.span(min(max(context, width), self.width * self.cache.block_size))
        mask = torch.ones(rows, 1, width, span, dtype=torch.bool, device=self.device)
        t = self.now()
        with torch.inference_mode():
            self.forward(ids, cols, self.cache.at(tables, cols, span), mask)
        return self.now() - t
