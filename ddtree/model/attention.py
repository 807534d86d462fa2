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

On CUDA both need care to reach a fused kernel. SDPA's flash kernel takes no mask and its memory-efficient
kernel (torch <= 2.13) no GQA, so a masked GQA call would run the math kernel (float32 scores, [B, heads,
T, S]): ``sdpa_operands`` expands the KV heads instead. Flex's Triton kernels need their tiles to divide
the block mask's (16-token key blocks, the pool's): ``flex_kernel_options`` picks them per shape.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from ddtree.errors import DDTreeError
from ddtree.model.kv_cache import PagedKVCache

FLEX_Q_BLOCK = 128  # FlexAttention's query tile; a tree of up to 128 nodes is one tile
FLEX_MAX_BLOCK_N = 64  # the widest key step a flex kernel takes here (torch's own defaults reach 64-128)
FLEX_MIN_TILE = 16  # tl.dot's smallest side: no kernel tile below it


def flex_kernel_options(queries: int, heads: int, kv_heads: int, kv_block: int) -> dict[str, int | bool]:
    """The Triton tiles that make CUDA's flex kernels compile over a block mask of ``FLEX_Q_BLOCK`` x
    ``kv_block`` tiles, for ``queries`` query rows of ``heads`` heads over ``kv_heads``.

    torch 2.13 refuses a kernel config unless the mask's tiles are multiples of the kernel's (``BLOCK_M``
    divides the query tile, ``BLOCK_N`` the key tile; ``tests/test_cuda_attention_rules.py`` cites the lines).
    Its defaults take ``BLOCK_N`` 32-128, more than the pool's 16-token key tile, so: ``BLOCK_N`` is the key
    tile's largest power-of-two divisor up to ``FLEX_MAX_BLOCK_N``. Under 128 queries with a power-of-two GQA
    group torch picks its decode kernel, whose ``BLOCK_M`` (rows = a query x every head of its group) would be
    ``next_pow2(queries x group)``: past the query tile for a 17-node tree at group 8, so it is capped at the
    tile (the kernel then tiles the rows; it needs the group to divide ``BLOCK_M``). A group wider than the
    tile goes to the main kernel, whose own ``BLOCK_M`` (16-128) always divides the tile."""
    block_n = math.gcd(kv_block, FLEX_MAX_BLOCK_N)
    if block_n < FLEX_MIN_TILE:
        raise DDTreeError(
            f"flex attention on CUDA needs a KV block size that is a multiple of 16, got {kv_block}"
        )
    options: dict[str, int | bool] = {"BLOCK_N": block_n}
    group = heads // kv_heads
    if queries < FLEX_Q_BLOCK and group & (group - 1) == 0:  # torch's rule for its decode kernel
        if group > FLEX_Q_BLOCK:
            options["FORCE_USE_FLEX_ATTENTION"] = True
        else:
            rows = 1 << (queries * group - 1).bit_length()  # next power of two
            options["BLOCK_M"] = min(max(rows, FLEX_MIN_TILE), FLEX_Q_BLOCK)
    return options


def sdpa_operands(
    keys: torch.Tensor,  # [B, kv_heads, S, D]
    values: torch.Tensor,  # [B, kv_heads, S, Dv]
    heads: int,
    masked: bool,
    device_type: str,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Keys, values and ``enable_gqa`` for ``scaled_dot_product_attention``. On CUDA a mask rules out the
    flash kernel and GQA (torch <= 2.13) the memory-efficient one, which leaves the math kernel and its
    float32 scores: with a mask, the KV heads are expanded instead ([B, heads, S, D]: the KV bytes times
    the group, far less than the scores) and the memory-efficient kernel takes the mask. Elsewhere (the
    CPU's own kernels take both) and without a mask (flash takes GQA), nothing changes."""
    group = heads // keys.shape[1]
    if group == 1:
        return keys, values, False
    if not masked or device_type != "cuda":
        return keys, values, True
    return keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1), False


def attend(
    q: torch.Tensor,  # [B, heads, T, D]
    keys: torch.Tensor,  # [B, kv_heads, S, D]: gathered rows (sdpa) or the whole pool (flex)
    values: torch.Tensor,  # [B, kv_heads, S, D]
    mask: torch.Tensor | BlockMask | None,  # [B, 1, T, S] bool (True = attend), a BlockMask, or None
    scale: float | None = None,
) -> torch.Tensor:
    """Attention output [B, heads, T, D] in q's dtype through either backend (``mask``'s type says which),
    computed in the keys' dtype (a pool may hold wider numbers than the model computes in:
    ``memory.pool_dtype``)."""
    if q.dtype != keys.dtype:
        return attend(q.to(keys.dtype), keys, values, mask, scale).to(q.dtype)
    if isinstance(mask, BlockMask):
        return flex(q, keys, values, mask, scale)
    keys, values, gqa = sdpa_operands(keys, values, q.shape[1], mask is not None, q.device.type)
    v = values.shape[-1]
    if q.device.type == "cpu" and v != q.shape[-1]:
        # The CPU's fused SDPA kernel needs values as wide as the queries (MLA: 128 against 192); without
        # it the math kernel holds float32 scores, [B, heads, T, S] several times over (34 GB for a
        # 2,048-token prefill over 65,536 columns at Kimi K2's 64 heads). Zero columns change no output.
        values = F.pad(values, (0, q.shape[-1] - v))
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return out[..., :v]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)


def flex(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: BlockMask, scale: float | None):
    """``flex_attention`` through ``mask``; on CUDA with the tiles its kernels compile with (on the CPU
    torch's own choice, which compiles as it is)."""
    options = None
    if q.device.type == "cuda":
        options = flex_kernel_options(q.shape[2], q.shape[1], keys.shape[1], mask.BLOCK_SIZE[1])
    gqa = keys.shape[1] != q.shape[1]
    return flex_attention(
        q, keys, values, block_mask=mask, scale=scale, enable_gqa=gqa, kernel_options=options
    )


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
        return flex(q, keys, values, mask, scale)
    folded = q.reshape(b, 1, heads * t, d)  # [B, 1, heads * T, rank + rope]
    if q.device.type == "cpu":  # the latent as values: equal head dims keep the CPU's fused kernel (below)
        out = F.scaled_dot_product_attention(folded, keys, keys, attn_mask=mask, scale=scale)[..., :rank]
        return out.reshape(b, heads, t, rank)
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
