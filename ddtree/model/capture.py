"""Capture-ready forwards: every round's shapes come from a small fixed set, so each can be compiled once.

On an accelerator, small-batch decoding is bound by kernel launches; gpt-fast, vLLM and SGLang capture the
decode step (CUDA graphs via ``torch.compile(mode="reduce-overhead")`` or their own capture). A graph is
only valid for the shapes and addresses it was captured with, so with ``Engine(compile=True)``:

- the verify batch is padded to a **batch bucket** (rows) and a **node bucket** (tree nodes, root
  included); dummy rows and nodes write only the scratch column and are never read or committed;
- attention reads a span bucket of each row's block table (by default all of it) behind a mask built in the
  graph from per-row lengths and the tree block, as gpt-fast reads its ``max_seq_length`` cache;
- the drafter pass is padded to a batch bucket and a context width of one block (the most a round can
  commit); a longer backlog is consumed by repeating the same pass;
- inputs live in persistent buffers, one set per shape, overwritten in place each round (the official
  DDTree code and Lucebox PR #101: reallocating them every step cost more than the tree saved);
- the KV caches and those buffers are marked static, so CUDA graphs may write them in place.

One ``torch.compile(fullgraph=True, dynamic=False)`` per forward, one graph per shape, all compiled and
captured at start-up (``Engine.warm_up``): after that, no round compiles or falls back to eager.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from ddtree.errors import DDTreeError


def batch_ladder(max_batch_size: int) -> tuple[int, ...]:
    """Powers of two below ``max_batch_size``, then ``max_batch_size`` itself (vLLM's capture sizes)."""
    sizes, b = [], 1
    while b < max_batch_size:
        sizes.append(b)
        b *= 2
    return (*sizes, max_batch_size)


def node_ladder(max_drafted: int) -> tuple[int, ...]:
    """Tree sizes 1, 2, 3, 5, 9, 17, ... (the root plus a power of two of drafted nodes) up to the first
    that holds ``max_drafted`` drafted nodes: a power-of-two budget fills its bucket exactly."""
    sizes, d = [1], 1
    while sizes[-1] < max_drafted + 1:
        sizes.append(d + 1)
        d *= 2
    return tuple(sizes)


def check_buckets(
    name: str, buckets: Sequence[int] | None, limit: int | None = None
) -> tuple[int, ...] | None:
    """Sorted, distinct, positive integers (at most ``limit``), or None for the default ladder."""
    if buckets is None:
        return None
    values = list(buckets)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in values):
        raise DDTreeError(f"{name} must be a non-empty list of integers >= 1, got {buckets!r}")
    if limit is not None and max(values) > limit:
        raise DDTreeError(f"{name} may not exceed {limit}, got {max(values)}")
    return tuple(sorted(set(values)))


def check_batch_buckets(
    name: str, buckets: Sequence[int] | None, max_batch_size: int
) -> tuple[int, ...] | None:
    """``check_buckets`` for batch buckets: the largest is the maximum batch size (rows past it do not
    exist, and a batch of that many rows needs a bucket)."""
    checked = check_buckets(name, buckets, max_batch_size)
    if checked is not None and checked[-1] != max_batch_size:
        raise DDTreeError(
            f"the largest of {name} must be the maximum batch size ({max_batch_size}), got {checked[-1]}"
        )
    return checked


def pick(buckets: tuple[int, ...], n: int) -> int:
    """The smallest bucket that holds ``n`` (the caller keeps ``n`` within the largest)."""
    for size in buckets:
        if size >= n:
            return size
    raise DDTreeError(f"{n} exceeds the largest bucket {buckets[-1]}")


def tree_mask(starts: torch.Tensor, anc: torch.Tensor, span: int) -> torch.Tensor:
    """The verify mask [B, 1, N, span] (True = attend) from per-row lengths and tree blocks.

    Row b's node i sees the committed columns [0, starts[b]) and, of its tree's columns starts[b] + j, the
    ancestors ``anc[b, i, j]``. Built on the device in O(B x N x span) with no host work per column (SGLang
    PR #29907's review: only the tree block needs a mask, the prefix is a length).
    """
    b, n, _ = anc.shape
    rel = torch.arange(span, device=anc.device)[None] - starts[:, None]  # [B, span] column - start
    in_tree = (rel >= 0) & (rel < n)  # [B, span]
    block = anc.gather(2, rel.clamp(0, n - 1)[:, None].expand(b, n, span))  # [B, N, span]
    return ((rel < 0)[:, None] | (block & in_tree[:, None]))[:, None]  # [B, 1, N, span]


class StaticInputs:
    """Persistent device buffers, one per (name, shape, dtype), refilled in place from host arrays."""

    def __init__(self, device: torch.device, static: bool) -> None:
        self.device = device
        self.static = static  # mark for CUDA graphs: replays read them where they are
        self._buffers: dict[tuple, torch.Tensor] = {}

    def put(self, name: str, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        src = self.host(array)  # [shape of the array]
        key = (name, tuple(src.shape), src.dtype)
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = torch.empty(src.shape, dtype=src.dtype, device=self.device)
            if self.static:
                torch._dynamo.mark_static_address(buf)
        return buf.copy_(src, non_blocking=True)

    def host(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        """A host array as a tensor to copy from (pinned on CUDA, see ``staged``); device tensors pass."""
        return array if isinstance(array, torch.Tensor) else staged(array, self.device)

    def load(self, persistent: bool, **arrays: np.ndarray | torch.Tensor) -> list[torch.Tensor]:
        """The arrays on the device, in order: refilled into their persistent buffers, or fresh tensors
        (shapes that vary round to round gain nothing from a buffer kept per shape)."""
        if persistent:
            return [self.put(name, x) for name, x in arrays.items()]
        return [self.upload(x) for x in arrays.values()]

    def upload(self, array: np.ndarray | torch.Tensor) -> torch.Tensor:
        """A fresh device tensor of ``array`` (asynchronous from pinned memory on CUDA)."""
        return array if isinstance(array, torch.Tensor) else upload(array, self.device)


def staged(array: np.ndarray | Sequence[int], device: torch.device) -> torch.Tensor:
    """Host data as a tensor to upload to ``device``: on CUDA copied into pinned memory from torch's
    caching host allocator (which keeps a block until the copies reading it have run), so the upload
    that follows is asynchronous; on the CPU the array itself, shared."""
    src = torch.from_numpy(np.ascontiguousarray(array))
    return src.pin_memory() if device.type == "cuda" else src


def upload(array: np.ndarray | Sequence[int], device: torch.device) -> torch.Tensor:
    """Host data on ``device`` without a host sync: from pinned memory, non-blocking. Every upload of a
    round goes through here (``tests/test_host_syncs.py`` counts any other as a blocking one)."""
    src = staged(array, device)
    return src if device.type == "cpu" else src.to(device, non_blocking=True)


_compiled_shapes = 0  # shapes compile_forward has been asked for in this process, every engine's

# The round's graphs beside the forwards (tree, verify inputs, acceptance) are compiled on accelerators,
# where each of their ~600 small ops is a launch. On a CPU they run as the same fixed-shape functions,
# eagerly: compiled they measured no faster there (docs/benchmarks.md) and cost ~75 s of compile per
# bucket. Tests turn this on to hold the graphs to one graph per bucket, no break and no recompile.
COMPILE_ROUND_ON_CPU = False


def compile_forward(
    fn: Callable, device: torch.device, num_shapes: int, cuda_graphs: bool = True
) -> Callable:
    """``torch.compile`` of one forward for ``num_shapes`` fixed shapes: one graph each, no graph break,
    CUDA graphs on CUDA unless ``cuda_graphs`` is off (the round's graphs beside the forwards: each feeds
    the next, and a CUDA graph tree may reuse an earlier generation's outputs' memory once a new step
    begins; they run as fused kernels instead)."""
    global _compiled_shapes
    config = torch._dynamo.config
    # Every shape is a new entry for the same code, and so is every shape of an earlier engine of this
    # process (the forwards are the same methods): let all of them compile rather than fail.
    _compiled_shapes += num_shapes
    config.recompile_limit = max(config.recompile_limit, _compiled_shapes + 1)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * _compiled_shapes)
    if device.type != "cuda" or not cuda_graphs:
        return torch.compile(fn, fullgraph=True, dynamic=False)
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, mode="reduce-overhead")

    def replay(*args):
        # Every earlier output is dead by the next forward (the engine copies what it keeps), so each
        # call may start a new generation of CUDA graph trees and reuse their memory.
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args)

    return replay


def mark_static(tensors: Sequence[torch.Tensor]) -> None:
    """KV caches are written in place by captured graphs: their addresses must never change."""
    for t in tensors:
        torch._dynamo.mark_static_address(t)
