"""How many KV blocks the engine gets: ``kv_cache_memory`` bytes when given, otherwise the share
``gpu_memory_utilization`` of the device's memory (on a CPU, of the RAM available) minus what is already in
use and the largest step's activations: an upper estimate (``activation_bytes``), replaced by the peak
measured running that step (``peak_bytes``, vLLM's profiling run) on an accelerator, where an estimate
that missed a kernel's workspace means running out of memory mid-request, and on a CPU where the share
decides the pool (a real-size largest step takes minutes on a few cores).

The pool is never larger than every running request at ``max_model_len`` needs, and never smaller than one
such request: a ``max_model_len`` the user set that does not fit is a one-line error naming the flags to
change; the model's own context is lowered to what fits.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ddtree.errors import DDTreeError

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
            log.warning(
                "the model's context of %d tokens does not fit the KV cache budget (%s); max_model_len is "
                "%d (set --max-model-len, --kv-cache-memory or --gpu-memory-utilization to choose)",
                max_model_len,
                source,
                lo,
            )
            length = lo
        else:
            blocks = max(budget(length), 0) // block_bytes
            raise DDTreeError(
                f"the KV cache budget ({source}) holds {blocks} blocks ({gib(blocks * block_bytes)}), "
                f"fewer than one request of max_model_len {length} needs ({request_blocks(length)} "
                f"blocks, {gib(block_bytes * request_blocks(length))}); raise --kv-cache-memory or "
                "--gpu-memory-utilization, or lower --max-model-len"
            )
    blocks = min(budget(length) // block_bytes, max_num_seqs * request_blocks(length))
    return KVPlan(
        blocks + 1, length, cache.kv_cache_memory is None and blocks < max_num_seqs * request_blocks(length)
    )
