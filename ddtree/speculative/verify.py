"""Verification of draft trees: the inputs of the ONE target forward, and the acceptance of its result.

Every row's tree goes through the target as a flat sequence ``[root, node 1, ..., node n]`` (one row of the
batch). Each node sits at position ``start + depth`` and attends to the committed context plus its own
ancestors and itself, so its logits are exactly those the target would give after the prefix that ends at
that node. ``tree_verdicts`` is the one acceptance: greedy, sampled and mixed batches, the LM head over
every node or along the walk, compiled per bucket or called eagerly. Everything here is tensor ops over
the whole batch: no host sync.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ddtree.model.precision import rows_linear
from ddtree.speculative.sampling import TargetLaw, emitted, walk_tree
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


def match_paths(
    tokens: torch.Tensor,
    depths: torch.Tensor,
    parents: torch.Tensor,
    valid: torch.Tensor,
    argmax: torch.Tensor,
    depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The acceptance from every node's emitted token (``argmax`` [B, N]: the target's token there; tokens,
    depths, parents and real nodes [B, N], ``depth`` a bound on the trees' depth): a node is accepted when
    its token is its parent's emitted one and its parent is accepted; siblings carry distinct tokens, so
    the accepted nodes form one path. One step per depth. Path, tokens [B, depth + 1] and lengths [B]."""
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


def walk_paths(
    candidates: torch.Tensor,
    children: torch.Tensor,
    argmax_at: Callable[[torch.Tensor], torch.Tensor],
    depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``match_paths`` asking the target only at the nodes it visits: ``argmax_at`` maps each row's current
    node [B] to the target's token there [B], once a depth and once for the bonus, so the LM head runs over
    B rows a step instead of B x N nodes (tokens [B, N], ``children_table`` [B, N, C], ``depth`` a bound:
    steps past a row's last node change nothing). Path, tokens [B, depth + 1] and lengths [B]."""
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


def tree_verdicts(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    trees: PaddedTrees,
    law: TargetLaw | None,
    depth: int,
    branching: int,
    walk: bool,
    node: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's verdict from the verify forward's final hidden states [B, N, H] and the LM head
    (``weight`` [V, H], ``bias``): the one acceptance, as vLLM's ``RejectionSampler.forward``.

    ``law`` says what the target emits at a node (None: every row greedy, no filter computed; see
    ``TargetLaw`` for its two rules). ``walk`` takes the head over each row's current node one depth at a
    time instead of over every node at once (the same verdicts). ``node`` maps the logits [B, M, V] at
    nodes [B, M] to what plain decoding would use there (structured outputs, penalties; eager calls only).
    ``depth`` bounds the trees' depth and ``branching`` a node's children, so a bucket's graph fixes
    ``depth``, ``branching``, ``walk`` and the law's kind: one compiled graph per bucket and kind.
    Path, tokens [B, depth + 1] and lengths [B]."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)

    def logits_at(cur: torch.Tensor) -> torch.Tensor:  # each row's current node [B] -> [B, 1, V]
        logits = F.linear(hidden[rows, cur], weight, bias)[:, None]
        return logits if node is None else node(logits, cur[:, None])

    if not walk:
        every = rows_linear(hidden, weight, bias)  # [B, N, V]; hidden may be a bucket's strided real part
        if node is not None:
            every = node(every, torch.arange(every.shape[1], device=every.device).expand(every.shape[:2]))
    if law is not None and law.finals is not None:  # SGLang's sibling-order rule
        if walk:
            probs_at = lambda cur: law.probs(logits_at(cur))[:, 0]  # noqa: E731
        else:
            probs = law.probs(every)  # [B, N, V]
            probs_at = lambda cur: probs[rows, cur]  # noqa: E731
        lossless = torch.ones_like(law.coins[:, :1])  # greedy rows: thresholds (1, 1) keep their argmax
        single = torch.where(law.greedy[:, None], lossless, law.threshold_single)  # [B, 1]
        acc = torch.where(law.greedy[:, None], lossless, law.threshold_acc)
        children = children_table(trees.parents, trees.valid, branching)
        return walk_tree(children, trees.tokens, probs_at, law.coins, law.finals, depth + 1, single, acc)
    if walk:
        children = children_table(trees.parents, trees.valid, branching)
        coins = None if law is None else law.coins
        emit_at = lambda cur: emitted(  # noqa: E731
            logits_at(cur), law, None if coins is None else coins[rows, cur][:, None]
        )[:, 0]
        return walk_paths(trees.tokens, children, emit_at, depth)
    tokens = every.argmax(dim=-1) if law is None else law.emit_tree(every)  # [B, N]
    return match_paths(trees.tokens, trees.depths, trees.parents, trees.valid, tokens, depth)
