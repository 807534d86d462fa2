"""SGLang interop: DDTree's trees and verification behind sgl_kernel's own signatures.

SGLang's speculative workers (its DFlash worker included) verify draft trees with two CUDA ops,
``tree_speculative_sampling_target_only`` and ``verify_tree_greedy``; where ``sgl_kernel`` lacks them the
worker refuses every non-greedy request. The functions here are drop-ins with the kernels' exact
signatures and in-place outputs, batched over rows on the tensors' device with no host sync, running
ddtree's own device code (``ddtree.speculative.sampling``, ``ddtree.speculative.verify``), not a scalar
port. ``compile_ddtree_retrieve`` encodes a DDTree draft tree as the kernels' first-child / next-sibling
lists, children most probable first.

    from ddtree.sglang import compile_ddtree_retrieve, tree_speculative_sampling_target_only

Index tensors are int64 (int32 accepted), node 0 of every row is the root, and ``retrive_index`` maps a
row's nodes to slots of the flat ``predicts``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ddtree.errors import DDTreeError
from ddtree.request.params import check_accept_thresholds
from ddtree.speculative.sampling import inverse_cdf, walk_tree
from ddtree.speculative.verify import Accepted, walk_paths

__all__ = [
    "DraftTree",
    "TreeRetrieve",
    "compile_ddtree_retrieve",
    "follow_verified_tree",
    "tree_speculative_sampling_target_only",
    "verify_tree_greedy",
]


@dataclass
class DraftTree:
    """One draft tree of N nodes in pop order (every parent before its children); node 0 is the root, the
    last committed token, whose child at depth d drafts block position d."""

    tokens: torch.Tensor  # [N] int64; tokens[0] = the root token
    depths: torch.Tensor  # [N] int64; the root at depth 0
    parents: torch.Tensor  # [N] int64; parents[0] = -1 and parents[i] < i
    logw: torch.Tensor  # [N] float32 cumulative draft log-prob of the prefix ending at the node; root 0

    @property
    def num_nodes(self) -> int:
        return self.tokens.numel()

    @classmethod
    def root_only(cls, root_token: int) -> DraftTree:
        """The tree plain autoregressive decoding verifies: nothing drafted, only the bonus token."""
        zero = torch.zeros(1, dtype=torch.int64)
        return cls(torch.tensor([root_token]), zero, zero - 1, zero.float())


@dataclass
class TreeRetrieve:
    """A tree as SGLang's ``retrive_next_token`` / ``retrive_next_sibling`` lists."""

    next_token: torch.Tensor  # [N] int64 first child of each node, -1 for a leaf
    next_sibling: torch.Tensor  # [N] int64 next sibling, -1 for the last; siblings by descending logw


def compile_ddtree_retrieve(parents: torch.Tensor, node_logw: torch.Tensor) -> TreeRetrieve:
    """Encode one tree so verification tries a node's children most probable first.

    ``parents`` [N] (root -1, node 0) and ``node_logw`` [N] index the tree's own nodes; ties in logw keep
    node order. Outputs are on ``parents.device``."""
    if parents.dim() != 1 or node_logw.shape != parents.shape or parents.numel() < 1:
        raise DDTreeError(
            f"parents and node_logw must be equal-length 1-D tensors with a root, got "
            f"{tuple(parents.shape)} and {tuple(node_logw.shape)}"
        )
    n = parents.numel()
    next_token = torch.full((n,), -1, dtype=torch.int64, device=parents.device)
    next_sibling = torch.full((n,), -1, dtype=torch.int64, device=parents.device)
    if n > 1:
        # Two stable sorts order the non-root nodes by (parent asc, logw desc, index asc).
        nodes = torch.arange(1, n, device=parents.device)  # [n - 1]
        nodes = nodes[torch.sort(node_logw[1:], descending=True, stable=True).indices]
        order = nodes[torch.sort(parents[nodes], stable=True).indices]  # [n - 1]
        par = parents[order].long()  # [n - 1]
        same = par[1:] == par[:-1]  # [n - 2] consecutive entries are siblings
        next_sibling[order[:-1][same]] = order[1:][same]
        first = torch.cat((same.new_ones(1), ~same))  # [n - 1] the head of each sibling group
        next_token[par[first]] = order[first]
    return TreeRetrieve(next_token=next_token, next_sibling=next_sibling)


def children_from_lists(next_token: torch.Tensor, next_sibling: torch.Tensor) -> torch.Tensor:
    """[bs, N, C] each node's children in sibling order (-1 past the last) from the linked lists [bs, N]:
    rank 0 is the first child, rank r + 1 the next sibling of rank r (C = N - 1 at most)."""
    bs, n = next_token.shape
    ranks = [next_token.long()]
    for _ in range(n - 2):
        prev = ranks[-1]
        ranks.append(torch.where(prev >= 0, next_sibling.long().gather(1, prev.clamp(min=0)), -1))
    if n > 1:
        return torch.stack(ranks, dim=2)
    return torch.full((bs, n, 1), -1, dtype=torch.int64, device=next_token.device)


def write_verdicts(
    walk: Accepted,
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    retrive_index: torch.Tensor,
) -> None:
    """The kernels' outputs from a walk: node path[t] predicts the token of path[t + 1] and the last
    accepted node the bonus; accept_index holds the accepted nodes' slots (entries past a row's path left
    as they were); accept_token_num the accepted drafts, bonus excluded."""
    steps = accept_index.shape[1]
    t = torch.arange(steps, device=walk.path.device)[None]  # [1, S]
    on_path = t < walk.lengths[:, None]  # [bs, S]
    slots = retrive_index.long().gather(1, walk.path)  # [bs, S]
    # Padding entries rewrite the root's slot with the root's own value: every write is deterministic.
    values = torch.where(on_path, walk.tokens, walk.tokens[:, :1]).to(predicts.dtype)
    predicts[torch.where(on_path, slots, slots[:, :1]).view(-1).to(predicts.device)] = values.view(-1)
    accept_index.copy_(torch.where(on_path, slots.to(accept_index.dtype), accept_index))
    accept_token_num.copy_(walk.lengths - 1)


def check_outputs(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor) -> None:
    if any(t.dtype != torch.int32 for t in (predicts, accept_index, accept_token_num)):
        raise DDTreeError("predicts, accept_index and accept_token_num must be int32")


# fmt: off
def tree_speculative_sampling_target_only(
    predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor, candidates: Tensor,
    retrive_index: Tensor, retrive_next_token: Tensor, retrive_next_sibling: Tensor,
    uniform_samples: Tensor, uniform_samples_for_final_sampling: Tensor, target_probs: Tensor,
    draft_probs: Tensor, threshold_single: float = 1.0, threshold_acc: float = 1.0,
    deterministic: bool = True,
) -> None:  # sgl_kernel's signature
    # fmt: on
    """Tree rejection sampling with sgl_kernel's contract; writes ``predicts`` [bs * N], ``accept_index``
    [bs, S] and ``accept_token_num`` [bs] (int32) in place, and its scratch ``draft_probs``.

    candidates and the retrive lists are [bs, N]; uniform_samples [bs, N] float32 (node x's children are
    tried in sibling order with the coin uniform_samples[row, x]); uniform_samples_for_final_sampling
    [bs]; target_probs and draft_probs [bs, N, V] float32, draft_probs coming in as zeros (SGLang's
    buffer): every child tried and rejected gets its target mass written there. A child with target
    probability p is accepted iff (p > 0 and coin < running sum / threshold_acc) or p >= threshold_single;
    the bonus after the last accepted node is drawn with the final coin from max(target - draft_probs, 0)
    there (the plain target row when the walk used all S - 1 steps). The default thresholds (1, 1) are
    lossless; lower ones accept more and are SGLang's lossy speed option. Always deterministic."""
    del deterministic  # every op here is deterministic
    check_outputs(predicts, accept_index, accept_token_num)
    bs, n = candidates.shape
    vocab = target_probs.shape[-1]
    if target_probs.shape != (bs, n, vocab) or draft_probs.shape != target_probs.shape:
        raise DDTreeError(f"target/draft probs must be [{bs}, {n}, V], got {tuple(target_probs.shape)}")
    if target_probs.dtype != torch.float32 or draft_probs.dtype != torch.float32:
        raise DDTreeError("target_probs and draft_probs must be float32")
    device = target_probs.device
    rows = torch.arange(bs, device=device)
    children = children_from_lists(retrive_next_token, retrive_next_sibling)
    finals = uniform_samples_for_final_sampling.float().to(device)
    probs_at = lambda cur: target_probs[rows, cur]  # noqa: E731
    coins, steps = uniform_samples.float(), accept_index.shape[1]
    thresholds = check_accept_thresholds(threshold_single, threshold_acc)
    walk = Accepted(*walk_tree(children, candidates.long(), probs_at, coins, finals, steps, *thresholds))
    tokens = kernel_scratch(children, candidates.long(), target_probs, draft_probs, finals, walk)
    write_verdicts(
        Accepted(walk.path, tokens, walk.lengths), predicts, accept_index, accept_token_num, retrive_index
    )


def kernel_scratch(
    children: torch.Tensor,
    candidates: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    final_coins: torch.Tensor,
    walk: Accepted,
) -> torch.Tensor:
    """sgl_kernel's scratch from a walk's verdicts: every child tried and rejected (those before the
    accepted one, and all of the node the walk stopped at) has its target mass written to ``draft_probs``
    (one scatter, no host sync), and the bonus is drawn from the last node's target row less
    ``draft_probs`` there when the walk stopped before its last step (what a caller's nonzero buffer
    changes). Returns the emitted tokens [B, S] with that bonus."""
    b, steps = walk.path.shape
    n, vocab = target_probs.shape[1:]
    device = candidates.device
    rows = torch.arange(b, device=device)
    ranks = torch.arange(children.shape[2], device=device)
    fallback = torch.full((b,), vocab - 1, dtype=torch.int64, device=device)
    cells, masses = [], []
    for t in range(steps - 1):
        node = walk.path[:, t]  # [B]
        kids = children[rows, node]  # [B, C]
        tokens = candidates.gather(1, kids.clamp(min=0))  # [B, C]
        mass = target_probs[rows[:, None], node[:, None], tokens]  # [B, C]
        taken = t + 1 < walk.lengths  # [B] the walk went on from this node
        accepted_rank = (kids == walk.path[:, t + 1, None]).int().argmax(dim=1)
        cut = torch.where(taken, accepted_rank, kids.shape[1])  # [B] ranks before this were rejected
        rejected = (kids >= 0) & (t < walk.lengths)[:, None] & (ranks[None] < cut[:, None])  # [B, C]
        cell = (rows[:, None] * n + node[:, None]) * vocab + tokens  # [B, C] in draft_probs.view(-1)
        cells.append(torch.where(rejected, cell, b * n * vocab))  # the rest: one slot past the end
        masses.append(torch.where(rejected, mass, 0.0))
        stop = rejected & (mass > 0) & ~taken[:, None]  # the stop node's rejected children with mass
        last = stop.int().cumsum(dim=1).argmax(dim=1)  # [B] the last of them
        fallback = torch.where(stop.any(dim=1), tokens.gather(1, last[:, None])[:, 0], fallback)
    if cells:  # every (row, node, token) is rejected at most once: one scatter for the whole walk
        scratch = torch.cat((draft_probs.view(-1), draft_probs.new_zeros(1)))
        scratch.scatter_(0, torch.cat(cells, dim=1).view(-1), torch.cat(masses, dim=1).view(-1))
        draft_probs.view(-1).copy_(scratch[:-1])
    end = walk.path.gather(1, (walk.lengths - 1)[:, None])[:, 0]  # [B] the last accepted node
    q = target_probs[rows, end]  # [B, V]
    stopped = walk.lengths < steps
    residual = torch.where(stopped[:, None], (q - draft_probs[rows, end]).clamp_min(0.0), q)
    bonus = inverse_cdf(residual, final_coins)
    bonus = torch.where(bonus >= 0, bonus, fallback)
    at_end = torch.arange(steps, device=device)[None] == (walk.lengths - 1)[:, None]
    return torch.where(at_end, bonus[:, None], walk.tokens)


# fmt: off
def verify_tree_greedy(
    predicts: Tensor, accept_index: Tensor, accept_token_num: Tensor, candidates: Tensor,
    retrive_index: Tensor, retrive_next_token: Tensor, retrive_next_sibling: Tensor, target_predict: Tensor,
) -> None:  # sgl_kernel's signature
    # fmt: on
    """Greedy tree verification with sgl_kernel's contract: a child is accepted when its token is the
    target's prediction at its parent (``target_predict`` [bs, N], the argmax at each node); outputs as
    ``tree_speculative_sampling_target_only``'s."""
    check_outputs(predicts, accept_index, accept_token_num)
    rows = torch.arange(candidates.shape[0], device=candidates.device)
    predicted = target_predict.long()
    path, tokens, lengths = walk_paths(
        candidates.long(),
        children_from_lists(retrive_next_token, retrive_next_sibling),
        lambda cur: predicted[rows, cur],
        accept_index.shape[1] - 1,
    )
    write_verdicts(Accepted(path, tokens, lengths), predicts, accept_index, accept_token_num, retrive_index)


def follow_verified_tree(tree: DraftTree, target_token: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """The greedy walk of one tree: ``target_token(i)`` is the target's argmax after the prefix ending at
    node i, asked only at the nodes the walk reaches (once a depth, and once for the bonus). Returns the
    accepted node indices (root first) and the emitted tokens (accepted drafts, then the bonus)."""
    n = tree.num_nodes
    parents, tokens = tree.parents.long().cpu(), tree.tokens.long().cpu()
    logw = torch.arange(n, 0, -1, dtype=torch.float32)  # node order: the children table's sibling order
    lists = compile_ddtree_retrieve(parents, logw)
    children = children_from_lists(lists.next_token[None], lists.next_sibling[None])
    depth = int(tree.depths.max()) if n > 1 else 0
    asked: dict[int, int] = {}  # the walk stays at its last node once it stops: ask each node once

    def argmax_at(cur: torch.Tensor) -> torch.Tensor:
        node = int(cur[0])
        if node not in asked:
            asked[node] = target_token(node)
        return torch.tensor([asked[node]])

    path, emitted, length = walk_paths(tokens[None], children, argmax_at, depth)
    k = int(length[0])
    return path[0, :k].tolist(), emitted[0, :k].tolist()
