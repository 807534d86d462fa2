"""How many KV blocks the engine gets: ``kv_cache_memory`` bytes when given, otherwise the share
``gpu_memory_utilization`` of the device's memory (on a CPU, of the RAM available) minus what is already in
use and an estimate of the largest step's activations (vLLM's rule; it profiles a forward instead).

The pool is never larger than every running request at ``max_model_len`` needs, and never smaller than one
such request: that is a one-line error naming the flags to change.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ddtree.errors import DDTreeError

GIB = 1 << 30


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def available_memory(device: torch.device) -> tuple[int, str]:
    """Bytes this process may still take on ``device``, and what they are a share of (for messages)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, f"{gib(free)} free of the device's {gib(total)}"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        free = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return free, f"{gib(free)} of RAM available"


@dataclass(frozen=True)
class CacheConfig:
    """The user's KV cache settings (vLLM's names)."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; wins over the utilization share
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise DDTreeError(f"block_size must be an integer >= 1, got {self.block_size!r}")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise DDTreeError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")


def activation_bytes(config, tokens: int, rows: int, nodes: int, span: int, elem: int) -> int:
    """An upper estimate of the largest step's transient memory: a prefill of ``tokens`` tokens (hidden
    states, MLP activations, attention scores against ``span`` columns) or a round of ``rows`` trees of
    ``nodes`` nodes (the same, plus float32 distributions over the vocabulary for every node)."""
    h, i = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    per_token = (8 * h + 3 * i) * elem + heads * span * 4
    prefill = tokens * per_token
    round_ = rows * nodes * (per_token + 4 * config.vocab_size * 4)
    return max(prefill, round_)


def kv_blocks(
    cache: CacheConfig,
    device: torch.device,
    block_bytes: int,
    request_blocks: int,
    max_num_seqs: int,
    activations: int,
    max_model_len: int,
) -> int:
    """Blocks of the pool (the scratch block included) for this budget."""
    if cache.kv_cache_memory is not None:
        budget, source = cache.kv_cache_memory, f"--kv-cache-memory {gib(cache.kv_cache_memory)}"
    else:
        free, what = available_memory(device)
        if device.type == "cuda":
            _, total = torch.cuda.mem_get_info(device)
            budget = int(cache.gpu_memory_utilization * total) - (total - free) - activations
        else:
            budget = int(cache.gpu_memory_utilization * free) - activations
        source = (
            f"--gpu-memory-utilization {cache.gpu_memory_utilization} of {what}, "
            f"less {gib(activations)} for activations"
        )
    blocks = max(budget, 0) // block_bytes
    if blocks < request_blocks:
        raise DDTreeError(
            f"the KV cache budget ({source}) holds {blocks} blocks ({gib(blocks * block_bytes)}), fewer "
            f"than one request of max_model_len {max_model_len} needs ({request_blocks} blocks, "
            f"{gib(block_bytes * request_blocks)}); raise --kv-cache-memory or --gpu-memory-utilization, "
            "or lower --max-model-len"
        )
    return min(blocks, max_num_seqs * request_blocks) + 1
