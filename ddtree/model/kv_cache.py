"""Paged key/value caches: one pool of fixed-size blocks per layer, a block table per request (vLLM's
PagedAttention layout, nano-vllm's ``BlockManager`` accounting in ``ddtree.engine.block_manager``).

What a pool stores per token and layer is its ``KVLayout``: for GQA keys and values, ``[num_blocks,
block_size, kv_heads, D]`` each; for MLA (DeepSeek-V2/V3, Kimi K2) the compressed latent alone, ``[num_blocks,
block_size, kv_lora_rank + qk_rope_head_dim]`` (the normed ``c_KV`` and the rotated shared rope key; keys and
values are both read from it, so there is no separate V). A request's token at column
``c`` lives in block ``table[c // block_size]`` at offset ``c % block_size``; its table has ``width`` entries
(enough for the longest request) plus one, and entries it does not own are block 0, the **scratch block**,
which the allocator never hands out. Padding tokens write to the **scratch column** ``width * block_size``
(the table's last entry, so block 0); a masked column read through an unowned entry reads block 0 too, and
since it only ever holds zeros or real keys/values, ``0 x value`` stays finite.

A forward reads each row's first ``span`` columns (a multiple of ``block_size``) by gathering its blocks;
the mask hides every column the row must not see. Eagerly, the gathers land in two read buffers the pool
keeps (keys, values), reused by every layer and every forward: a fresh multi-megabyte tensor per layer
costs the CPU a page fault per 4 KiB on first touch, which measured as most of the gather's time. The
target and the drafter have a pool each, indexed by the same block tables: one allocation covers a request
in both models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero-filled tensor. On the CPU it comes from ``calloc`` (through numpy), whose large allocations
    the kernel zero-fills page by page on first touch: a pool sized for the whole budget costs resident
    memory only for the blocks requests actually use (``torch.zeros`` would write every page up front)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


@dataclass(frozen=True)
class KVLayout:
    """What one layer caches per token: ``token_shape`` in the keys pool and, when ``has_values``, the same
    again in a values pool. GQA: ``(kv_heads, head_dim)`` twice; MLA: ``(kv_lora_rank + qk_rope_head_dim,)``
    once (the latent is both the keys and, its first kv_lora_rank values, the values)."""

    token_shape: tuple[int, ...]
    has_values: bool = True

    @classmethod
    def gqa(cls, kv_heads: int, head_dim: int) -> KVLayout:
        return cls((kv_heads, head_dim), True)

    @classmethod
    def mla(cls, latent_dim: int) -> KVLayout:
        return cls((latent_dim,), False)

    @property
    def is_latent(self) -> bool:
        return not self.has_values

    def elements_per_token(self) -> int:
        """Values one layer stores per token (GQA: 2 x kv_heads x head_dim; MLA: the latent's width)."""
        return math.prod(self.token_shape) * (2 if self.has_values else 1)


class PagedKVCache:
    """Keys and values (or MLA latents) of ``num_layers`` layers in ``num_blocks`` blocks of ``block_size``
    tokens."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        width: int,
        layout: KVLayout,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.width = width  # block-table entries a request may own; the table has one more (scratch)
        self.layout = layout
        self.num_layers = num_layers
        self.dtype = dtype
        shape = (num_blocks, block_size, *layout.token_shape)
        self.keys = [zeros(shape, dtype, device) for _ in range(num_layers)]  # MLA: the latents
        self.values = [zeros(shape, dtype, device) for _ in range(num_layers)] if layout.has_values else []
        # Where eager reads gather to ([blocks read, block_size, *token_shape] each; keys, values), grown to
        # the largest read so far. A layer's attention consumes its rows before the next layer gathers.
        self.read_buffers = [
            torch.empty(0, block_size, *layout.token_shape, dtype=dtype, device=device) for _ in range(2)
        ]

    def read_buffer(self, which: int, blocks: int) -> torch.Tensor:
        """Read buffer ``which`` (0 keys / latents, 1 values) for ``blocks`` blocks, [blocks, block_size,
        *token_shape]: a view of the kept buffer, grown (exactly: the step that grows it is the largest so
        far, which the memory plan's profiling step measured) when too small."""
        buf = self.read_buffers[which]
        if buf.shape[0] < blocks:
            buf = torch.empty(blocks, *buf.shape[1:], dtype=buf.dtype, device=buf.device)
            self.read_buffers[which] = buf
        return buf[:blocks]

    @property
    def scratch(self) -> int:
        """The column padding writes to: the table's last entry, always the scratch block."""
        return self.width * self.block_size

    @property
    def capacity(self) -> int:
        """Columns a request may own (the most attention ever reads)."""
        return self.width * self.block_size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers)

    def at(self, tables: torch.Tensor, cols: torch.Tensor, span: int) -> CacheWrite:
        return CacheWrite(self, tables, cols, span)

    @property
    def buffers(self) -> list[torch.Tensor]:
        """Every layer's pool tensors: keys (MLA: latents), then values."""
        return [*self.keys, *self.values]


def slots(tables: torch.Tensor, cols: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat pool slots [B, T] of columns ``cols`` [B, T] under block tables ``tables`` [B, width + 1]."""
    blocks = tables.gather(1, torch.div(cols, block_size, rounding_mode="floor"))  # [B, T]
    return blocks * block_size + cols % block_size


@dataclass
class CacheWrite:
    """Where one forward's new keys/values go: columns ``cols`` [B, T] (the scratch column for padding)
    of the rows whose block tables are ``tables`` [B, width + 1], and how many leading columns attention
    reads (``span``, a multiple of the block size)."""

    cache: PagedKVCache
    tables: torch.Tensor  # [B, width + 1] int64
    cols: torch.Tensor  # [B, T] int64
    span: int | None  # None: attention reads the pool itself (``ddtree.model.attention``'s flex backend)

    def __post_init__(self) -> None:
        self.slots = slots(self.tables, self.cols, self.cache.block_size)  # [B, T], shared by every layer
        # [B * span / block_size]: index_select on a flat index gathers 5x faster on the CPU than
        # indexing the pool with a [B, blocks] tensor
        if self.span is not None:
            self.read = self.tables[:, : self.span // self.cache.block_size].flatten()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store GQA k/v [B, kv_heads, T, D]; return the rows' first ``span`` columns of keys/values
        [B, kv_heads, span, D], gathered from their blocks, or (span None) the whole pool as every row's
        [B, kv_heads, num_blocks * block_size, D] (a view: nothing is copied)."""
        keys = self._store(self.cache.keys[layer], k.transpose(1, 2), 0)  # [B, span, kv_heads, D]
        values = self._store(self.cache.values[layer], v.transpose(1, 2), 1)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def write_latent(self, layer: int, latent: torch.Tensor) -> torch.Tensor:
        """Store MLA latents [B, T, kv_lora_rank + rope]; return the rows' first ``span`` columns of them
        [B, span, kv_lora_rank + rope] (span None: the whole pool, a view, as ``write``)."""
        return self._store(self.cache.keys[layer], latent, 0)

    def _store(self, buf: torch.Tensor, new: torch.Tensor, which: int) -> torch.Tensor:
        """Write ``new`` [B, T, *token_shape] at this forward's slots and read the rows back, [B, span,
        *token_shape] (eagerly into read buffer ``which``, valid until the next read into it).

        One indexed write into the whole pool per tensor: compiled, it stays in place (a write through a
        view makes torch.compile copy what the view spans back, each layer). Compiled, the read is the
        graph's own tensor (its memory planning reuses buffers; a kept buffer would be a mutated global).
        """
        b = self.tables.shape[0]
        flat = buf.view(-1, *buf.shape[2:])  # [num_blocks * block_size, *token_shape]
        flat[self.slots] = new.to(buf.dtype)
        if self.span is None:
            return flat[None].expand(b, *flat.shape)
        if torch.compiler.is_compiling():
            rows = buf.index_select(0, self.read)  # [B * span / block_size, block_size, *token_shape]
        else:
            rows = torch.index_select(buf, 0, self.read, out=self.cache.read_buffer(which, len(self.read)))
        return rows.view(b, self.span, *buf.shape[2:])


def pack_buffers(
    buffers: list[torch.Tensor],  # [num_blocks, block_size, *token_shape] each, written in place
    tables: torch.Tensor,  # [B, width + 1]
    starts: torch.Tensor,  # [B]
    path: torch.Tensor,  # [B, S]
    lengths: torch.Tensor,  # [B]
    scratch: int,
    block_size: int,
) -> None:
    """Row i (block table ``tables[i]``) keeps the keys/values of its accepted nodes ``path[i, :lengths[i]]``
    at columns ``starts[i] + 0 .. lengths[i]``, in every pool tensor of ``buffers`` (a pool's
    ``PagedKVCache.buffers``). A pure function of tensors: one graph per bucket when the round is compiled
    (two launches per layer buffer become one call).

    A path is increasing node indices starting with the root (0), which stays where it is; every row moves
    in one gather and one scatter per buffer, on the device (a first-child chain moves onto itself), with
    the entries past a row's path sent to the scratch column. The gather reads before the scatter writes,
    so overlapping moves are safe (compiled, the gathered rows are a buffer of their own; tested against
    the eager moves). The tree's other columns need no clearing: the next round's mask hides everything
    past a row's committed tokens.
    """
    steps = torch.arange(path.shape[1], device=path.device)  # [S]
    on_path = steps[None] < lengths[:, None]  # [B, S]
    src = slots(tables, torch.where(on_path, starts[:, None] + path, scratch), block_size)  # [B, S]
    dst = slots(tables, torch.where(on_path, starts[:, None] + steps, scratch), block_size)
    for buf in buffers:
        flat = buf.view(-1, *buf.shape[2:])  # [num_blocks * block_size, *token_shape]
        flat[dst] = flat[src]  # [B, S, *token_shape] gathered, then scattered
