from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ddtree.sglang import DraftTree
from ddtree.speculative.tree import PaddedTrees, TreeSpec, build_tree_batch, children_table, draft_candidates
from ddtree.speculative.verify import tree_verdicts, walk_paths
from tests.conftest import tree_from_parents
from tests.oracles import build_ddtree_tree, follow_verified_tree, tree_row


def _walk_with_child_maps(tree: DraftTree, target_tokens: list[int]) -> tuple[list[int], list[int]]:
    """Reference: the textbook walk over per-node {token: child} maps."""
    children: list[dict[int, int]] = [{} for _ in range(tree.num_nodes)]
    for i, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist(), strict=True)):
        if i:
            children[parent][token] = i
    nodes, tokens = [0], []
    while True:
        tokens.append(target_tokens[nodes[-1]])
        child = children[nodes[-1]].get(tokens[-1])
        if child is None:
            return nodes, tokens
        nodes.append(child)


def test_greedy_walk_follows_the_target_argmax_and_ends_with_the_bonus():
    #        0 (root)
    #      /   \
    #  1:'5'   2:'6'
    #   |     /    \
    # 3:'7' 4:'8'  5:'9'
    tree = tree_from_parents([-1, 0, 0, 1, 2, 2], [0, 5, 6, 7, 8, 9])
    # The target picks 6 after the root, 9 after node 2 and 4 after node 5: two drafts accepted + bonus 4.
    assert follow_verified_tree(tree, [6, 0, 9, 0, 0, 4].__getitem__) == ([0, 2, 5], [6, 9, 4])
    assert follow_verified_tree(tree, [3, 7, 7, 7, 7, 7].__getitem__) == ([0], [3])  # nothing accepted
    assert follow_verified_tree(tree, [5, 7, 0, 1, 0, 0].__getitem__) == ([0, 1, 3], [5, 7, 1])  # to a leaf


@pytest.mark.parametrize("seed", range(20))
def test_greedy_walk_equals_the_child_map_walk_on_built_trees(seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 5, generator=gen) * 0.5  # flat: wide trees with many siblings
    tree = build_ddtree_tree(logits, 40, root_token=3)
    # Targets that mostly agree with some child, so the walks go deep.
    target = [int(t) for t in torch.randint(0, 5, (tree.num_nodes,), generator=gen)]
    assert follow_verified_tree(tree, target.__getitem__) == _walk_with_child_maps(tree, target)


def test_greedy_walk_asks_the_target_only_about_the_nodes_it_accepts():
    """The engine computes LM-head rows on demand, so the walk must not look at other nodes."""
    tree = tree_from_parents([-1, 0, 0, 1, 2, 2, 4], [0, 5, 6, 7, 8, 9, 3])
    argmax = [6, 0, 8, 0, 3, 0, 2]
    asked: list[int] = []

    def target_token(i: int) -> int:
        asked.append(i)
        return argmax[i]

    nodes, tokens = follow_verified_tree(tree, target_token)
    assert (nodes, tokens) == ([0, 2, 4, 6], [6, 8, 3, 2])
    assert asked == nodes


def test_batched_greedy_acceptance_equals_the_scalar_walk():
    """The acceptance over every node and along the walk (the head asked at visited nodes only, once a
    level and once for the bonus) over whole batches of device trees against follow_verified_tree row by
    row, with
    targets that agree with some child most of the time (deep walks) and budgets from 0 to 64."""
    for seed in range(200):
        gen = torch.Generator().manual_seed(seed)
        b, vocab = int(torch.randint(1, 6, (), generator=gen)), 5
        logits = torch.randn(b, 6, vocab, generator=gen) * 0.5  # flat: wide trees with many siblings
        budgets = torch.randint(0, 65, (b,), generator=gen).numpy()
        spec = TreeSpec(budgets, np.minimum(np.maximum(budgets, 1), vocab), np.full(b, 6))
        vals, ids = draft_candidates(logits, vocab)
        trees = build_tree_batch(vals, ids, torch.randint(0, vocab, (b,), generator=gen), spec)
        argmax = torch.randint(0, vocab, trees.tokens.shape, generator=gen)
        rows = torch.arange(b)
        asked = []

        def argmax_at(cur, asked=asked, argmax=argmax, rows=rows):
            asked.append(cur)
            return argmax[rows, cur]

        depth = int(trees.depths.max())
        walked = walk_paths(
            trees.tokens, children_table(trees.parents, trees.valid, trees.branching), argmax_at, depth
        )
        assert len(asked) == depth + 1  # one head call a level, one for the bonus
        padded = PaddedTrees(trees.tokens, trees.depths, trees.parents, trees.device_sizes())
        hidden = F.one_hot(argmax, vocab).float()  # [B, N, V]: through an identity head, argmax's logits
        heads = [
            tree_verdicts(hidden, torch.eye(vocab), None, padded, None, bound, trees.branching, walk)
            for walk in (False, True)
            for bound in (depth, trees.depth)  # the actual depth, or the bound a bucket knows
        ]
        for path, emitted, lengths in (walked, *heads):
            for i in range(b):
                nodes, tokens = follow_verified_tree(tree_row(trees, i), argmax[i].tolist().__getitem__)
                m = int(lengths[i])
                assert (path[i, :m].tolist(), emitted[i, :m].tolist()) == (nodes, tokens)
