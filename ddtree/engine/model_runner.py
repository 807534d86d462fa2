"""The models and their memory: the target's and drafter's weights, the paged KV caches (sized by the
memory budget), the fixed shapes and their compiled forwards. Everything that runs a model goes through
here; nothing here decides who runs.

Three forwards: the prefill (a batch of prompt chunks, any shape), the round's verify forward (every row's
tree) and the drafter pass. With fixed shapes the last two run at a few padded shapes
(``ddtree.capture``), each compiled (CUDA graphs on CUDA) and warmed up once at start-up.

Under tensor parallelism (``ddtree.engine.step_channel``) rank 0's runner holds the drafter, the LM head
and its shard of the target; every other rank's runner (``ModelRunner.worker``) holds its shard alone,
and the ``@replicated`` methods, which touch the target, run on every rank with the same arguments.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from ddtree import capture, startup
from ddtree.attention import PagedBlockMask
from ddtree.capture import (
    StaticInputs,
    batch_ladder,
    check_buckets,
    compile_forward,
    mark_static,
    node_ladder,
    pick,
    tree_mask,
    upload,
)
from ddtree.config import EngineConfig
from ddtree.drafter import DFlashDrafter
from ddtree.engine.memory import CacheConfig, KVPlan, activation_bytes, gib, peak_bytes, plan_kv
from ddtree.engine.request import Request
from ddtree.engine.step_channel import StepChannel, close_channel, replicated
from ddtree.errors import DDTreeError
from ddtree.forward import Float32Linear, TargetForward
from ddtree.kv_cache import KVLayout, PagedKVCache, pack_buffers
from ddtree.sampling import sample_verdicts, sampled_probs
from ddtree.tree import beam_tree
from ddtree.verify import greedy_verdicts, tree_inputs

log = logging.getLogger(__name__)

PROFILE_ROWS = 2  # a reduced profile's round runs this many rows, its peak scaled to the real count
# A reduced profile's peak is budgeted at MARGIN x measured + SLACK: the resident set also grows with the
# layers left out (heap fragmentation: Qwen3-0.6B's shapes, 28 layers, 40,960 columns: reduced 3.87 GiB,
# full 4.72 GiB, 1.22x) and reads +-20 MiB at small shapes (the built-in pair: up to 1.75x at 36 MiB).
PROFILE_MARGIN, PROFILE_SLACK = 1.5, 64 << 20
PROFILE_BLOCKS = 128  # the reduced profile's shorter span (blocks; the longer is twice it), or an eighth


def fast_low_precision(device: torch.device) -> torch.dtype:
    """bfloat16 where matmuls run it natively (CUDA with bf16, CPUs with AVX512-BF16), else float32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    native = device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()
    return torch.bfloat16 if native else torch.float32


FLOAT32_PREFILL_TOKENS = 16  # a prefill forward this large computes its linear layers in float32 ...


def emulated_half(device: torch.device, dtype: torch.dtype) -> bool:
    """... on a CPU whose matmuls run bf16 / fp16 only emulated (``Float32Linear``: measured, 4-6x faster
    prefill there)."""
    return (
        device.type == "cpu"
        and dtype in (torch.bfloat16, torch.float16)
        and (fast_low_precision(device) == torch.float32)
    )


def head_floor_rows(device: torch.device, weight: torch.Tensor) -> int:
    """Rows below which an LM-head call costs no less: the head is one [rows, H] x [H, V] matmul.

    On a GPU a small call is bound by reading the [V, H] weight; at an H200's ~200 flops per byte of HBM a
    bf16 weight's read costs as much as ~200 rows' multiply-adds (a roofline estimate, to be measured by
    ``scripts/device_round.py``). On a CPU the matmul is compute-bound, and what a call costs on top is
    its dispatch (~10 ops, ~0.1 ms, about 2^23 multiply-adds here).
    """
    if device.type == "cuda":
        return 256
    return max(1, -(-(1 << 23) // weight.numel()))


def with_mlp_dtype(drafter: DFlashDrafter, dtype: torch.dtype) -> DFlashDrafter:
    """``drafter``, or a copy of it whose MLP weights are ``dtype`` (the caller's module is left alone)."""
    if all(p.dtype == dtype for layer in drafter.layers for p in layer.mlp.parameters()):
        return drafter
    drafter = copy.deepcopy(drafter)
    for layer in drafter.layers:
        layer.mlp.to(dtype)
    return drafter


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
        ``pool``: a worker rank's KV plan and drafter block, rank 0's (its pool has the same blocks)."""
        self.target = target
        self.channel = channel
        self.device = next(target.parameters()).device
        self.dtype = next(target.parameters()).dtype
        self.embed = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.forward = TargetForward(target, None if channel is None else channel.tp)
        self.head_floor_rows = head_floor_rows(self.device, self.lm_head.weight)
        # The drafter only proposes tokens, so rounding in its matmuls cannot change what is emitted. Its
        # LM head (a copy of the target's) and its MLPs, the largest matmuls of a draft pass, run in
        # `draft_dtype`: bf16 reads half the bytes and runs natively where supported (attention and norms
        # stay in the model's dtype: bf16 is slower there on CPUs).
        draft_dtype = draft_dtype or fast_low_precision(self.device)
        self.drafter = None if drafter is None else with_mlp_dtype(drafter.eval(), draft_dtype)
        self.draft_head = self.draft_head_bias = None
        if self.drafter is not None:
            self.draft_head = self.lm_head.weight.detach().to(draft_dtype)  # [V, H]
            if self.lm_head.bias is not None:
                self.draft_head_bias = self.lm_head.bias.detach().to(draft_dtype)
        self.draft_block = 0 if drafter is None else drafter.block_size  # columns a pass writes after
        if pool is not None:
            self.draft_block = pool[1]  # rank 0's: the block tables it sends have its width
        bs = cache_config.block_size
        self.block_size = bs
        # (layers, what a layer caches per token, dtype) of the target's pool and the drafter's
        layouts = [(len(self.forward.layers), self.forward.layout, self.dtype)]
        if self.drafter is not None:
            attn = self.drafter.layers[0].self_attn
            draft_layout = KVLayout.gqa(attn.num_kv_heads, attn.head_dim)
            layouts.append((len(self.drafter.layers), draft_layout, next(attn.parameters()).dtype))
        per_token = [n * layout.elements_per_token() * dt.itemsize for n, layout, dt in layouts]
        self.kv_cache_bytes_per_token = per_token[0]  # the target's pool, all layers
        self.block_bytes = sum(per_token) * bs  # both pools: one allocation covers a request in each
        self.profiled_activation_bytes: int | None = None  # the largest step's measured peak, when run

        def width(length: int) -> int:
            """Block-table entries of a request of ``length`` tokens: its context, then the widest of the
            round's tree and the drafter's block."""
            return -(-(length + max(self.draft_block, 1)) // bs)

        def activations(length: int) -> int:
            return activation_bytes(
                target.config,
                max_num_batched_tokens,
                max_num_seqs,
                max_nodes,
                width(length) * bs,
                self.dtype.itemsize,
                self.forward.gathered_bytes_per_column(self.dtype.itemsize),
                self.forward.gathered_bytes_per_column(self.dtype.itemsize, absorbed=True),
            )

        if pool is None:
            args = (cache_config, self.device, self.block_bytes, width)
            plan = plan_kv(*args, activations, max_num_seqs, max_model_len, explicit_len)
            # Measure the largest step and plan with its peak (vLLM's profiling run): in full on an
            # accelerator (milliseconds there), reduced on a CPU (seconds; the full steps take minutes at
            # real size on a few cores) and there only where the share decides the pool (where every
            # request's context fits, no measurement changes it). Not under tensor parallelism: the other
            # ranks would have to join its collectives before they exist.
            measure = self.device.type != "cpu" or plan.share_bound
            if measure and cache_config.kv_cache_memory is None and channel is None:
                step = (max_num_batched_tokens, max_num_seqs, max_nodes, width(plan.max_model_len))
                reduced = self.device.type == "cpu"
                t0 = time.perf_counter()
                with startup.phase("profile"):
                    if reduced:
                        at_width = self.extrapolated_peak(layouts[0], *step)
                    else:
                        measured = self.profile_step(layouts[0], *step)
                        at_width = None if measured is None else lambda blocks, p=measured: p
                if at_width is not None:

                    def peak(length: int) -> int:
                        return at_width(width(length))

                    plan = plan_kv(*args, peak, max_num_seqs, plan.max_model_len, explicit_len)
                    self.profiled_activation_bytes = peak(plan.max_model_len)
                    log.info(
                        "profiled the largest step (%d-token prefill, %d rows x %d nodes, %d columns%s) in "
                        "%.1f s: %s at its peak (estimated %s); the KV cache gets the memory share less it",
                        *step[:3],
                        width(plan.max_model_len) * bs,
                        f"; one layer of each kind, {PROFILE_ROWS} rows, two short spans, extrapolated, "
                        f"x{PROFILE_MARGIN} + {gib(PROFILE_SLACK)}"
                        if reduced
                        else "",
                        time.perf_counter() - t0,
                        gib(self.profiled_activation_bytes),
                        gib(activations(plan.max_model_len)),
                    )
        else:
            plan = pool[0]
        self.num_blocks, self.max_model_len = plan.num_blocks, plan.max_model_len
        self.width = width(self.max_model_len)
        caches = [
            PagedKVCache(n, self.num_blocks, bs, self.width, layout, dt, self.device)
            for n, layout, dt in layouts
        ]
        self.cache = caches[0]
        self.draft_cache = caches[1] if self.drafter is not None else None
        self.kv_cache_bytes = sum(c.nbytes() for c in caches)
        self.fixed_shapes = False
        self.compiled = False
        self.round_compiled = False  # the round graphs beside the forwards (capture.COMPILE_ROUND_ON_CPU)
        self.max_drafted = self.max_model_len  # drafted nodes a tree may hold (with fixed shapes: a bucket)
        self.inputs = StaticInputs(self.device, static=False)
        self.verify_forward = self.verify_forward_eager
        self.draft_forward = self.draft_forward_eager
        # The round's work beside the forwards, at fixed shapes: one graph per bucket when compiled.
        self.tree_graph, self.inputs_graph = beam_tree, tree_inputs
        self.greedy_graph, self.sample_graph, self.pack_graph = greedy_verdicts, sample_verdicts, pack_buffers
        self.filter_graph = sampled_probs
        self.attention = "sdpa"
        self.block_masks: dict[tuple[int, int, int], PagedBlockMask] = {}  # (pool, rows, queries) -> mask
        if channel is not None and channel.leader:  # the other ranks build their runners like this one
            args = (max_num_seqs, max_num_batched_tokens, max_nodes, cache_config, plan, self.draft_block)
            channel.send("init", args)

    @classmethod
    def worker(
        cls,
        target,
        channel: StepChannel,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_nodes: int,
        cache_config: CacheConfig,
        plan: KVPlan,
        draft_block: int,
    ) -> ModelRunner:
        """A rank other than 0: its shard of the target and of the KV pool (rank 0's blocks and widths)."""
        return cls(
            target,
            None,
            max_num_seqs,
            plan.max_model_len,
            max_num_batched_tokens,
            max_nodes,
            cache_config,
            True,
            channel=channel,
            pool=(plan, draft_block),
        )

    def close(self) -> None:
        """Rank 0 under tensor parallelism: end the other ranks (``ranks.close_channel``); a later forward
        raises. Once, and nothing to do in one process."""
        channel = self.channel
        if channel is not None and channel.leader and not channel.closed:
            close_channel(channel)

    def span(self, needed: int) -> int:
        """Columns attention reads for ``needed``: whole blocks (with fixed shapes, a span bucket)."""
        if self.fixed_shapes:
            return pick(self.span_buckets, needed)
        return self.whole_blocks(needed)

    def whole_blocks(self, columns: int) -> int:
        """``columns`` rounded up to a multiple of the block size (attention reads whole blocks)."""
        return -(-columns // self.block_size) * self.block_size

    def block_tables(self, requests: list[Request | None], rows: int | None = None) -> np.ndarray:
        """The requests' block tables [rows, width + 1] (None and padding rows: all scratch)."""
        tables = np.zeros((rows or len(requests), self.width + 1), dtype=np.int64)
        for i, r in enumerate(requests):
            if r is not None:
                tables[i, : len(r.blocks)] = r.blocks
        return tables

    @replicated
    def setup_shapes(self, config: EngineConfig, deepest: int) -> None:
        """Choose the shapes every round is padded to (``deepest``: the most drafted nodes a configured tree
        asks for) and, with ``compile``, compile the two round forwards (the engine then warms them up).
        ``config``'s buckets are checked already, the span buckets against the row's capacity here.

        With SDPA, attention reads a span bucket of leading cache columns: by default the whole row (one
        graph per batch and node bucket); more buckets make short rows read less (the CPU, long contexts)
        at the price of more graphs. With ``attention="flex"`` each row reads its own blocks up to its
        length (``ddtree.attention``), so there is one span: the whole row."""
        compile = config.compile
        self.attention = config.attention
        self.fixed_shapes = config.fixed
        self.compiled = compile
        self.inputs = StaticInputs(self.device, static=compile and self.device.type == "cuda")
        if not self.fixed_shapes:
            return
        self.batch_buckets = config.batch_buckets or batch_ladder(config.max_num_seqs)
        self.node_buckets = config.node_buckets or node_ladder(deepest)
        self.max_drafted = self.node_buckets[-1] - 1
        whole = self.cache.capacity  # the last span bucket is always the whole block table
        spans = check_buckets("span_buckets", config.span_buckets, whole) or ()
        self.span_buckets = tuple(sorted({*map(self.whole_blocks, spans), whole}))
        if compile:
            shapes = len(self.batch_buckets) * len(self.node_buckets) * len(self.span_buckets)
            caches = [c for c in (self.cache, self.draft_cache) if c is not None]
            if self.device.type == "cuda":
                mark_static([buf for c in caches for buf in c.buffers])
            self.verify_forward = compile_forward(self.verify_forward_eager, self.device, shapes)
            self.draft_forward = compile_forward(self.draft_forward_eager, self.device, shapes)
            if self.device.type != "cpu" or capture.COMPILE_ROUND_ON_CPU:
                rounds = len(self.batch_buckets) * len(self.node_buckets)
                graphs = (
                    beam_tree,
                    tree_inputs,
                    greedy_verdicts,
                    sampled_probs,
                    sample_verdicts,
                    pack_buffers,
                )
                (
                    self.tree_graph,
                    self.inputs_graph,
                    self.greedy_graph,
                    self.filter_graph,
                    self.sample_graph,
                    self.pack_graph,
                ) = (compile_forward(fn, self.device, rounds, cuda_graphs=False) for fn in graphs)
                self.round_compiled = True

    def node_bucket(self, nodes: int) -> int:
        """Tree columns for trees of at most ``nodes`` nodes: that many, or with fixed shapes its bucket."""
        return pick(self.node_buckets, nodes) if self.fixed_shapes else nodes

    def tree_depth(self, nodes: int) -> int:
        """A bound on the depth of any tree of ``nodes`` columns, fixed per bucket (the round's graphs
        take one step per level): at most the drafted block, at most ``nodes - 1``."""
        return min(self.drafter.block_size - 1, nodes - 1)

    def check_captured_budget(self, budget: int) -> None:
        if self.fixed_shapes and budget > self.max_drafted:
            raise DDTreeError(
                f"budget {budget} exceeds the largest node bucket ({self.max_drafted} drafted nodes); "
                "start the engine with node_buckets that hold it"
            )

    @replicated
    def prefill(
        self, chunks: list[tuple[list[int], int]], tables: np.ndarray, features: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompt chunks (tokens, and the columns already cached before them) into the rows whose block
        tables are ``tables``, as one right-padded causal forward: the logits of each chunk's last position
        [B, V] and, when ``features``, every position's drafter features [B, P, F * H]."""
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
        span = self.span(int(ends.max()))
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
        with Float32Linear() if upcast else contextlib.nullcontext():
            # MLA expands keys/values from the latent here: many queries per row (``ddtree.forward``)
            hidden, feats = self.forward(ids_t, positions_t, write, mask, feature_layers, absorbed=False)
        if self.channel is not None and not self.channel.leader:
            return None, None  # rank 0 alone reads the logits
        last = upload(lengths - 1, device)
        return self.lm_head(hidden[torch.arange(b, device=device), last]), feats  # [B, V], [B, P, F * H]

    def block_mask(
        self,
        cache: PagedKVCache,
        tables: torch.Tensor,
        starts: torch.Tensor,
        tree: torch.Tensor | None,
        queries: int,
    ) -> BlockMask | None:
        """With ``attention="flex"``, this round's block mask over ``cache`` (``PagedBlockMask.update``; one
        set of persistent buffers per shape); None with SDPA, whose dense mask the forward builds."""
        if self.attention != "flex":
            return None
        key = (id(cache), tables.shape[0], queries)
        if key not in self.block_masks:
            self.block_masks[key] = PagedBlockMask(cache, tables.shape[0], queries, self.device)
        return self.block_masks[key].update(tables, starts, tree)

    def extrapolated_peak(
        self, layout: tuple, tokens: int, rows: int, nodes: int, width: int
    ) -> Callable[[int], int] | None:
        """A CPU's profile: the largest steps' budgeted peak as a function of the blocks they attend over.
        The reduced profile (``profile_step(reduced=True)``) runs at two short spans, ``PROFILE_BLOCKS``
        blocks (or an eighth of ``width``; at least what holds the steps' tokens) and twice that (or else
        all of ``width``), and is extrapolated linearly (what grows with the columns, the masks and the
        gathered keys and values, grows linearly), at least at the rate those bytes alone grow. Short spans
        keep the profile from costing what the full steps cost (a 2,048-token prefill over a long context:
        minutes) or needing the memory whose lack it is there to find, and let a plan lower
        ``max_model_len`` knowing what each length costs. Budgeted at ``PROFILE_MARGIN`` x +
        ``PROFILE_SLACK``."""
        need = -(-max(tokens, nodes) // self.block_size) + 1  # blocks that hold the steps' own tokens
        near = max(need, min(width // 8, PROFILE_BLOCKS))
        far = 2 * near
        if far >= width:
            near = far = width
        peaks = [self.profile_step(layout, tokens, rows, nodes, w, reduced=True) for w in (near, far)]
        if None in peaks:
            return None
        # Per column, what a CPU's steps surely hold: the prefill's mask and gathered keys/values (MLA's
        # expanded), the round's rows' masks and gathers (SDPA on a CPU takes GQA without expanding heads).
        elem, forward = self.dtype.itemsize, self.forward
        read = forward.layout.elements_per_token() * elem
        per_column = max(
            tokens + (forward.gathered_bytes_per_column(elem) if forward.mla else read),
            rows * (nodes + read),
        )
        slope = max(per_column * self.block_size, (peaks[1] - peaks[0]) // max(far - near, 1))

        def at_width(blocks: int) -> int:
            return int(PROFILE_MARGIN * max(peaks[1] + slope * (blocks - far), 0)) + PROFILE_SLACK

        return at_width

    def profile_step(
        self, layout: tuple, tokens: int, rows: int, nodes: int, width: int, reduced: bool = False
    ) -> int | None:
        """Peak bytes of the largest steps this configuration allows (``memory.peak_bytes``): a prefill
        chunk of ``tokens`` tokens ending at the last of ``width`` blocks, and a round of ``rows`` trees of
        ``nodes`` nodes there with every node's float32 distribution sorted (what the sampling filters
        hold). They run over a one-block pool every table entry points to: the shapes and kernels of a
        full pool, without its bytes.

        ``reduced`` (a CPU, where the full steps of a real-size model take minutes): the steps run through
        one layer of each kind (``TargetForward.representative_layers``: the same transient memory as all
        of them, which run one after the other) and the round at ``PROFILE_ROWS`` rows, its peak scaled to
        ``rows`` (every byte of a round's transient memory belongs to a row; what is not, scaled too, only
        overestimates); the drafter features of the layers left out are added as computed
        (``extrapolated_peak`` budgets the result)."""
        _, kv_layout, dtype = layout
        device, bs = self.device, self.block_size
        forward = self.forward
        feature_layers = self.drafter.target_layer_ids if self.drafter is not None else None
        measured_rows, dropped = rows, 0
        if reduced:
            forward = forward.over(forward.representative_layers())
            measured_rows = min(rows, PROFILE_ROWS)
            if feature_layers is not None:  # the kept outputs of all but one feature layer
                dropped = (len(feature_layers) - 1) * tokens * self.target.config.hidden_size * dtype.itemsize
                feature_layers = [len(forward.layers) - 1] * len(feature_layers)
        span = width * bs
        cache = PagedKVCache(len(forward.layers), 1, bs, width, kv_layout, dtype, device)
        tables = torch.zeros(
            measured_rows, width + 1, dtype=torch.int64, device=device
        )  # [B, W + 1]: block 0
        keys = torch.arange(span, device=device)  # [span]

        def prefill() -> None:
            positions = keys[max(span - tokens, 0) :][None]  # [1, P]
            mask = (keys <= positions[:, :, None])[:, None]  # [1, 1, P, span]
            write = cache.at(tables[:1], positions, span)
            hidden, _ = forward(torch.zeros_like(positions), positions, write, mask, feature_layers, False)
            self.lm_head(hidden[:, -1])

        def round_() -> None:
            positions = keys[max(span - nodes, 0) :][None].expand(measured_rows, -1)  # [B, N]
            starts = positions[:, 0]  # [B]
            anc = torch.ones(measured_rows, nodes, nodes, dtype=torch.bool, device=device).tril()  # [B, N, N]
            write = cache.at(tables, positions, span)
            hidden, _ = forward(torch.zeros_like(positions), positions, write, tree_mask(starts, anc, span))
            torch.softmax(self.lm_head(hidden).float(), dim=-1).sort(dim=-1)  # [B, N, V] x 3

        with torch.inference_mode():
            first, widest = (peak_bytes(device, step) for step in (prefill, round_))
        if first is None or widest is None:
            return None
        return max(first + dropped, -(-widest * rows // measured_rows))

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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The round's target forward (``verify_forward``: compiled with fixed shapes), through this round's
        flex block mask when ``attention="flex"``."""
        block_mask = self.block_mask(self.cache, tables, starts, anc, ids.shape[1])
        return self.verify_forward(ids, positions, cols, starts, anc, tables, span, features, block_mask)

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
        pack = self.pack_graph if bucket else pack_buffers
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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The round's target forward over every row's tree: final hidden states [B, N, H] and, when
        ``features`` (always with fixed shapes and a drafter: one graph per shape), drafter features
        [B, N, F * H]. With a ``block_mask`` (flex), attention reads the pool through it."""
        features = self.drafter is not None and (self.fixed_shapes or features)
        if block_mask is None:
            write = self.cache.at(tables, cols, span)
            mask = tree_mask(starts, anc, span)  # [B, 1, N, span]
        else:
            write, mask = self.cache.at(tables, cols, None), block_mask
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
    def timed_forward(self, tokens: int) -> float:
        """Seconds of a ``tokens``-token forward that writes only the scratch block (the auto budget's
        cost model)."""
        ids = torch.zeros(1, tokens, dtype=torch.int64, device=self.device)
        cols = torch.arange(tokens, device=self.device)[None]
        tables = torch.zeros(1, self.width + 1, dtype=torch.int64, device=self.device)
        span = self.span(tokens)
        mask = torch.ones(1, 1, tokens, span, dtype=torch.bool, device=self.device)
        t = self.now()
        with torch.inference_mode():
            self.forward(ids, cols, self.cache.at(tables, cols, span), mask)
        return self.now() - t
