"""How many KV blocks the engine gets: ``kv_cache_memory`` bytes when given, otherwise the share
``gpu_memory_utilization`` of the device's memory (on a CPU, of the RAM available) minus what is already in
use and the largest step's activations: an upper estimate (``activation_bytes``), replaced by the peak
measured running that step (``peak_bytes``, vLLM's profiling run) on an accelerator, where an estimate
that missed a kernel's workspace means running out of memory mid-request, and on a CPU where the share
decides the pool (a real-size largest step takes minutes on a few cores).

The pool is never larger than every running request at ``max_model_len`` needs, and never smaller than one
such request: a ``max_model_len`` the user set that does not fit is a one-line error naming the flags to
change; the model's own context is lowered to what fits. With ``--kv-cache-dtype auto`` a CPU pool holds
a half-precision model's keys and values in float32 (faster attention) only where that costs no context.
``plan_pool`` plans (and profiles) the pool the ``ModelRunner`` then allocates.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ddtree import startup
from ddtree.errors import DDTreeError
from ddtree.model.capture import tree_mask
from ddtree.model.forward import TargetForward
from ddtree.model.invariance import exact_scratch_bytes
from ddtree.model.kv_cache import KVLayout, PagedKVCache
from ddtree.model.precision import HALF_PRECISION
from ddtree.speculative.drafter import DFlashDrafter

log = logging.getLogger(__name__)

GIB = 1 << 30


def gib(n: float) -> str:
    """Bytes for a message: GiB, or MiB below one."""
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / (1 << 20):.2f} MiB"


def available_memory(device: torch.device) -> tuple[int, int, str]:
    """Bytes free on ``device``, the bytes the utilization share is of, and those in words (messages).

    On CUDA the share is of the device's whole memory, and what is in use (by anyone) counts against it,
    as in vLLM; on a CPU it is of the RAM available now."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, total, f"{gib(free)} free of the device's {gib(total)}"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        free = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return free, free, f"{gib(free)} of RAM available"


def peak_bytes(device: torch.device, step: Callable[[], object]) -> int | None:
    """Bytes ``step()`` needs above what was in use before it, at its peak: CUDA's allocator statistics,
    or on a CPU the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``; None
    where Linux does not offer that)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident set starts again from the current one
        before = _status_kib("VmRSS")
        step()
        return max(0, _status_kib("VmHWM") - before) * 1024
    except (OSError, KeyError, ValueError):
        return None


def trim_heap() -> None:
    """Hand the heap's free memory back to the system (glibc's ``malloc_trim``), so a step measured next
    grows the resident set by what it holds, not by less because it reuses what an earlier one freed."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the measure may read low, as before
        pass


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(dict(line.split(":", 1) for line in f)[field].split()[0])


@dataclass(frozen=True)
class CacheConfig:
    """The user's KV cache settings (vLLM's names; checked by ``ddtree.config.EngineConfig``)."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; wins over the utilization share
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"  # "auto", or a dtype's name: the model's or float32 (``plan_pool``)


def activation_bytes(
    config,
    tokens: int,
    rows: int,
    nodes: int,
    span: int,
    elem: int,
    column_bytes: int,
    round_column_bytes: int | None = None,
) -> int:
    """An upper estimate of the largest step's transient memory, for contexts of ``span`` columns: a prefill
    of ``tokens`` tokens or a round of ``rows`` trees of ``nodes`` nodes. Per token: hidden states and MLP
    activations (and for a round float32 distributions over the vocabulary); per row: ``column_bytes`` per
    column (what its attention gathers and expands: ``TargetForward.gathered_bytes_per_column``; in a round
    ``round_column_bytes`` where it differs: MLA's absorbed verify expands nothing) and the mask."""
    h, i, v = config.hidden_size, config.intermediate_size, config.vocab_size
    round_column_bytes = column_bytes if round_column_bytes is None else round_column_bytes
    prefill = tokens * ((8 * h + 3 * i) * elem + span) + span * column_bytes
    round_ = rows * nodes * ((8 * h + 3 * i) * elem + 16 * v + span) + rows * span * round_column_bytes
    return max(prefill, round_)


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int  # the pool's, the scratch block included
    max_model_len: int  # as given, or lowered to what the budget holds when it was not given
    # The memory share (less the activations) decides the pool, not the cap of every request at
    # max_model_len: only then can measured activations change it.
    share_bound: bool = False
    source: str = ""  # what set the budget, in the flags' words (messages)
    wide: bool = False  # half-precision keys and values held in float32 (``pool_dtype``)


def plan_kv(
    cache: CacheConfig,
    device: torch.device,
    block_bytes: int,
    request_blocks: Callable[[int], int],
    activations: Callable[[int], int],
    max_num_seqs: int,
    max_model_len: int,
    explicit_len: bool,
) -> KVPlan:
    """The pool for this budget (``request_blocks(L)``, ``activations(L)``: a request's blocks and the
    transient bytes at context L). A context the budget cannot hold one request of is an error when the
    user set it (``explicit_len``); the model's own context is lowered to what fits, as vLLM's
    ``--max-model-len auto`` does, with a warning."""
    if cache.kv_cache_memory is not None:
        source = f"--kv-cache-memory {gib(cache.kv_cache_memory)}"
        free, _, what = available_memory(device)
        if cache.kv_cache_memory > free:  # on a CPU it would be allocated lazily and fail at first use
            raise DDTreeError(
                f"--kv-cache-memory {gib(cache.kv_cache_memory)} is more than this device has: {what}; "
                "lower it, or use --gpu-memory-utilization"
            )

        def budget(length: int) -> int:
            return cache.kv_cache_memory
    else:
        free, total, what = available_memory(device)
        share = int(cache.gpu_memory_utilization * total) - (total - free)
        source = f"--gpu-memory-utilization {cache.gpu_memory_utilization} of {what}, less activations"

        def budget(length: int) -> int:
            return share - activations(length)

    def fits(length: int) -> bool:
        return max(budget(length), 0) // block_bytes >= request_blocks(length)

    length = max_model_len
    if not fits(length):
        lo, hi = 1, length  # fits(lo) or nothing does; not fits(hi)
        if not explicit_len and fits(lo):
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            length = lo  # plan_pool says so, once the pool's dtype is chosen
        else:
            blocks = max(budget(length), 0) // block_bytes
            raise DDTreeError(
                f"the KV cache budget ({source}) holds {blocks} blocks ({gib(blocks * block_bytes)}), "
                f"fewer than one request of max_model_len {length} needs ({request_blocks(length)} "
                f"blocks, {gib(block_bytes * request_blocks(length))}); raise --kv-cache-memory or "
                "--gpu-memory-utilization, or lower --max-model-len"
            )
    blocks = min(budget(length) // block_bytes, max_num_seqs * request_blocks(length))
    share_bound = cache.kv_cache_memory is None and blocks < max_num_seqs * request_blocks(length)
    return KVPlan(blocks + 1, length, share_bound, source)


PROFILE_ROWS = 2  # a reduced profile's round runs this many rows, its peak scaled to the real count
# A reduced profile's peak is budgeted at MARGIN x measured + SLACK: the resident set also grows with the
# layers left out (heap fragmentation: Qwen3-0.6B's shapes, 28 layers, 40,960 columns: reduced 3.87 GiB,
# full 4.72 GiB, 1.22x) and reads +-20 MiB at small shapes (the built-in pair: up to 1.75x at 36 MiB).
PROFILE_MARGIN, PROFILE_SLACK = 1.5, 64 << 20
PROFILE_BLOCKS = 128  # the reduced profile's shorter span (blocks; the longer is twice it), or an eighth


@dataclass(frozen=True)
class StepModel:
    """What the largest steps run through: the target's forward and LM head, its dtype and device, the
    drafter (its feature layers), the pool's block size and whether the pool is wide (``KVPlan.wide``)."""

    forward: TargetForward
    lm_head: torch.nn.Module
    dtype: torch.dtype
    device: torch.device
    drafter: DFlashDrafter | None
    block_size: int
    wide: bool = False

    @property
    def kv_dtype(self) -> torch.dtype:
        """The target pool's dtype: what its attention reads."""
        return pool_dtype(self.forward.layout, self.dtype, self.wide)


def pool_dtype(layout: KVLayout, dtype: torch.dtype, wide: bool) -> torch.dtype:
    """The dtype a pool stores for layers computing in ``dtype``: with ``wide``, float32 for a GQA layer's
    half-precision keys and values (``plan_pool`` decides when), else ``dtype``. A half-precision key
    or value is exact in float32, so a wide pool holds the same numbers at twice the bytes, and ``attend``
    runs every call in float32 over them. MLA latents stay in ``dtype``: the model's own matmuls in its
    dtype read them."""
    return torch.float32 if wide and dtype in HALF_PRECISION and layout.has_values else dtype


def pool_layouts(model: StepModel) -> list[tuple[int, KVLayout, torch.dtype]]:
    """(layers, what a layer caches per token, dtype) of the target's pool and the drafter's
    (``pool_dtype``)."""
    forward, drafter = model.forward, model.drafter
    layouts = [(len(forward.layers), forward.layout, model.kv_dtype)]
    if drafter is not None:
        attn = drafter.layers[0].self_attn
        draft_layout = KVLayout.gqa(attn.num_kv_heads, attn.head_dim)
        draft_dtype = pool_dtype(draft_layout, next(attn.parameters()).dtype, model.wide)
        layouts.append((len(drafter.layers), draft_layout, draft_dtype))
    return layouts


def pool_bytes(layouts: list[tuple[int, KVLayout, torch.dtype]], block_size: int) -> tuple[int, int]:
    """Bytes a token takes in the target's pool (all layers), and a block in every pool (one allocation
    covers a request in each)."""
    per_token = [n * layout.elements_per_token() * dt.itemsize for n, layout, dt in layouts]
    return per_token[0], sum(per_token) * block_size


def plan_pool(
    model: StepModel,
    config,
    cache: CacheConfig,
    request_blocks: Callable[[int], int],
    steps: tuple[int, int, int],
    max_model_len: int,
    explicit_len: bool,
    profile: bool,
) -> tuple[KVPlan, int | None]:
    """The pool (``plan_dtype``) in ``cache.kv_cache_dtype``: the model's dtype, or float32 keys and values
    for a half-precision model (``pool_dtype``). "auto" takes float32 on a CPU wherever that holds
    as long a context as the model's dtype: the CPU's fused SDPA kernel over bf16 keys runs a decode query
    several times slower than over float32 ones (one thread, this project's CPU: 7.4 against 1.6 ms for 16
    rows of the built-in target over 896 columns; 58 against 8 ms for one Qwen3-8B-shaped layer over
    4,096, 736 against 213 over 40,960; with as many queries as a 17-node tree the two cost about the
    same). Where float32 would lower ``max_model_len`` or not fit, "auto" keeps the model's dtype: a
    speed-up never costs context. Warns once where the context is lowered."""
    args = (config, cache, request_blocks, steps, max_model_len, explicit_len, profile)
    wide, narrow = replace(model, wide=True), replace(model, wide=False)
    if cache.kv_cache_dtype != "auto":
        plan, peak = plan_dtype(wide if chosen_wide(cache.kv_cache_dtype, model.dtype) else narrow, *args)
    elif model.device.type != "cpu" or pool_layouts(wide) == pool_layouts(narrow):  # float32, MLA latents
        plan, peak = plan_dtype(narrow, *args)
    else:
        plan = peak = None
        with contextlib.suppress(DDTreeError):  # the model's dtype, planned next, says why none fits
            plan, peak = plan_dtype(wide, *args)
        if plan is None or plan.max_model_len < max_model_len:
            kept, kept_peak = plan_dtype(narrow, *args)
            if plan is None or plan.max_model_len < kept.max_model_len:
                log.info(
                    "the KV cache holds keys and values in %s: in float32 (faster attention on a CPU) it "
                    "would hold %s",
                    str(model.dtype).removeprefix("torch."),
                    "no request" if plan is None else f"a context of {plan.max_model_len} tokens",
                )
                plan, peak = kept, kept_peak
    if plan.max_model_len < max_model_len:
        log.warning(
            "the model's context of %d tokens does not fit the KV cache budget (%s); max_model_len is %d "
            "(set --max-model-len, --kv-cache-memory or --gpu-memory-utilization to choose)",
            max_model_len,
            plan.source,
            plan.max_model_len,
        )
    return plan, peak


def chosen_wide(name: str, dtype: torch.dtype) -> bool:
    """Whether ``--kv-cache-dtype name`` widens a model computing in ``dtype``; a one-line error for a dtype
    the pool cannot hold (narrower than the model's: its keys would lose bits)."""
    model = str(dtype).removeprefix("torch.")
    allowed = list(dict.fromkeys((model, "float32")))
    if name not in allowed:
        choices = ", ".join(["auto", *allowed[:-1]]) + f" or {allowed[-1]}"
        raise DDTreeError(
            f"--kv-cache-dtype {name} is not this model's dtype ({model}) or float32; use {choices}"
        )
    return name == "float32"


def plan_dtype(
    model: StepModel,
    config,
    cache: CacheConfig,
    request_blocks: Callable[[int], int],
    steps: tuple[int, int, int],
    max_model_len: int,
    explicit_len: bool,
    profile: bool,
) -> tuple[KVPlan, int | None]:
    """The pool (``plan_kv``) of ``model``'s pool dtypes for the largest ``steps`` (prefill tokens, rows,
    tree nodes) of a target whose HF ``config`` gives its sizes: planned with their estimated
    activations, then with their measured peak where it may decide the pool; returns the plan and that
    peak (None when nothing was measured).

    The measure is vLLM's profiling run: in full on an accelerator (milliseconds there), reduced on a CPU
    (seconds; the full steps take minutes at real size on a few cores) and there only where the share
    decides the pool (where every request's context fits, no measurement changes it). Not without
    ``profile`` (tensor parallelism: the other ranks would have to join its collectives before they
    exist)."""
    tokens, rows, nodes = steps
    bs, elem, forward = model.block_size, model.dtype.itemsize, model.forward
    gathered = model.kv_dtype.itemsize  # what attention reads
    block_bytes = pool_bytes(pool_layouts(model), bs)[1]

    # seeded rows' float64 attention, which no step here runs (MLA's: with kv_b_proj in float64)
    mla = forward.mla
    latent_weight = forward.num_heads * (forward.nope_dim + forward.v_dim) * forward.rank if mla else 0
    exact = exact_scratch_bytes(model.dtype, latent_weight)

    def activations(length: int) -> int:
        column, absorbed = (forward.gathered_bytes_per_column(gathered, absorbed=a) for a in (False, True))
        span = request_blocks(length) * bs
        return activation_bytes(config, tokens, rows, nodes, span, elem, column, absorbed) + exact

    args = (cache, model.device, block_bytes, request_blocks)
    plan = replace(plan_kv(*args, activations, rows, max_model_len, explicit_len), wide=model.wide)
    measure = model.device.type != "cpu" or plan.share_bound
    if not (measure and profile and cache.kv_cache_memory is None):
        return plan, None
    step = (*steps, request_blocks(plan.max_model_len))
    reduced = model.device.type == "cpu"
    t0 = time.perf_counter()
    with startup.phase("profile"):
        if reduced:
            at_width = extrapolated_peak(model, *step)
        else:
            measured = profile_step(model, *step)
            at_width = None if measured is None else lambda blocks, p=measured: p
    if at_width is None:
        return plan, None

    def peak(length: int) -> int:
        return at_width(request_blocks(length)) + exact

    plan = replace(plan_kv(*args, peak, rows, plan.max_model_len, explicit_len), wide=model.wide)
    profiled = peak(plan.max_model_len)
    log.info(
        "profiled the largest step (%d-token prefill, %d rows x %d nodes, %d columns%s) in %.1f s: %s at "
        "its peak (estimated %s); the KV cache gets the memory share less it",
        *steps,
        request_blocks(plan.max_model_len) * bs,
        f"; one layer of each kind, {PROFILE_ROWS} rows, two short spans, extrapolated, "
        f"x{PROFILE_MARGIN} + {gib(PROFILE_SLACK)}"
        if reduced
        else "",
        time.perf_counter() - t0,
        gib(profiled),
        gib(activations(plan.max_model_len)),
    )
    return plan, profiled


def extrapolated_peak(
    model: StepModel, tokens: int, rows: int, nodes: int, width: int
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
    need = -(-max(tokens, nodes) // model.block_size) + 1  # blocks that hold the steps' own tokens
    near = max(need, min(width // 8, PROFILE_BLOCKS))
    far = 2 * near
    if far >= width:
        near = far = width
    peaks = [profile_step(model, tokens, rows, nodes, w, reduced=True) for w in (near, far)]
    if None in peaks:
        return None
    # Per column, what a CPU's steps surely hold: the prefill's mask and gathered keys/values (MLA's
    # expanded), the round's rows' masks and gathers (SDPA on a CPU takes GQA without expanding heads).
    forward = model.forward
    elem = model.kv_dtype.itemsize  # the gathered keys and values
    read = forward.layout.elements_per_token() * elem
    per_column = max(
        tokens + (forward.gathered_bytes_per_column(elem) if forward.mla else read),
        rows * (nodes + read),
    )
    slope = max(per_column * model.block_size, (peaks[1] - peaks[0]) // max(far - near, 1))

    def at_width(blocks: int) -> int:
        return int(PROFILE_MARGIN * max(peaks[1] + slope * (blocks - far), 0)) + PROFILE_SLACK

    return at_width


def profile_step(
    model: StepModel, tokens: int, rows: int, nodes: int, width: int, reduced: bool = False
) -> int | None:
    """Peak bytes of the largest steps this configuration allows (``peak_bytes``): a prefill chunk of
    ``tokens`` tokens ending at the last of ``width`` blocks, and a round of ``rows`` trees of ``nodes``
    nodes there with every node's float32 distribution sorted (what the sampling filters hold). They run
    over a one-block pool every table entry points to: the shapes and kernels of a full pool, without its
    bytes.

    ``reduced`` (a CPU, where the full steps of a real-size model take minutes): the steps run through
    one layer of each kind (``TargetForward.representative_layers``: the same transient memory as all of
    them, which run one after the other) and the round at ``PROFILE_ROWS`` rows, its peak scaled to
    ``rows`` (every byte of a round's transient memory belongs to a row; what is not, scaled too, only
    overestimates); the drafter features of the layers left out are added as computed
    (``extrapolated_peak`` budgets the result)."""
    device, bs, dtype = model.device, model.block_size, model.dtype
    forward = model.forward
    feature_layers = None if model.drafter is None else model.drafter.target_layer_ids
    measured_rows, dropped = rows, 0
    if reduced:
        forward = forward.over(forward.representative_layers())
        measured_rows = min(rows, PROFILE_ROWS)
        if feature_layers is not None:  # the kept outputs of all but one feature layer
            hidden_size = model.lm_head.weight.shape[1]  # [V, H]
            dropped = (len(feature_layers) - 1) * tokens * hidden_size * dtype.itemsize
            feature_layers = [len(forward.layers) - 1] * len(feature_layers)
    span = width * bs
    cache = PagedKVCache(len(forward.layers), 1, bs, width, forward.layout, model.kv_dtype, device)
    tables = torch.zeros(measured_rows, width + 1, dtype=torch.int64, device=device)  # [B, W + 1]: block 0
    keys = torch.arange(span, device=device)  # [span]

    def prefill() -> None:
        positions = keys[max(span - tokens, 0) :][None]  # [1, P]
        mask = (keys <= positions[:, :, None])[:, None]  # [1, 1, P, span]
        write = cache.at(tables[:1], positions, span)
        hidden, _ = forward(torch.zeros_like(positions), positions, write, mask, feature_layers, False)
        model.lm_head(hidden[:, -1])

    def round_() -> None:
        positions = keys[max(span - nodes, 0) :][None].expand(measured_rows, -1)  # [B, N]
        starts = positions[:, 0]  # [B]
        anc = torch.ones(measured_rows, nodes, nodes, dtype=torch.bool, device=device).tril()  # [B, N, N]
        write = cache.at(tables, positions, span)
        hidden, _ = forward(torch.zeros_like(positions), positions, write, tree_mask(starts, anc, span))
        torch.softmax(model.lm_head(hidden).float(), dim=-1).sort(dim=-1)  # [B, N, V] x 3

    with torch.inference_mode():
        first, widest = (peak_bytes(device, step) for step in (prefill, round_))
    if first is None or widest is None:
        return None
    return max(first + dropped, -(-widest * rows // measured_rows))
