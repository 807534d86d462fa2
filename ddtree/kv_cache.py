"""Fixed-capacity key/value caches for a batch of requests, allocated once (gpt-fast's ``setup_caches``).

One buffer per layer holds keys (and one values) as ``[rows, kv_heads, capacity + 1, D]``. A request owns a
row while it runs; its tokens sit at columns ``0 .. length`` of that row. A forward writes its new tokens at
per-row columns (a tree's nodes right after the row's committed tokens) and attends over the first ``span``
columns, with a mask that hides everything a row must not see. Column ``capacity`` is scratch: padding
tokens (rows with fewer nodes than the batch's widest tree) write there, and no mask ever shows it.

Nothing is reallocated while decoding: a round costs the same whatever the requests' lengths, and the shapes
a forward sees depend only on the batch, its widest tree and its longest row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    """Keys and values of ``num_layers`` layers for up to ``rows`` requests of up to ``capacity`` tokens."""

    def __init__(
        self,
        num_layers: int,
        rows: int,
        kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.capacity = capacity
        shape = (rows, kv_heads, capacity + 1, head_dim)
        # Zeros, not empty: a masked column still enters attention as 0 x value, and uninitialised memory
        # may hold NaN bit patterns.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @property
    def scratch(self) -> int:
        """The column padding writes to; never inside any row's visible span."""
        return self.capacity

    def at(self, rows: slice, cols: torch.Tensor, span: int) -> CacheWrite:
        return CacheWrite(self, rows, cols, span)

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Move a request's first ``length`` columns to another row (compaction when a row is freed)."""
        for buf in (*self.keys, *self.values):
            buf[dst, :, :length] = buf[src, :, :length]

    def move_cols(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """For each row ``rows[i]``, copy columns ``src[i]`` to ``dst[i]`` ([K] rows, [K, M] columns).

        The accepted path of a tree sits scattered through the tree's columns; this packs it right after
        the committed tokens, for every row of the batch in one gather and one scatter per buffer. The
        gather reads before the scatter writes, so overlapping moves are safe; rows with shorter paths pad
        ``src`` and ``dst`` with the scratch column.
        """
        r = rows[:, None]  # [K, 1], broadcast against the [K, M] columns
        for buf in (*self.keys, *self.values):  # [R, kv_heads, C + 1, D]
            buf[r, :, dst] = buf[r, :, src]  # [K, M, kv_heads, D] gathered, then scattered


@dataclass
class CacheWrite:
    """Where one forward's new keys/values go: cache rows ``rows``, columns ``cols`` [B, T] (per row, per
    token; the scratch column for padding), and how many leading columns attention reads (``span``)."""

    cache: KVCache
    rows: slice | torch.Tensor  # a slice (views, the common case) or [B] row indices (a subset of rows)
    cols: torch.Tensor  # [B, T] int64
    span: int

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k/v [B, kv_heads, T, D]; return the rows' keys/values [B, kv_heads, span, D] (views, or
        copies of the first ``span`` columns when ``rows`` picks a subset).

        One indexed write into the whole buffer per tensor: compiled, it stays in place (a write through a
        view of the buffer makes torch.compile copy every row it spans back, each layer).
        """
        if isinstance(self.rows, torch.Tensor):
            r = self.rows[:, None]  # [B, 1] against cols [B, T]
        else:
            r = torch.arange(self.rows.start, self.rows.stop, device=self.cols.device)[:, None]
        out = []
        for buf, new in ((self.cache.keys[layer], k), (self.cache.values[layer], v)):
            buf[r, :, self.cols] = new.transpose(1, 2).to(buf.dtype)  # [B, T, kv_heads, D]
            out.append(buf[self.rows, :, : self.span])
        return out[0], out[1]
