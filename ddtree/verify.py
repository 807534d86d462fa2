"""Verification of a draft tree: the inputs of the ONE target forward, and the greedy walk of its result.

The whole tree goes through the target as a flat sequence ``[root, node 1, ..., node n]`` (one row of the
batch). Each node sits at position ``start + depth`` and attends to the committed context plus its own
ancestors and itself, so its logits are exactly those the target would give after the prefix that ends at
that node.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ddtree.tree import DraftTree


def ancestor_matrix(parents: np.ndarray, depths: np.ndarray) -> np.ndarray:
    """[N, N] bool, entry (i, j) true iff node j is node i itself or one of its ancestors.

    Built with numpy: the tree is small and lives on the host, where a numpy op costs a fraction of a
    torch op's dispatch.
    """
    up = parents.clip(min=0)  # [N] the root is its own parent
    n = up.shape[0]
    rows = np.arange(n)
    anc = np.eye(n, dtype=bool)
    node = rows
    for _ in range(int(depths.max())):  # climb one level per step, all nodes at once
        node = up[node]
        anc[rows, node] = True
    return anc


def tree_verify_inputs(tree: DraftTree, start: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row of the verify batch, on the host: token ids [N], position ids [N] and the tree block of
    the mask [N, N] (True = attend; the row's committed columns before it are all visible).

    ``start`` is the root's position, which is also the number of tokens in the row's KV cache.
    """
    depths = tree.depths.numpy()
    return tree.tokens.numpy(), depths + start, ancestor_matrix(tree.parents.numpy(), depths)


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
