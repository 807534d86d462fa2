"""Which KV blocks each request owns, and which full blocks are cached for later requests: reference
counts, a content index and exact accounting, no tensors (nano-vllm's ``BlockManager``; vLLM's automatic
prefix caching).

Block 0 is the scratch block (``ddtree.model.kv_cache``) and is never handed out. Every other block is in
exactly one state: **free** (holds nothing anyone will read), **owned** (``refs > 0``: in the tables of that
many requests) or **cached** (no owner, but its content key is indexed, so a request with the same prefix can
take it back instead of recomputing it). Free blocks are taken smallest id first, so a pool sized for the
whole memory budget stays compact: on a CPU, pages of blocks no request ever used cost no resident memory.
Cached blocks are evicted least recently released first, and only when no free block is left.

A full block's key is a SHA-256 chained over its tokens and its parent's key, rooted in the request's
``cache_salt``: equal keys mean an equal prefix (and tenant), so a hit is the same keys/values. A key is
indexed once the block's columns are final for the target and, for a drafting request, for the drafter
too (its context keys/values live in the drafter's pool under the same block ids), so a drafting request
that hits resumes its drafter exactly where a cold run would be. Shared blocks are never written again:
every write lands after the cached prefix (the uncached prompt tail, a round's tree, the drafter's block),
so no copy-on-write is needed.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from ddtree.engine.request import Request


def block_keys(parent: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """The chained keys of the full blocks of ``tokens`` following a block whose key is ``parent``."""
    keys = []
    for at in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(
            parent + np.asarray(tokens[at : at + block_size], dtype=np.int64).tobytes()
        ).digest()
        keys.append(parent)
    return keys


def root_key(cache_salt: str | None) -> bytes:
    """The parent key of a request's first block: requests with different salts share no block."""
    return hashlib.sha256(b"ddtree-prefix\0" + (cache_salt or "").encode()).digest()


class BlockManager:
    """``num_blocks - 1`` allocatable blocks of ``block_size`` tokens; a request owns ``r.blocks``."""

    def __init__(
        self, num_blocks: int, block_size: int, watermark: float = 0.01, prefix_caching: bool = True
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._free = list(range(1, num_blocks))  # sorted: already a heap
        self._cached: OrderedDict[int, None] = OrderedDict()  # unowned but indexed, least recent first
        self._refs = [0] * num_blocks
        self._key_of: dict[int, bytes] = {}  # indexed block -> its key
        self._block_of: dict[bytes, int] = {}  # key -> the block holding it
        self._drafted: set[int] = set()  # indexed blocks whose drafter context is stored too
        # Admission leaves this many blocks free for running requests to grow into (vLLM's watermark), so
        # a new request does not cause the next round's preemption.
        self.watermark = int(watermark * (num_blocks - 1))
        self.queried_tokens = 0  # prompt tokens looked up at admission (vLLM's prefix cache "queries")
        self.hit_tokens = 0  # ... found cached

    @property
    def num_free(self) -> int:
        """Blocks a request may take: free ones and cached ones nobody owns (evicted when taken)."""
        return len(self._free) + len(self._cached)

    @property
    def num_indexed(self) -> int:
        """Blocks the prefix cache can hand to a later request (owned or not)."""
        return len(self._key_of)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self.num_free

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def missing(self, r: Request, tokens: int) -> int:
        """Blocks request r must still take to hold ``tokens`` columns."""
        return max(self.blocks_for(tokens) - len(r.blocks), 0)

    def grow(self, r: Request, tokens: int) -> bool:
        """Give r the blocks it needs for ``tokens`` columns; False (nothing taken) if they are not free."""
        need = self.missing(r, tokens)
        if need > self.num_free:
            return False
        r.blocks.extend(self._take() for _ in range(need))
        return True

    def _take(self) -> int:
        """A block for a new owner: a free one, else the least recently released cached one (evicted)."""
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._cached.popitem(last=False)
            self._unindex(block)
        self._refs[block] = 1
        return block

    def free(self, r: Request) -> None:
        """r lets go of its blocks. Its last blocks are released first, so they are evicted first: a
        prefix's head, which more requests share, stays longest."""
        for block in reversed(r.blocks):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if block in self._key_of:
                self._cached[block] = None
            else:
                heapq.heappush(self._free, block)
        r.blocks = []
        r.cached_blocks = 0

    # -- the prefix cache -------------------------------------------------------------------------------

    def keys(self, r: Request, blocks: int) -> list[bytes]:
        """The keys of r's first ``blocks`` full blocks (of its prompt and output), computed once."""
        have = len(r.block_keys)
        if blocks > have:
            bs, p = self.block_size, len(r.prompt_ids)
            start, end = have * bs, blocks * bs
            tokens = r.prompt_ids[start:end] + r.output.token_ids[max(start - p, 0) : max(end - p, 0)]
            parent = r.block_keys[-1] if r.block_keys else root_key(r.cache_salt)
            r.block_keys += block_keys(parent, tokens, bs)
        return r.block_keys[:blocks]

    def admit(self, r: Request, hit: list[int], tokens: int, reserve: int) -> bool:
        """Admit r (it owns no block yet) with the cached blocks ``hit`` (``cached_prefix``) first in its
        table and new ones up to ``tokens`` columns; False (nothing taken) when they do not fit with
        ``reserve`` blocks to spare."""
        revived = sum(1 for b in hit if not self._refs[b])  # unowned cached blocks stop being spare
        if self.blocks_for(tokens) - len(hit) + revived + reserve > self.num_free:
            return False
        for block in hit:
            if not self._refs[block]:
                del self._cached[block]
            self._refs[block] += 1
        r.blocks = list(hit)
        r.cached_blocks = len(hit)
        if self.prefix_caching:
            self.queried_tokens += len(r.prefill_ids)
            self.hit_tokens += len(hit) * self.block_size
        return self.grow(r, tokens)

    def cached_prefix(self, r: Request, tokens: int) -> list[int]:
        """The cached blocks holding r's first full blocks, as many as match within ``tokens`` tokens (a
        drafting request needs its drafter's context cached too)."""
        if not self.prefix_caching or r.scores_prompt:  # a token to score is computed, not taken cached
            return []
        hit = []
        for key in self.keys(r, tokens // self.block_size):
            block = self._block_of.get(key)
            if block is None or (r.drafts and block not in self._drafted):
                break
            hit.append(block)
        return hit

    def cache(self, r: Request, tokens: int, drafted: bool) -> None:
        """Index r's full blocks within its first ``tokens`` columns, whose contents are final (and, when
        ``drafted``, the drafter's too). A key already indexed keeps its block, unless only this one has
        the drafter's context."""
        if not self.prefix_caching:
            return
        full = min(tokens // self.block_size, len(r.blocks))
        for i, key in enumerate(self.keys(r, full)[r.cached_blocks :], start=r.cached_blocks):
            block = r.blocks[i]
            if block in self._key_of:  # a hit: already indexed
                continue
            other = self._block_of.get(key)
            if other is not None and (other in self._drafted or not drafted):
                continue  # an equal block is indexed already; this one stays private
            if other is not None:
                self._unindex(other)
                if other in self._cached:  # unowned: nothing left to find it by
                    del self._cached[other]
                    heapq.heappush(self._free, other)
            self._key_of[block] = key
            self._block_of[key] = block
            if drafted:
                self._drafted.add(block)
        r.cached_blocks = max(r.cached_blocks, full)

    def reset(self) -> None:
        """Forget every cached block that nobody owns (they become free); owned blocks keep their keys."""
        while self._cached:
            block, _ = self._cached.popitem(last=False)
            self._unindex(block)
            heapq.heappush(self._free, block)

    def _unindex(self, block: int) -> None:
        key = self._key_of.pop(block)
        if self._block_of.get(key) == block:
            del self._block_of[key]
        self._drafted.discard(block)

    def check_invariants(self, tables: Iterable[list[int]]) -> None:
        """Raise AssertionError unless the accounting holds for the running requests' block ``tables``:
        every allocatable block is free, cached or owned, exactly once; a block's reference count is the
        number of tables holding it; cached blocks are indexed and free ones are not; the index is one to
        one. For tests and debugging: it walks every block."""
        counts = [0] * self.num_blocks
        for table in tables:
            for block in table:
                counts[block] += 1
        assert counts == self._refs, "reference counts differ from the tables"
        free, cached, indexed = set(self._free), set(self._cached), set(self._key_of)
        owned = {b for b in range(1, self.num_blocks) if counts[b]}
        assert len(free) == len(self._free), "a block is free twice"
        assert not free & cached and not (free | cached) & owned, "a block is in two states"
        assert free | cached | owned == set(range(1, self.num_blocks)), "a block is lost"
        assert cached <= indexed and not free & indexed, "the index disagrees with the states"
        assert all(self._key_of[b] == k for k, b in self._block_of.items()), "the index is not one to one"
