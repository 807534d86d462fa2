"""DDTree draft-tree construction: the ``budget`` most probable draft prefixes, found best-first.

The drafter gives one distribution per future position (a factorised draft of the next block). Under
that factorisation a prefix's probability is the product of its per-position probabilities, so extending
a prefix or swapping a token for a lower-ranked one never raises it. A best-first heap over rank tuples
therefore pops prefixes in descending probability, and the first ``budget`` pops are exactly the
``budget`` most probable prefixes (among the top-K tokens per position). Every prefix of a popped prefix
was popped earlier, so the popped set is a tree rooted at the last accepted token.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from ddtree.errors import DDTreeError


@dataclass
class DraftTree:
    """A draft tree of N = n + 1 nodes; node 0 is the root (the last committed token)."""

    tokens: torch.Tensor  # [N] int64 token of each node; tokens[0] = root_token
    depths: torch.Tensor  # [N] int64; a node at depth d drafts block position d, root depth 0
    parents: torch.Tensor  # [N] int64; parents[0] = -1 and parents[i] < i (nodes are in pop order)
    logw: torch.Tensor  # [N] float32 cumulative draft log-prob of the prefix ending at the node; root 0

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    def prefix(self, n: int) -> DraftTree:
        """The first ``n`` nodes in pop order: a tree too, since parents come before their children."""
        return DraftTree(self.tokens[:n], self.depths[:n], self.parents[:n], self.logw[:n])

    @classmethod
    def root_only(cls, root_token: int) -> DraftTree:
        """The tree plain autoregressive decoding verifies: nothing drafted, only the bonus token."""
        zero = torch.zeros(1, dtype=torch.int64)
        return cls(torch.tensor([root_token]), zero, zero - 1, zero.float())


def build_ddtree_tree(
    draft_logits: torch.Tensor, budget: int, topk: int | None = None, root_token: int = 0
) -> DraftTree:
    """Best-first tree of the ``budget`` most probable prefixes of the drafted block.

    ``draft_logits`` is [L, V]: row d - 1 is the drafter's distribution for the token at depth d.
    ``topk`` bounds the branching per depth (default and maximum: min(budget, V), which loses nothing
    since a node's (budget + 1)-th best child can never be among the ``budget`` best prefixes).
    Outputs are on the CPU.
    """
    if draft_logits.dim() != 2 or draft_logits.shape[1] < 1:
        raise DDTreeError(f"draft_logits must be [L, V] with V >= 1, got shape {tuple(draft_logits.shape)}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise DDTreeError(f"tree budget must be an integer >= 1, got {budget!r}")
    if topk is not None and (isinstance(topk, bool) or not isinstance(topk, int) or topk < 1):
        raise DDTreeError(f"tree topk must be an integer >= 1 or None, got {topk!r}")
    depth_max, vocab = draft_logits.shape
    k = min(budget if topk is None else topk, budget, vocab)

    ranked = _RankedCandidates(torch.log_softmax(draft_logits.float(), dim=-1), k)
    vals, ids = ranked.vals, ranked.ids  # [L][<= K] each, grown on demand

    tokens, depths, parents, logw = [root_token], [0], [-1], [0.0]
    best = [row[0] for row in vals]  # [L] log-prob of each depth's top token: every first child's step
    pop, push = heapq.heappop, heapq.heappush
    # Entries (-score, depth, rank, parent node): the prefix is parent's prefix + the rank-th token at depth.
    heap: list[tuple[float, int, int, int]] = [(-best[0], 1, 0, 0)] if depth_max > 0 else []
    for node in range(1, budget + 1):
        if not heap:
            break
        neg_score, d, r, p = pop(heap)
        row = vals[d - 1]
        tokens.append(ids[d - 1][r])
        depths.append(d)
        parents.append(p)
        logw.append(-neg_score)
        if r + 1 < k:  # next sibling: same parent, next-ranked token
            if r + 1 == len(row):
                ranked.grow(d - 1)
            push(heap, (-(logw[p] + row[r + 1]), d, r + 1, p))
        if d < depth_max:  # first child: best token at the next depth
            push(heap, (neg_score - best[d], d + 1, 0, node))

    # One host array for the three integer outputs: each torch.tensor(list) call costs as much as the heap
    # spends on tens of nodes.
    ints = torch.from_numpy(np.array((tokens, depths, parents), dtype=np.int64))  # [3, N]
    return DraftTree(
        tokens=ints[0], depths=ints[1], parents=ints[2], logw=torch.tensor(logw, dtype=torch.float32)
    )


def top_k_rows(x: torch.Tensor, k: int, groups: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``x.topk(k, dim=-1)`` (values and indices, sorted descending) for [L, V], fast when V >> k.

    A top-k over a whole vocabulary is several passes. Instead split each row into V / ``groups``
    strided groups (group j holds entries j, j + V / groups, ...): their maxima are one vectorised
    pass. Every entry above the k-th largest value lies in a group whose maximum is above it, and fewer
    than k groups qualify, so the top k lie in the k groups with the largest maxima, and a top-k over
    those k * ``groups`` entries is exact (up to the order of equal values).
    """
    rows, vocab = x.shape
    if vocab % groups or vocab < 4 * k * groups:  # short rows: one top-k is cheaper
        return x.topk(k, dim=-1)
    cols = vocab // groups
    grid = x.view(rows, groups, cols)  # [L, G, V / G]; entry (g, j) is vocabulary id g * V / G + j
    best = grid.amax(dim=1).topk(k, dim=-1).indices  # [L, k] columns j holding the top k
    cand = grid.gather(2, best[:, None, :].expand(-1, groups, -1)).view(rows, -1)  # [L, G * k]
    values, pos = cand.topk(k, dim=-1)  # [L, k]; pos = g * k + (index into best)
    indices = (pos // k) * cols + best.gather(1, pos % k)  # [L, k] vocabulary ids
    return values, indices


class _RankedCandidates:
    """Per-depth candidates sorted by draft log-prob, fetched from the device lazily.

    A best-first tree rarely looks past the first few ranks of a depth, so one top-``FIRST_RANKS`` call
    serves almost every round; a depth that needs more fetches its whole top-k at once (exact either way).
    """

    FIRST_RANKS = 32

    def __init__(self, logp: torch.Tensor, k: int) -> None:
        self.logp = logp  # [L, V] log-softmax of the draft logits
        self.k = k
        values, indices = top_k_rows(logp, min(k, self.FIRST_RANKS))  # sorted descending, [L, K0]
        # One device->host transfer for both: the float32 values travel as their int32 bit patterns.
        host = torch.stack((values.view(torch.int32), indices.int())).cpu()  # [2, L, K0]
        self.vals: list[list[float]] = host[0].view(torch.float32).tolist()
        self.ids: list[list[int]] = host[1].tolist()

    def grow(self, depth: int) -> None:
        """Extend row ``depth`` of ``vals`` / ``ids`` in place to all ``k`` ranks (a depth grows once)."""
        values, indices = top_k_rows(self.logp[depth : depth + 1], self.k)  # [1, k] each
        values, indices = values[0].tolist(), indices[0].tolist()
        have, known = len(self.ids[depth]), self.ids[depth]
        if indices[:have] == known:  # no ties reordered across the known ranks: append the rest
            self.vals[depth] += values[have:]
            known += indices[have:]
            return
        seen = set(known)  # tokens beyond the known ones rank no higher than all of them
        for v, i in zip(values, indices, strict=True):
            if i not in seen:
                self.vals[depth].append(v)
                known.append(i)


@dataclass
class TreeRetrieve:
    """First-child / next-sibling encoding of a tree (SGLang's retrive_next_token / retrive_next_sibling)."""

    next_token: torch.Tensor  # [N] int64 first child of each node, -1 if leaf
    next_sibling: torch.Tensor  # [N] int64 next sibling, -1 if last; siblings by descending logw


def compile_ddtree_retrieve(parents: torch.Tensor, node_logw: torch.Tensor) -> TreeRetrieve:
    """Encode the tree so verification tries a node's children most probable first.

    ``parents`` [N] int64 (root -1, node 0) and ``node_logw`` [N] use local node indices; ties in logw
    keep node-index order. Outputs are on ``parents.device``.
    """
    if parents.dim() != 1 or node_logw.shape != parents.shape or parents.numel() < 1:
        raise DDTreeError(
            f"parents and node_logw must be equal-length 1-D tensors with a root, got "
            f"{tuple(parents.shape)} and {tuple(node_logw.shape)}"
        )
    n = parents.numel()
    next_token = torch.full((n,), -1, dtype=torch.int64, device=parents.device)
    next_sibling = torch.full((n,), -1, dtype=torch.int64, device=parents.device)
    if n > 1:
        # Two stable sorts give order by (parent asc, logw desc, index asc) over the non-root nodes.
        nodes = torch.arange(1, n, device=parents.device)  # [n - 1]
        nodes = nodes[torch.sort(node_logw[1:], descending=True, stable=True).indices]
        order = nodes[torch.sort(parents[nodes], stable=True).indices]  # [n - 1]
        par = parents[order].long()  # [n - 1]
        same = par[1:] == par[:-1]  # [n - 2] consecutive entries are siblings
        next_sibling[order[:-1][same]] = order[1:][same]
        first = torch.cat((same.new_ones(1), ~same))  # [n - 1] head of each sibling group
        next_token[par[first]] = order[first]
    return TreeRetrieve(next_token=next_token, next_sibling=next_sibling)
