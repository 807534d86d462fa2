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

from ddtree.tree import TreeBatch


@dataclass
class Accepted:
    """A round's verdicts on the device, per row: the accepted nodes root first (``path[b, :lengths[b]]``)
    and the emitted tokens, the accepted drafts then the bonus (``tokens[b, :lengths[b]]``); node
    ``path[b, t + 1]`` holds token ``tokens[b, t]``. Entries past a row's length are padding (0)."""

    path: torch.Tensor  # [B, S] int64, S = deepest node + 1
    tokens: torch.Tensor  # [B, S] int64
    lengths: torch.Tensor  # [B] int64, >= 1


def ancestor_mask(trees: TreeBatch) -> torch.Tensor:
    """[B, N, N] bool, entry (b, i, j) true iff node j is node i itself or one of its ancestors (padding
    nodes see none: they attend to committed columns only)."""
    b, n = trees.tokens.shape
    up = trees.parents.clamp(min=0)  # [B, N]; the root is its own parent
    node = torch.arange(n, device=up.device).expand(b, n)
    anc = torch.eye(n, dtype=torch.bool, device=up.device).expand(b, n, n).clone()
    for _ in range(trees.depth):  # climb one level per step, all nodes at once
        node = up.gather(1, node)
        anc.scatter_(2, node[..., None], True)
    return anc & trees.valid[:, :, None]


def accept_greedy(trees: TreeBatch, argmax: torch.Tensor) -> Accepted:
    """Greedy acceptance of every row at once: a node is accepted when its token is its parent's target
    argmax (``argmax`` [B, N]) and its parent is accepted; siblings carry distinct tokens, so the accepted
    nodes form one path. One step per depth, on the device."""
    b, n = trees.tokens.shape
    up = trees.parents.clamp(min=0)  # [B, N]
    match = trees.valid & (trees.tokens == argmax.gather(1, up))  # [B, N]
    match[:, 0] = True
    accepted = match
    for _ in range(trees.depth):
        accepted = match & accepted.gather(1, up)
    steps = trees.depth + 1
    path = torch.zeros(b, steps + 1, dtype=torch.int64, device=up.device)  # column `steps`: discarded
    nodes = torch.arange(n, device=up.device).expand(b, n)
    path.scatter_(1, torch.where(accepted, trees.depths, steps), nodes)  # the node accepted at each depth
    path = path[:, :steps]
    lengths = accepted.sum(dim=1)
    return Accepted(path=path, tokens=argmax.gather(1, path), lengths=lengths)


def walk_greedy(trees: TreeBatch, argmax_at: Callable[[torch.Tensor], torch.Tensor]) -> Accepted:
    """Greedy acceptance asking the target only at the nodes it visits: ``argmax_at`` maps each row's
    current node [B] to the target's argmax there [B], once a depth and once for the bonus, so the LM
    head runs over B rows a step instead of B x N nodes. The same verdicts as ``accept_greedy``."""
    b, _ = trees.tokens.shape
    device = trees.tokens.device
    steps = trees.depth + 1
    children = trees.children()  # [B, N, C]
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
        hit = (ch >= 0) & (trees.tokens.gather(1, ch.clamp(min=0)) == best[:, None]) & alive[:, None]
        alive = hit.any(dim=1)  # siblings carry distinct tokens: at most one child matches
        nxt = ch.gather(1, hit.int().argmax(dim=1, keepdim=True))[:, 0]
        cur = torch.where(alive, nxt, cur)
        path[:, t] = torch.where(alive, nxt, 0)
        lengths += alive
    tokens[:, -1] = torch.where(alive, argmax_at(cur), tokens[:, -1])
    return Accepted(path=path, tokens=tokens, lengths=lengths)
