"""Verification of a draft tree: the inputs of the ONE target forward, and the greedy walk of its result.

The whole tree goes through the target as a flat sequence ``[root, node 1, ..., node n]``. Each node sits
at position ``start + depth`` and attends to the committed context plus its own ancestors and itself, so
its logits are exactly those the target would give after the prefix that ends at that node.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from ddtree.tree import DraftTree


def ancestor_matrix(parents: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """[N, N] bool on the CPU, entry (i, j) true iff node j is node i itself or one of its ancestors.

    Built with numpy: the tree is small and lives on the host, where a numpy op costs a fraction of a
    torch op's dispatch.
    """
    up = parents.cpu().numpy().clip(min=0)  # [N] the root is its own parent
    n = up.shape[0]
    rows = np.arange(n)
    anc = np.eye(n, dtype=bool)
    node = rows
    for _ in range(int(depths.max())):  # climb one level per step, all nodes at once
        node = up[node]
        anc[rows, node] = True
    return torch.from_numpy(anc)


def tree_verify_inputs(
    tree: DraftTree, start: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Token ids [1, N], position ids [1, N] and the additive mask [1, 1, N, start + N].

    ``start`` is the root's position, which is also the number of tokens in the target's KV cache. A
    root-only tree (plain decoding) sees everything, which is the model's own causal mask: None.
    """
    n = tree.num_nodes
    input_ids = tree.tokens.to(device).unsqueeze(0)  # [1, N]
    position_ids = (tree.depths + start).to(device).unsqueeze(0)  # [1, N]
    if n == 1:
        return input_ids, position_ids, None
    anc = ancestor_matrix(tree.parents, tree.depths)  # [N, N] built on the host, where the tree lives
    mask = torch.zeros(n, start + n, dtype=dtype, device=device)  # context columns: all visible
    mask[:, start:].masked_fill_(~anc.to(device), torch.finfo(dtype).min)
    return input_ids, position_ids, mask[None, None]


def follow_verified_tree(tree: DraftTree, target_token: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """Greedy acceptance: walk the target's argmax down the tree from the root.

    ``target_token(i)`` is the target's argmax after the prefix ending at node i; the walk asks only for
    the nodes it accepts. Returns the accepted node indices (root first) and the emitted tokens
    (accepted drafts, then the target's bonus token).
    Nodes come in pop order (every parent before its children), so one scan in index order meets each
    accepted node's children after the node itself; siblings carry distinct tokens, so at most one matches.
    """
    nodes, tokens = [0], [target_token(0)]
    for i, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
        if parent == nodes[-1] and token == tokens[-1]:
            nodes.append(i)
            tokens.append(target_token(i))
    return nodes, tokens


def first_child_chain(tree: DraftTree) -> list[int]:
    """Nodes of the path that takes every node's most probable child: the drafter's top-1 continuation.

    In pop order a node's first child to appear is its most probable one.
    """
    chain = [0]
    for i, parent in enumerate(tree.parents.tolist()):
        if parent == chain[-1]:
            chain.append(i)
    return chain
