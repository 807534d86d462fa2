"""Key/value buffers written in place, shared by the target's KV cache and the drafter's context cache.

Concatenating a new token's keys onto a cache copies the whole cache, once per layer and forward. These
buffers grow by doubling instead, so a write copies only its own rows (and, rarely, the kept rows once).
"""

from __future__ import annotations

import torch


class KVBuffers:
    """Keys and values, [B, kv_heads, capacity, D] each, whose capacity doubles when a write overflows."""

    MIN_CAPACITY = 256

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k``/``v`` [B, kv_heads, t, D] at rows ``start .. start + t``, keeping rows below
        ``start``; returns views of rows ``0 .. start + t``."""
        end = start + k.shape[2]
        if self.keys is None or end > self.keys.shape[2]:
            self.keys, self.values = (
                self._grown(self.keys, k, start, end),
                self._grown(self.values, v, start, end),
            )
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]

    def _grown(self, old: torch.Tensor | None, like: torch.Tensor, keep: int, need: int) -> torch.Tensor:
        have = 0 if old is None else old.shape[2]
        b, h, _, d = like.shape
        buf = like.new_empty(b, h, max(need, 2 * have, self.MIN_CAPACITY), d)
        if keep:
            buf[:, :, :keep] = old[:, :, :keep]
        return buf
