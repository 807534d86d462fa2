"""``ddtree.sglang``: drop-ins for sgl_kernel's tree verification ops, held to SGLang's own unit-test vectors
(sgl-kernel/tests/speculative: ``test_speculative_sampling.py``, ``test_eagle_utils.py``) and to the scalar
oracles in ``tests/oracles.py`` over random trees."""

from __future__ import annotations

import inspect

import torch

from ddtree.sglang import (
    DraftTree,
    compile_ddtree_retrieve,
    follow_verified_tree,
    tree_speculative_sampling_target_only,
    verify_tree_greedy,
)
from tests import oracles

# SGLang's fixture, two rows of six nodes. Row 0: 0 -> {1 -> 2, 3 -> 4 -> 5}; row 1: 0 -> 4 -> {5, 1 -> 2}.
CANDIDATES = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]])
RETRIVE_INDEX = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]])
NEXT_TOKEN = torch.tensor([[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]])
NEXT_SIBLING = torch.tensor([[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]])
GREEDY = ([3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18], [[0, 3, 4, 5], [6, 10, 11, -1]], [3, 2])


def target_logits() -> torch.Tensor:
    """[2, 6, 20]: one logit of 10 per node (token 18 where the fixture names none), the rest 1."""
    logits = torch.ones(2, 6, 20)
    for row, node, token in [(0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)]:
        logits[row, node, token] = 10
    logits[..., 18] = torch.where(logits.amax(dim=-1) < 10, 10.0, logits[..., 18])
    return logits


def outputs(steps: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.full((12,), -1, dtype=torch.int32),
        torch.full((2, steps), -1, dtype=torch.int32),
        torch.zeros(2, dtype=torch.int32),
    )


def test_the_signatures_are_sgl_kernels():
    """Callers written for sgl_kernel pass these names, positionally or by keyword."""
    sampling = list(inspect.signature(tree_speculative_sampling_target_only).parameters)
    assert sampling == [
        "predicts", "accept_index", "accept_token_num", "candidates", "retrive_index", "retrive_next_token",
        "retrive_next_sibling", "uniform_samples", "uniform_samples_for_final_sampling", "target_probs",
        "draft_probs", "threshold_single", "threshold_acc", "deterministic",
    ]  # fmt: skip
    greedy = list(inspect.signature(verify_tree_greedy).parameters)
    assert greedy == sampling[:7] + ["target_predict"]


def test_verify_tree_greedy_reproduces_sglangs_vector():
    predicts, accept_index, accept_num = outputs()
    verify_tree_greedy(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=CANDIDATES,
        retrive_index=RETRIVE_INDEX, retrive_next_token=NEXT_TOKEN, retrive_next_sibling=NEXT_SIBLING,
        target_predict=target_logits().argmax(dim=-1),
    )  # fmt: skip
    assert (predicts.tolist(), accept_index.tolist(), accept_num.tolist()) == GREEDY


def random_tree(gen: torch.Generator, n: int, vocab: int) -> DraftTree:
    """A random tree of n nodes in pop order with distinct sibling tokens and descending sibling logw."""
    parents, tokens, depths = [-1], [int(torch.randint(vocab, (), generator=gen))], [0]
    used: dict[int, set[int]] = {0: set()}
    for i in range(1, n):
        open_ = [x for x in range(i) if len(used[x]) < vocab]  # nodes with a token left for a child
        parent = open_[int(torch.randint(len(open_), (), generator=gen))]
        free = [t for t in range(vocab) if t not in used[parent]]
        token = free[int(torch.randint(len(free), (), generator=gen))]
        used[parent].add(token)
        used[i] = set()
        parents.append(parent)
        tokens.append(token)
        depths.append(depths[parent] + 1)
    logw = -torch.arange(n, dtype=torch.float32)  # pop order: siblings most probable first
    return DraftTree(torch.tensor(tokens), torch.tensor(depths), torch.tensor(parents), logw)


def test_verify_tree_greedy_equals_the_scalar_walk_over_random_batches():
    gen = torch.Generator().manual_seed(1)
    for _ in range(50):
        b, n, vocab = 3, int(torch.randint(1, 9, (), generator=gen)), 5
        trees = [random_tree(gen, n, vocab) for _ in range(b)]
        lists = [compile_ddtree_retrieve(t.parents, t.logw) for t in trees]
        predict = torch.randint(vocab, (b, n), generator=gen)
        steps = max(int(t.depths.max()) for t in trees) + 1
        predicts = torch.full((b * n,), -1, dtype=torch.int32)
        accept_index = torch.full((b, steps), -1, dtype=torch.int32)
        accept_num = torch.zeros(b, dtype=torch.int32)
        verify_tree_greedy(
            predicts, accept_index, accept_num, torch.stack([t.tokens for t in trees]),
            torch.arange(b * n).view(b, n), torch.stack([r.next_token for r in lists]),
            torch.stack([r.next_sibling for r in lists]), predict,
        )  # fmt: skip
        for i, tree in enumerate(trees):
            nodes, tokens = oracles.follow_verified_tree(tree, predict[i].tolist().__getitem__)
            assert accept_num[i] == len(nodes) - 1
            assert accept_index[i, : len(nodes)].tolist() == [i * n + x for x in nodes]
            assert predicts[[i * n + x for x in nodes]].tolist() == tokens
            assert follow_verified_tree(tree, predict[i].tolist().__getitem__) == (nodes, tokens)


def test_follow_verified_tree_asks_only_for_the_nodes_it_reaches():
    tree = random_tree(torch.Generator().manual_seed(2), 8, 4)
    asked: list[int] = []
    target = [int(t) for t in tree.tokens.roll(-1)]

    def token(i: int) -> int:
        asked.append(i)
        return target[i]

    nodes, _ = follow_verified_tree(tree, token)
    assert asked == nodes


def test_compile_ddtree_retrieve_orders_siblings_by_descending_logw():
    """Node 0 has children 1, 2, 3 (logw -2, -1, -1: ties keep node order), node 2 has child 4."""
    retrieve = compile_ddtree_retrieve(torch.tensor([-1, 0, 0, 0, 2]), torch.tensor([0.0, -2, -1, -1, -1.5]))
    assert retrieve.next_token.tolist() == [2, -1, 4, -1, -1]
    assert retrieve.next_sibling.tolist() == [-1, -1, 3, 1, -1]
