"""Verification of draft trees: the inputs of the ONE target forward, and the greedy acceptance of its result.

Every row's tree goes through the target as a flat sequence ``[root, node 1, ..., node n]`` (one row of the
batch). Each node sits at position ``start + depth`` and attends to the committed context plus its own
ancestors and itself, so its logits are exactly those the target would give after the prefix that ends at
that node. Everything here is tensor ops over the whole batch (``TreeBatch``): no host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree.speculative.tree import PaddedTrees, TreeBatch, children_table


@dataclass
class Accepted:
    """A round's verdicts on the device, per row: the accepted nodes root first (``path[b, :lengths[b]]``)
    and the emitted tokens, the accepted drafts then the bonus (``tokens[b, :lengths[b]]``); node
    ``path[b, t + 1]`` holds token ``tokens[b, t]``. Entries past a row's length are padding (0)."""

    path: torch.Tensor  # [B, S] int64, S = deepest node + 1
    tokens: torch.Tensor  # [B, S] int64
    lengths: torch.Tensor  # [B] int64, >= 1
    # With fixed shapes: the whole batch bucket's verdicts ([Bp, S], dummy rows included) that these rows
    # head, so the KV pack can run as the bucket's graph
    bucket: Accepted | None = None

    def head(self, rows: int) -> Accepted:
        """The first ``rows`` rows (a padded bucket's requests), remembering the whole bucket."""
        return Accepted(self.path[:rows], self.tokens[:rows], self.lengths[:rows], bucket=self)


def ancestor_mask(trees: TreeBatch) -> torch.Tensor:
    """[B, N, N] bool, entry (b, i, j) true iff node j is node i itself or one of its ancestors (padding
    nodes see none: they attend to committed columns only)."""
    return ancestors(trees.parents, trees.valid, trees.depth)


def ancestors(parents: torch.Tensor, valid: torch.Tensor, depth: int) -> torch.Tensor:
    """``ancestor_mask`` from parents and real nodes [B, N], climbing ``depth`` levels (a bound)."""
    b, n = parents.shape
    up = parents.clamp(min=0)  # [B, N]; the root is its own parent
    node = torch.arange(n, device=up.device).expand(b, n)
    anc = torch.eye(n, dtype=torch.bool, device=up.device).expand(b, n, n).clone()
    for _ in range(depth):  # climb one level per step, all nodes at once
        node = up.gather(1, node)
        anc.scatter_(2, node[..., None], True)
    return anc & valid[:, :, None]


def tree_inputs(
    trees: PaddedTrees, starts: torch.Tensor, scratch: int, depth: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The verify forward's ids, positions, columns [B, N] and ancestor block [B, N, N] of padded trees
    (``starts`` [B] committed columns): node j at position start + depth_j, column start + j; padding
    nodes at the root's position, in the scratch column, seeing committed columns only. Fixed shapes:
    one graph per bucket when compiled."""
    valid = trees.valid  # [B, N]
    nodes = torch.arange(valid.shape[1], device=valid.device)
    ids = torch.where(valid, trees.tokens, 0)
    positions = starts[:, None] + torch.where(valid, trees.depths, 0)
    cols = torch.where(valid, starts[:, None] + nodes, scratch)
    return ids, positions, cols, ancestors(trees.parents, valid, depth)


def accept_greedy(trees: TreeBatch, argmax: torch.Tensor) -> Accepted:
    """Greedy acceptance of every row at once: a node is accepted when its token is its parent's target
    argmax (``argmax`` [B, N]) and its parent is accepted; siblings carry distinct tokens, so the accepted
    nodes form one path. One step per depth, on the device."""
    return Accepted(*match_paths(trees.tokens, trees.depths, trees.parents, trees.valid, argmax, trees.depth))


def match_paths(
    tokens: torch.Tensor,
    depths: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    argmax: torch.Tensor,
    depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``accept_greedy`` over tensors ([B, N] each, ``depth`` a bound on the trees' depth): path, tokens
    [B, depth + 1] and lengths [B]."""
    b, n = tokens.shape
    up = parents.clamp(min=0)  # [B, N]
    match = valid & (tokens == argmax.gather(1, up))  # [B, N]
    match[:, 0] = True
    accepted = match
    for _ in range(depth):
        accepted = match & accepted.gather(1, up)
    steps = depth + 1
    path = torch.zeros(b, steps + 1, dtype=torch.int64, device=up.device)  # column `steps`: discarded
    nodes = torch.arange(n, device=up.device).expand(b, n)
    path.scatter_(1, torch.where(accepted, depths, steps), nodes)  # the node accepted at each depth
    path = path[:, :steps]
    return path, argmax.gather(1, path), accepted.sum(dim=1)


def walk_greedy(trees: TreeBatch, argmax_at: Callable[[torch.Tensor], torch.Tensor]) -> Accepted:
    """Greedy acceptance asking the target only at the nodes it visits: ``argmax_at`` maps each row's
    current node [B] to the target's argmax there [B], once a depth and once for the bonus, so the LM
    head runs over B rows a step instead of B x N nodes. The same verdicts as ``accept_greedy``."""
    return Accepted(*walk_paths(trees.tokens, trees.children(), argmax_at, trees.depth))


def walk_paths(
    candidates: torch.Tensor,
    children: torch.Tensor,
    argmax_at: Callable[[torch.Tensor], torch.Tensor],
    depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``walk_greedy`` over tensors (tokens [B, N], ``children_table`` [B, N, C], ``depth`` a bound: steps
    past a row's last node change nothing): path, tokens [B, depth + 1] and lengths [B]."""
    b, _ = candidates.shape
    device = candidates.device
    steps = depth + 1
    rows = torch.arange(b, device=device)
    cur = torch.zeros(b, dtype=torch.int64, device=device)
    alive = torch.ones(b, dtype=torch.bool, device=device)
    path = torch.zeros(b, steps, dtype=torch.int64, device=device)
    tokens = torch.zeros(b, steps, dtype=torch.int64, device=device)
    lengths = torch.ones(b, dtype=torch.int64, device=device)
    for t in range(1, steps):
        best = argmax_at(cur)  # [B]
        tokens[:, t - 1] = torch.where(alive, best, tokens[:, t - 1])
        ch = children[rows, cur]  # [B, C]
        hit = (ch >= 0) & (candidates.gather(1, ch.clamp(min=0)) == best[:, None]) & alive[:, None]
        alive = hit.any(dim=1)  # siblings carry distinct tokens: at most one child matches
        nxt = ch.gather(1, hit.int().argmax(dim=1, keepdim=True))[:, 0]
        cur = torch.where(alive, nxt, cur)
        path[:, t] = torch.where(alive, nxt, 0)
        lengths += alive
    tokens[:, -1] = torch.where(alive, argmax_at(cur), tokens[:, -1])
    return path, tokens, lengths


def greedy_verdicts(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    trees: PaddedTrees,
    depth: int,
    branching: int,
    walk: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy verdicts of padded trees from the verify forward's hidden states [B, N, H] and the LM head
    (``weight`` [V, H], ``bias``): the head over every node at once, or (``walk``) over each row's current
    node one depth at a time. Path, tokens [B, depth + 1], lengths [B]; one graph per bucket when
    compiled (``depth``, ``branching`` and ``walk`` are fixed per bucket)."""
    valid = trees.valid
    if walk:
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        children = children_table(trees.parents, valid, branching)
        argmax_at = lambda cur: F.linear(hidden[rows, cur], weight, bias).argmax(dim=-1)  # noqa: E731
        return walk_paths(trees.tokens, children, argmax_at, depth)
    argmax = F.linear(hidden, weight, bias).argmax(dim=-1)  # [B, N]
    return match_paths(trees.tokens, trees.depths, trees.parents, valid, argmax, depth)
