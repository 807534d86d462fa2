"""Attention over the paged KV pool, two ways.

- ``sdpa`` (the default): each row's first ``span`` columns are gathered from its blocks and
  ``F.scaled_dot_product_attention`` runs behind a dense boolean mask. Every row reads ``span`` columns,
  the batch's longest (with fixed shapes, a span bucket: by default the whole block table).
- ``flex`` (``compile=True`` only): ``flex_attention`` reads the pool itself. A ``BlockMask`` lists, per
  row, the pool blocks of its own table up to its length (plus the tree's columns), so a row reads its
  blocks and no one else's; ``mask_mod`` then decides column by column inside them. The mask comes from
  tensors in persistent buffers, rewritten in place each round (a ``create_block_mask`` would evaluate the
  mask over every (query, key) pair: about a second at 16 x 17 x 2,048 on this CPU). Uncompiled,
  FlexAttention falls back to a dense reference over the whole pool, hence compile only.

Which columns a query sees is one rule for both (``tree_mask`` is its dense form): the row's committed
columns ``[0, start)``, then, of the ``n`` columns from ``start`` on, those its tree block ``anc`` allows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ddtree.kv_cache import PagedKVCache

ATTENTION_BACKENDS = ("sdpa", "flex")
FLEX_Q_BLOCK = 128  # FlexAttention's query tile; a tree of up to 128 nodes is one tile


def attend(
    q: torch.Tensor,  # [B, heads, T, D]
    keys: torch.Tensor,  # [B, kv_heads, S, D]: gathered rows (sdpa) or the whole pool (flex)
    values: torch.Tensor,  # [B, kv_heads, S, D]
    mask: torch.Tensor | BlockMask | None,  # [B, 1, T, S] bool (True = attend), a BlockMask, or None
    scale: float | None = None,
) -> torch.Tensor:
    """Attention output [B, heads, T, D] through either backend (``mask``'s type says which)."""
    gqa = keys.shape[1] != q.shape[1]
    if isinstance(mask, BlockMask):
        return flex_attention(q, keys, values, block_mask=mask, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)


def fold_heads(mask: torch.Tensor | BlockMask | None, heads: int) -> torch.Tensor | BlockMask | None:
    """A dense mask [B, 1, T, S] for ``attend_latent``'s folded queries, [B, 1, heads * T, S] (query row
    ``h * T + t`` is head h's query t); built once per forward, shared by every layer. Flex's block mask
    and None pass through."""
    if not isinstance(mask, torch.Tensor):
        return mask
    b, _, t, s = mask.shape
    return mask.expand(b, heads, t, s).reshape(b, 1, heads * t, s)


def attend_latent(
    q: torch.Tensor,  # [B, heads, T, rank + rope]: nope queries through W_UK, then the rotated rope part
    latent: torch.Tensor,  # [B, S, rank + rope]: gathered rows (sdpa) or the whole pool (flex)
    rank: int,  # kv_lora_rank: the latent's first ``rank`` values are what the heads' values expand from
    mask: torch.Tensor | BlockMask,  # fold_heads(...) of the forward's mask, or flex's block mask
    scale: float,
) -> torch.Tensor:
    """MLA attention in the absorbed form (vLLM's and SGLang's MLA decode): every head scores against the
    one shared latent, and its output stays in the latent space, [B, heads, T, rank] (the caller applies
    W_UV). The heads fold into the query rows of one single-KV-head attention, so the latent is never
    copied per head and no per-head key or value is ever built."""
    b, heads, t, d = q.shape
    keys, values = latent[:, None], latent[:, None, :, :rank]  # [B, 1, S, rank + rope], [B, 1, S, rank]
    if isinstance(mask, BlockMask):
        return flex_attention(q, keys, values, block_mask=mask, scale=scale, enable_gqa=True)
    folded = q.reshape(b, 1, heads * t, d)  # [B, 1, heads * T, rank + rope]
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scale)
    return out.view(b, heads, t, rank)


class PagedBlockMask:
    """The FlexAttention mask of one fixed shape (``rows`` x ``queries``) over ``cache``'s pool.

    Persistent buffers (fixed addresses, as CUDA graphs need), rewritten by ``update`` each round:
    ``owner[p]`` the batch row that owns pool block p (-1: none; block 0, the scratch, is never owned),
    ``first_col[p]`` its first column in that row, each row's start, tree block and block list. The
    ``mask_mod`` closure is made once, so a compiled forward sees the same function every round.
    """

    def __init__(self, cache: PagedKVCache, rows: int, queries: int, device: torch.device) -> None:
        self.cache = cache
        blocks, bs = cache.num_blocks, cache.block_size
        q_tiles = -(-queries // FLEX_Q_BLOCK)
        self.shape = (rows, queries)
        self.owner = torch.full((blocks,), -1, dtype=torch.int64, device=device)
        self.first_col = torch.zeros(blocks, dtype=torch.int64, device=device)
        self.starts = torch.zeros(rows, dtype=torch.int64, device=device)
        self.tree = torch.zeros(rows, queries, queries, dtype=torch.bool, device=device)  # [B, T, n]
        self.num = torch.zeros(rows, 1, q_tiles, dtype=torch.int32, device=device)  # blocks each row reads
        self.indices = torch.zeros(rows, 1, q_tiles, blocks, dtype=torch.int32, device=device)
        owner, first_col, starts, tree, n = self.owner, self.first_col, self.starts, self.tree, queries

        def mask_mod(b, h, q, k):
            block = k // bs
            rel = first_col[block] + k % bs - starts[b]  # the column, relative to the row's start
            seen = (rel < 0) | ((rel < n) & tree[b, q, rel.clamp(0, n - 1)])
            return (owner[block] == b) & seen

        self.mask_mod = mask_mod

    def update(self, tables: torch.Tensor, starts: torch.Tensor, tree: torch.Tensor | None) -> BlockMask:
        """This round's mask: block tables [B, width + 1], committed columns [B], and the tree block
        [B, T, T] (None: no tree, the queries see ``[0, start)`` only, as the drafter's block does with
        ``start`` its end). On the device, no host read."""
        rows, queries = self.shape
        bs, width = self.cache.block_size, tables.shape[1] - 1
        own = tables[:, :width]  # [B, width]
        self.owner.fill_(-1)
        self.owner.scatter_(0, own.flatten(), torch.arange(rows, device=own.device).repeat_interleave(width))
        self.owner[0] = -1  # unowned table entries point at the scratch block
        cols = torch.arange(width, device=own.device) * bs
        self.first_col.scatter_(0, own.flatten(), cols.repeat(rows))
        self.starts.copy_(starts)
        if tree is None:
            self.tree.zero_()
            reach = starts
        else:
            self.tree.copy_(tree)
            reach = starts + queries
        self.num.copy_(((reach + bs - 1) // bs).clamp(max=width)[:, None, None].expand_as(self.num))
        self.indices[..., :width] = own[:, None, None].to(torch.int32)
        return BlockMask.from_kv_blocks(
            self.num,
            self.indices,
            BLOCK_SIZE=(FLEX_Q_BLOCK, bs),
            mask_mod=self.mask_mod,
            seq_lengths=(queries, self.cache.num_blocks * bs),
            compute_q_blocks=False,
        )
