"""Which KV blocks each request owns: a free list and exact accounting, no tensors (nano-vllm's
``BlockManager``, without prefix caching).

Block 0 is the scratch block (``ddtree.kv_cache``) and is never handed out. Free blocks are taken smallest
id first, so a pool sized for the whole memory budget stays compact: on a CPU, pages of blocks no request
ever used are never touched and cost no resident memory.
"""

from __future__ import annotations

import heapq

from ddtree.engine.request import Request


class BlockManager:
    """``num_blocks - 1`` allocatable blocks of ``block_size`` tokens; a request owns ``r.blocks``."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(1, num_blocks))  # sorted: already a heap
        # Admission leaves this many blocks free for running requests to grow into (vLLM's watermark), so
        # a new request does not cause the next round's preemption.
        self.watermark = int(watermark * (num_blocks - 1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def missing(self, r: Request, tokens: int) -> int:
        """Blocks request r must still take to hold ``tokens`` columns."""
        return max(self.blocks_for(tokens) - len(r.blocks), 0)

    def can_grow(self, r: Request, tokens: int, reserve: int = 0) -> bool:
        return self.missing(r, tokens) + reserve <= len(self._free)

    def grow(self, r: Request, tokens: int) -> bool:
        """Give r the blocks it needs for ``tokens`` columns; False (nothing taken) if they are not free."""
        need = self.missing(r, tokens)
        if need > len(self._free):
            return False
        r.blocks.extend(heapq.heappop(self._free) for _ in range(need))
        return True

    def free(self, r: Request) -> None:
        for block in r.blocks:
            heapq.heappush(self._free, block)
        r.blocks = []
