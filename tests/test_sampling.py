"""Tree rejection sampling (sgl_kernel contract) and the target distribution (HF warper semantics)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import ddtree.speculative.sampling as sampling_module
from ddtree.errors import DDTreeError
from ddtree.request.params import SamplingParams
from ddtree.sglang import (
    DraftTree,
    TreeRetrieve,
    compile_ddtree_retrieve,
    tree_speculative_sampling_target_only,
)
from ddtree.speculative.sampling import SamplingTensors, TargetLaw, filtered_probs, walk_tree
from ddtree.speculative.tree import PaddedTrees, TreeSpec, build_tree_batch, children_table, draft_candidates
from ddtree.speculative.verify import tree_verdicts
from tests.conftest import tree_from_parents
from tests.oracles import (
    filtered_probs_reference,
    sample_from_probs,
    sample_tree,
    target_probs_from_logits,
    tree_sampling_reference,
)
from tests.oracles import inverse_cdf as oracle_inverse_cdf


def make_tree(parents: list[int], tokens: list[int]) -> tuple[DraftTree, TreeRetrieve]:
    """Tree whose siblings are tried in node-index order."""
    n = len(parents)
    next_token, next_sibling = [-1] * n, [-1] * n
    last_child: dict[int, int] = {}
    for i in range(1, n):
        p = parents[i]
        if p in last_child:
            next_sibling[last_child[p]] = i
        else:
            next_token[p] = i
        last_child[p] = i
    tree = tree_from_parents(parents, tokens)
    return tree, TreeRetrieve(next_token=torch.tensor(next_token), next_sibling=torch.tensor(next_sibling))


def one_hot_rows(vocab: int, hot: list[int]) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(hot), vocab).float()  # [N, V]


def run_kernel(
    trees: list[tuple[DraftTree, TreeRetrieve]],
    target_probs: torch.Tensor,  # [bs, N, V]
    coins: torch.Tensor,  # [bs, N]
    final_coins: torch.Tensor,  # [bs]
    steps: int,
    draft_probs: torch.Tensor | None = None,
    **thresholds: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Call the kernel on a batch of equal-size trees with SGLang's flat slots (row * N + node)."""
    bs, n, _ = target_probs.shape
    predicts = torch.full((bs * n,), -7, dtype=torch.int32)
    accept_index = torch.full((bs, steps), -1, dtype=torch.int32)
    accept_token_num = torch.full((bs,), -7, dtype=torch.int32)
    draft_probs = torch.zeros_like(target_probs) if draft_probs is None else draft_probs
    tree_speculative_sampling_target_only(
        predicts,
        accept_index,
        accept_token_num,
        candidates=torch.stack([t.tokens for t, _ in trees]),
        retrive_index=torch.arange(bs * n).view(bs, n),
        retrive_next_token=torch.stack([r.next_token for _, r in trees]),
        retrive_next_sibling=torch.stack([r.next_sibling for _, r in trees]),
        uniform_samples=coins,
        uniform_samples_for_final_sampling=final_coins,
        target_probs=target_probs,
        draft_probs=draft_probs,
        **thresholds,
    )
    return predicts, accept_index, accept_token_num, draft_probs


# root -> 1 (tok 2) -> {3 (tok 4), 4 (tok 1)}; root -> 2 (tok 3)
PARENTS, TOKENS = [-1, 0, 0, 1, 1], [0, 2, 3, 4, 1]


def test_one_hot_targets_follow_the_drafted_path_whatever_the_coins():
    tree, retrieve = make_tree(PARENTS, TOKENS)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        coins, final = torch.rand(5, generator=gen), torch.rand((), generator=gen)
        # Root wants 3 (second child, a leaf), which then wants 5.
        assert sample_tree(tree, retrieve, one_hot_rows(6, [3, 0, 5, 0, 0]), coins, final) == ([0, 2], [3, 5])
        # Root wants 2, node 1 wants 1 (its second child, at the depth limit), which wants 0.
        assert sample_tree(tree, retrieve, one_hot_rows(6, [2, 1, 0, 0, 0]), coins, final) == (
            [0, 1, 4],
            [2, 1, 0],
        )
        # Root wants 5: nothing drafted, the bonus is 5.
        assert sample_tree(tree, retrieve, one_hot_rows(6, [5, 0, 0, 0, 0]), coins, final) == ([0], [5])


def test_root_only_tree_samples_the_bonus_from_the_root_row():
    tree, retrieve = make_tree([-1], [9])
    probs = torch.tensor([[0.0, 0.25, 0.75]])
    assert sample_tree(tree, retrieve, probs, torch.zeros(1), 0.5) == ([0], [2])


def test_root_only_tree_sampling_is_plain_sampling():
    """sample_tree draws a root-only tree (ar) with sample_from_probs: the kernel would agree."""
    gen = torch.Generator().manual_seed(3)
    tree, retrieve = make_tree([-1], [9])
    for _ in range(200):
        probs = torch.softmax(torch.randn(1, 50, generator=gen) * 3, dim=-1)
        probs[0, torch.randint(50, (10,), generator=gen)] = 0.0
        coin = torch.rand((), generator=gen)
        predicts = torch.zeros(1, dtype=torch.int32)
        tree_speculative_sampling_target_only(
            predicts,
            torch.full((1, 1), -1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
            candidates=tree.tokens[None],
            retrive_index=torch.zeros(1, 1, dtype=torch.int64),
            retrive_next_token=retrieve.next_token[None],
            retrive_next_sibling=retrieve.next_sibling[None],
            uniform_samples=torch.rand(1, 1, generator=gen),
            uniform_samples_for_final_sampling=coin.reshape(1),
            target_probs=probs[None],
            draft_probs=torch.zeros(1, 1, 50),
        )
        assert sample_tree(tree, retrieve, probs, torch.rand(1, generator=gen), coin)[1] == [int(predicts[0])]
        assert int(predicts[0]) == sample_from_probs(probs[0], coin)


def test_children_share_the_coin_of_their_parent_node():
    """The kernel draws once per node (uniform_samples[row, node]), not once per level or per sibling."""
    tree, retrieve = make_tree(PARENTS, TOKENS)
    probs = torch.full((5, 6), 1 / 6)
    probs[0] = torch.tensor([0.0, 0.0, 0.5, 0.5, 0.0, 0.0])
    # coin 0.7 at the root: token 2 (running 0.5) is rejected, token 3 (running 1.0) accepted. A per-level
    # coin (index 1 = 0.1) would accept token 2 instead.
    coins = torch.tensor([0.7, 0.1, 0.1, 0.1, 0.1])
    nodes, tokens = sample_tree(tree, retrieve, probs, coins, 0.0)
    assert nodes == [0, 2] and tokens[0] == 3
    # The coin of node 1 decides among node 1's children: running sums 1/6 (token 4) then 2/6 (token 1).
    probs[0] = one_hot_rows(6, [2])[0]
    for coin, expected in [(0.1, [0, 1, 3]), (0.3, [0, 1, 4]), (0.5, [0, 1])]:
        coins = torch.tensor([0.9, coin, 0.0, 0.0, 0.0])
        assert sample_tree(tree, retrieve, probs, coins, 0.0)[0] == expected


def test_acceptance_compares_coin_strictly_below_running_sum():
    tree, retrieve = make_tree([-1, 0, 0], [0, 1, 2])
    probs = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert sample_tree(tree, retrieve, probs, torch.tensor([0.4999, 0.0, 0.0]), 0.0)[0] == [0, 1]
    assert sample_tree(tree, retrieve, probs, torch.tensor([0.5, 0.0, 0.0]), 0.0)[0] == [0, 2]
    # The example: children [1, 2, 3] with target probabilities [0.25, 0, 0.75] and coin 0.25.
    tree, retrieve = make_tree([-1, 0, 0, 0], [0, 1, 2, 3])
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]] + [[1.0, 0.0, 0.0, 0.0]] * 3)
    nodes, tokens = sample_tree(tree, retrieve, probs, torch.tensor([0.25, 0.0, 0.0, 0.0]), 0.0)
    assert nodes == [0, 3] and tokens[0] == 3


def test_coins_on_a_uniform_grid_accept_each_child_exactly_its_probability():
    """Coins k / 16 for k in [0, 16) are uniform on [0, 1); the strict test accepts child c for exactly
    p(c) * 16 of them (``coin <= running sum`` would move one coin per boundary to the earlier child)."""
    tree, retrieve = make_tree([-1, 0, 0, 0, 0], [0, 1, 2, 3, 4])
    root = torch.tensor([0.0, 0.25, 0.0, 0.375, 0.375])
    probs = torch.stack([root] + [one_hot_rows(5, [0])[0]] * 4)  # [N, V]
    counts = [0] * 5
    for k in range(16):
        nodes, tokens = sample_tree(tree, retrieve, probs, torch.tensor([k / 16, 0, 0, 0, 0]), 0.0)
        counts[tokens[0]] += 1
    assert counts == (root * 16).int().tolist()


# SGLang's test vectors (sgl-kernel test_speculative_sampling.py): two rows of 6 nodes, vocab 20; target rows
# are one-hot up to float32 (logit 10 vs 1 at temperature 0.01), so any coins give the same result.
SGLANG_ROWS = dict(
    candidates=[[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]],
    retrive_index=[[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]],
    retrive_next_token=[[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]],
    retrive_next_sibling=[[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]],
)
SGLANG_EXPECTED = {  # (predicts, accept_index, accept_token_num) by (threshold_single, threshold_acc)
    (1, 1): ([3, -1, -1, 4, 5, 18, 11, -1, -1, -1, 12, 18], [[0, 3, 4, 5], [6, 10, 11, -1]], [3, 2]),
    (0, 0): ([1, 2, 18, -1, -1, -1, 11, -1, -1, -1, 12, 18], [[0, 1, 2, -1], [6, 10, 11, -1]], [2, 2]),
}


@pytest.mark.parametrize("threshold_single, threshold_acc", [(1, 1), (0, 0)])
def test_sglang_vectors_for_default_and_zero_thresholds(threshold_single, threshold_acc):
    """sgl_kernel's own test vectors: (1, 1) walks the one-hot targets' path; (0, 0) takes every first
    child, massless ones too (the kernel accepts on p >= threshold_single alone), as its test expects."""
    logits = torch.full((2, 6, 20), 1.0)
    for row, node, token in [(0, 0, 3), (0, 3, 4), (0, 4, 5), (1, 0, 11), (1, 4, 12)]:
        logits[row, node, token] = 10
    logits[..., 18] = torch.where(logits.amax(-1) < 10, 10.0, logits[..., 18])  # rows with no hot token
    target_probs = torch.softmax(logits / 0.01, dim=-1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(10):
        predicts = torch.full((12,), -1, dtype=torch.int32)
        accept_index = torch.full((2, 4), -1, dtype=torch.int32)
        accept_token_num = torch.zeros(2, dtype=torch.int32)
        tree_speculative_sampling_target_only(
            predicts,
            accept_index,
            accept_token_num,
            **{name: torch.tensor(rows) for name, rows in SGLANG_ROWS.items()},
            uniform_samples=torch.rand(2, 6, generator=gen),
            uniform_samples_for_final_sampling=torch.rand(2, generator=gen),
            target_probs=target_probs,
            draft_probs=torch.zeros_like(target_probs),
            threshold_single=threshold_single,
            threshold_acc=threshold_acc,
        )
        expected = SGLANG_EXPECTED[threshold_single, threshold_acc]
        assert (predicts.tolist(), accept_index.tolist(), accept_token_num.tolist()) == expected


@pytest.mark.parametrize(
    "candidate_tokens, root_probs, coin, threshold_single, expected_token, expected_accepted",
    [
        ([2], [0.0, 1.0, 0.0], 0.0, 0.0, 2, 1),  # zero threshold: p >= 0 takes even a massless child
        ([2], [0.0, 1.0, 0.0], 0.0, 1.0, 1, 0),  # zero mass, default threshold
        ([1, 2, 3], [0.0, 0.25, 0.0, 0.75], 0.25, 1.0, 3, 1),  # a coin on a boundary goes to the next child
        ([1], [0.0, 0.25, 0.75], 0.0, 1.0, 1, 1),  # coin 0 accepts a first child with mass
        ([1], [0.0, 1.0], 1.0 - 2**-24, 1.0, 1, 1),  # the largest float32 coin below 1
    ],
)
def test_sglang_cdf_boundary_vectors(
    candidate_tokens, root_probs, coin, threshold_single, expected_token, expected_accepted
):
    tree, retrieve = make_tree([-1] + [0] * len(candidate_tokens), [0, *candidate_tokens])
    n = len(candidate_tokens) + 1
    probs = torch.zeros(1, n, len(root_probs))
    probs[0, 0] = torch.tensor(root_probs)
    probs[0, 1:, 0] = 1.0
    coins = torch.zeros(1, n)
    coins[0, 0] = coin
    predicts, _, num, _ = run_kernel(
        [(tree, retrieve)], probs, coins, torch.zeros(1), 2, threshold_single=threshold_single
    )
    assert predicts[0].item() == expected_token and num.tolist() == [expected_accepted]


def test_default_thresholds_reject_what_lowered_thresholds_accept():
    tree, retrieve = make_tree([-1, 0], [0, 2])
    probs = torch.tensor([[0.59, 0.0, 0.01, 0.4], [1.0, 0.0, 0.0, 0.0]])
    coins, final = torch.tensor([[0.99, 0.0]]), torch.tensor([0.0])

    def accepted(**thresholds: float) -> int:
        return int(run_kernel([(tree, retrieve)], probs[None], coins, final, 2, **thresholds)[2][0])

    assert accepted() == 0
    assert accepted(threshold_single=1e-6) == 1  # any positive-mass child passes
    assert accepted(threshold_single=0.02) == 0
    assert accepted(threshold_acc=0.01) == 1  # 0.99 < 0.01 / 0.01
    assert accepted(threshold_acc=0.0102) == 0
    assert accepted(threshold_single=0.0) == 1  # 0 is in SGLang's domain: any positive-mass child passes
    assert accepted(threshold_acc=0.0) == 1  # floored at 1e-9, as the kernel's launcher does


def test_zero_mass_candidates_are_accepted_only_by_a_zero_single_threshold():
    """With coin 0 a massless first child is refused by the lossless rule and by threshold_acc 0; only
    threshold_single 0 takes it (sgl_kernel accepts on p >= threshold_single alone)."""
    tree, retrieve = make_tree([-1, 0, 0], [0, 1, 2])
    probs = torch.tensor([[0.3, 0.0, 0.7], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    for thresholds, node, token in [
        ({}, 2, 2),
        ({"threshold_acc": 0.0}, 2, 2),
        ({"threshold_single": 0.0}, 1, 1),
    ]:
        coins = torch.tensor([[0.0, 0.0, 0.0]])
        predicts, accept_index, num, _ = run_kernel(
            [(tree, retrieve)], probs[None], coins, torch.tensor([0.0]), 2, **thresholds
        )
        assert accept_index.tolist() == [[0, node]] and num.tolist() == [1]
        assert predicts[0].tolist() == token


def test_rejection_bonus_draws_from_the_residual_without_rejected_tokens():
    tree, retrieve = make_tree([-1, 0, 0], [0, 0, 1])
    probs = torch.tensor([[0.3, 0.3, 0.4, 0.0], [1.0, 0, 0, 0], [1.0, 0, 0, 0]])
    # coin 0.9 rejects both children; final coin 0 would give token 0 from the plain target row.
    predicts, accept_index, num, draft_probs = run_kernel(
        [(tree, retrieve)], probs[None], torch.tensor([[0.9, 0.0, 0.0]]), torch.tensor([0.0]), 2
    )
    assert num.tolist() == [0] and accept_index.tolist() == [[0, -1]]
    assert predicts[0].item() == 2
    assert draft_probs[0, 0].tolist() == pytest.approx([0.3, 0.3, 0.0, 0.0])  # the rejected mass
    assert draft_probs[0, 1:].abs().sum() == 0


def test_depth_limit_bonus_ignores_draft_probs_but_earlier_stop_subtracts_them():
    """sgl_kernel subtracts draft_probs unless all num_spec_step - 1 steps were accepted."""
    # root -> 1 (tok 1) -> 3 (tok 2); root -> 2 (tok 0, a leaf at depth 1)
    tree, retrieve = make_tree([-1, 0, 0, 1], [0, 1, 0, 2])
    probs = torch.tensor([[0.0, 1.0, 0, 0, 0], [0.5, 0.5, 0, 0, 0], [0.5, 0.5, 0, 0, 0], [1.0, 0, 0, 0, 0]])
    stale = torch.zeros(1, 4, 5)
    stale[0, 1] = probs[1]  # would leave no residual mass at node 1
    # Two steps: node 1 ends the walk at the depth limit although it has a child; plain target draw.
    predicts, accept_index, num, _ = run_kernel(
        [(tree, retrieve)], probs[None], torch.zeros(1, 4), torch.tensor([0.75]), 2, draft_probs=stale.clone()
    )
    assert accept_index.tolist() == [[0, 1]] and predicts[[0, 1]].tolist() == [1, 1]
    # Three steps and a stop at a leaf before the limit: draft_probs are subtracted.
    probs[0] = torch.tensor([1.0, 0, 0, 0, 0])  # root now accepts node 2 (tok 0)
    stale = torch.zeros(1, 4, 5)
    stale[0, 2] = torch.tensor([0.5, 0, 0, 0, 0])
    predicts, accept_index, num, _ = run_kernel(
        [(tree, retrieve)], probs[None], torch.zeros(1, 4), torch.tensor([0.0]), 3, draft_probs=stale
    )
    assert accept_index.tolist() == [[0, 2, -1]] and predicts[[0, 2]].tolist() == [0, 1]


def test_all_mass_rejected_falls_back_to_the_last_rejected_token():
    tree, retrieve = make_tree([-1, 0, 0], [0, 2, 1])
    probs = torch.tensor([[0.0, 0.25, 0.25, 0.0, 0.0], [1.0, 0, 0, 0, 0], [1.0, 0, 0, 0, 0]])  # row sums 0.5
    predicts, _, num, _ = run_kernel(
        [(tree, retrieve)], probs[None], torch.tensor([[0.9, 0.0, 0.0]]), torch.tensor([0.3]), 2
    )
    assert num.tolist() == [0] and predicts[0].item() == 1


def test_batched_rows_with_flat_slots_match_rows_run_separately():
    trees = [make_tree(PARENTS, TOKENS), make_tree([-1, 0, 1, 2, 0], [0, 1, 2, 3, 4])]
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        probs = torch.softmax(torch.randn(2, 5, 6, generator=gen) * 2, dim=-1)
        coins, final = torch.rand(2, 5, generator=gen), torch.rand(2, generator=gen)
        predicts, accept_index, num, draft = run_kernel(trees, probs, coins, final, 4)
        for b in range(2):
            p1, a1, n1, d1 = run_kernel(
                trees[b : b + 1], probs[b : b + 1], coins[b : b + 1], final[b : b + 1], 4
            )
            assert num[b] == n1[0]
            k = int(n1[0]) + 1
            assert accept_index[b, :k].tolist() == [b * 5 + x for x in a1[0, :k].tolist()]
            assert predicts[accept_index[b, :k].long()].tolist() == p1[a1[0, :k].long()].tolist()
            assert torch.equal(draft[b], d1[0])


def test_sample_tree_returns_equal_length_nodes_and_tokens():
    tree, retrieve = make_tree(PARENTS, TOKENS)
    gen = torch.Generator().manual_seed(2)
    for _ in range(20):
        probs = torch.softmax(torch.randn(5, 6, generator=gen), dim=-1)
        nodes, tokens = sample_tree(tree, retrieve, probs, torch.rand(5, generator=gen), torch.rand(()))
        assert len(nodes) == len(tokens) and nodes[0] == 0
        assert [TOKENS[x] for x in nodes[1:]] == tokens[:-1]
        assert all(PARENTS[c] == p for p, c in zip(nodes, nodes[1:], strict=False))


def test_thresholds_outside_unit_interval_are_rejected():
    tree, retrieve = make_tree([-1, 0], [0, 1])
    args = ([(tree, retrieve)], torch.full((1, 2, 2), 0.5), torch.zeros(1, 2), torch.zeros(1), 2)
    for bad in [{"threshold_acc": -0.1}, {"threshold_single": float("nan")}, {"threshold_acc": 1.5}]:
        with pytest.raises(DDTreeError, match=r"must be a number in \[0, 1\]"):
            run_kernel(*args, **bad)


def test_the_batched_inverse_cdf_is_the_scalar_scan_on_zeros_ties_and_coins_near_one():
    """``sampling.inverse_cdf`` (a binary search over the running sum) against the oracle's scalar scan:
    rows with zeros, negative entries, few distinct weights (running sums that equal coin x total
    exactly), all-zero rows and coins at 0 and just below 1, in [R, V] and [B, M, V] batches."""
    for seed in range(400):
        gen = torch.Generator().manual_seed(seed)
        rows, vocab = (int(torch.randint(1, hi, (1,), generator=gen)) for hi in (6, 12))
        w = torch.rand(rows, vocab, generator=gen) * (torch.rand(rows, vocab, generator=gen) < 0.6)
        if seed % 3 == 0:
            w = (w * 4).round() / 4  # ties: quarters, so running sums hit coin x total exactly
        if seed % 7 == 0:
            w = w - 0.3  # non-positive entries count as 0
        if seed % 11 == 0:
            w[0] = 0.0  # a row with no mass: -1
        coins = torch.rand(rows, generator=gen)
        coins[0] = [0.0, 0.5, 1 - 2**-24][seed % 3]
        assert torch.equal(sampling_module.inverse_cdf(w, coins), oracle_inverse_cdf(w, coins)), seed
        batched = sampling_module.inverse_cdf(w.view(1, rows, vocab), coins.view(1, rows))[0]
        assert torch.equal(batched, oracle_inverse_cdf(w, coins)), seed


def test_sample_from_probs_inverse_cdf_rule():
    assert sample_from_probs(torch.tensor([0.0, 0.0, 0.4, 0.6]), 0.0) == 2  # first positive token
    assert sample_from_probs(torch.tensor([0.25, 0.25, 0.5]), 0.5) == 2  # running sum must exceed u
    assert sample_from_probs(torch.tensor([0.25, 0.25, 0.5]), 0.4999) == 1
    assert sample_from_probs(torch.tensor([1.0, 3.0]), torch.tensor(0.3)) == 1  # unnormalised is fine
    # u == total (a coin rounded up to 1): the last token with positive mass, not the last index.
    assert sample_from_probs(torch.tensor([0.2, 0.3, 0.5, 0.0]), 1.0) == 2
    with pytest.raises(ValueError):
        sample_from_probs(torch.zeros(3), 0.5)


# --- target distribution -------------------------------------------------------------------------------


def hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scores = TemperatureLogitsWarper(params.temperature)(None, logits.float())
    if params.top_k > 0:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    if params.min_p > 0.0:
        scores = MinPLogitsWarper(params.min_p)(None, scores)
    return scores.softmax(dim=-1)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=0.9, min_p=0.1),
        SamplingParams(temperature=0.6, top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=2.0, top_k=3, top_p=0.5),
    ],
)
def test_target_probs_match_hf_warpers_in_order(params: SamplingParams):
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 3
    ours = target_probs_from_logits(logits, params)
    theirs = hf_probs(logits, params)
    assert ours.dtype == torch.float32
    assert torch.equal(ours > 0, theirs > 0)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)


def test_target_probs_keep_every_token_tied_with_the_kth_logit():
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0])
    for k in (1, 2):
        probs = target_probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=k))
        assert probs.tolist() == pytest.approx([0.0, 0.5, 0.5, 0.0])
    assert (target_probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=3)) > 0).tolist() == [
        False,
        True,
        True,
        True,
    ]


def test_target_probs_always_keep_at_least_the_top_token():
    logits = torch.randn(3, 2, 50, generator=torch.Generator().manual_seed(4))
    top = torch.nn.functional.one_hot(logits.argmax(-1), 50).float()
    for params in [
        SamplingParams(temperature=1.0, top_p=1e-9),
        SamplingParams(temperature=1.0, min_p=1.0),
        SamplingParams(temperature=0.5, top_k=1, top_p=1e-9, min_p=1.0),
    ]:
        assert torch.equal(target_probs_from_logits(logits, params), top)


def test_the_filter_graphs_every_filter_on_changes_no_row_whose_filter_is_off():
    """A bucket's law (``TargetLaw.of(..., every_filter=GRAPH_TOP_K)``: every filter on for every row, so one
    graph serves any mix) gives each row of a mixed batch the distribution its own filters alone give it:
    top-k 0, top-p 1 and min-p 0 pass a row unchanged; a row that uses a filter is filtered as alone. At
    a real vocabulary, with ties."""
    gen = torch.Generator().manual_seed(5)
    vocab, hidden_size = 151936, 64
    weight = torch.randn(vocab, hidden_size, generator=gen) / 8
    weight[7] = weight[9]  # tokens 7 and 9 tie everywhere
    hidden = torch.randn(6, 3, hidden_size, generator=gen)  # [B, N, H]
    params = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=50),
        SamplingParams(temperature=1.3, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=0.6, top_k=20, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=2.0, top_k=sampling_module.GRAPH_TOP_K),
    ]
    law = TargetLaw.of(params, torch.zeros(6, 3), every_filter=sampling_module.GRAPH_TOP_K)
    logits = hidden @ weight.T  # [B, N, V]
    got = filtered_probs(logits, law.sampling)
    for row, p in enumerate(params):
        alone = filtered_probs(logits[row : row + 1], SamplingTensors.from_params([p]))[0]  # [N, V]
        assert torch.equal(got[row] > 0, alone > 0), p
        torch.testing.assert_close(got[row], alone, rtol=0, atol=1e-7)
    assert (got[0] > 0).all() and (got[1] > 0).sum(dim=-1).tolist() == [50, 50, 50]


def test_target_probs_refuse_greedy():
    with pytest.raises(ValueError):
        target_probs_from_logits(torch.zeros(4), SamplingParams(temperature=0.0))


# --- statistics ------------------------------------------------------------------------------------------


def sampled_pairs(threshold_acc: float, samples: int = 20_000) -> tuple[torch.Tensor, torch.Tensor]:
    """First two emitted tokens of many independent verifications of one tree, and their true law.

    The world: Q0 [V] is the target after the prompt, Q[x] [V] the target after token x. The tree drafts
    a, b (Q0's top two) and c after a; its rows are Q0, Q[a], Q[b], and anything for c. When a round emits
    one token x, the second is drawn from Q[x] directly.
    """
    vocab = 5
    gen = torch.Generator().manual_seed(5)
    q0 = torch.softmax(torch.randn(vocab, generator=gen) * 0.7, dim=-1)  # [V]
    q = torch.softmax(torch.randn(vocab, vocab, generator=gen) * 0.7, dim=-1)  # [V, V]
    a, b = q0.topk(2).indices.tolist()
    c = int(q[a].argmax())
    tree = make_tree([-1, 0, 0, 1], [0, a, b, c])
    rows = torch.stack([q0, q[a], q[b], torch.full((vocab,), 1 / vocab)])  # [N, V]
    predicts, accept_index, num, _ = run_kernel(
        [tree] * samples,
        rows.expand(samples, -1, -1).contiguous(),
        torch.rand(samples, 4, generator=gen),
        torch.rand(samples, generator=gen),
        3,
        threshold_acc=threshold_acc,
    )
    first = predicts[accept_index[:, 0].long()].long()  # [samples]
    follow = torch.multinomial(q[first], 1, generator=gen)[:, 0]  # [samples]
    second = torch.where(num >= 1, predicts[accept_index[:, 1].long().clamp_min(0)].long(), follow)
    observed = torch.bincount(first * vocab + second, minlength=vocab * vocab).double()  # [V * V]
    expected = (q0[:, None] * q).flatten().double() * samples  # [V * V]
    return observed, expected


def chi2_p(observed: torch.Tensor, expected: torch.Tensor) -> float:
    return float(
        chisquare(observed.numpy(), expected.numpy() * observed.sum().item() / expected.sum().item()).pvalue
    )


def test_emitted_tokens_follow_the_target_distribution():
    observed, expected = sampled_pairs(threshold_acc=1.0)
    assert chi2_p(observed.view(5, 5).sum(1), expected.view(5, 5).sum(1)) > 1e-3  # first token
    assert chi2_p(observed, expected) > 1e-3  # first two tokens


def test_lossy_threshold_fails_the_same_distribution_check():
    """Accepting when coin < 1.2 * running sum biases the output; the check must notice."""
    observed, expected = sampled_pairs(threshold_acc=1 / 1.2)
    assert chi2_p(observed.view(5, 5).sum(1), expected.view(5, 5).sum(1)) < 1e-6
    assert chi2_p(observed, expected) < 1e-6


def _random_sampling_case(seed: int):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    b, depth, vocab = rng.randint(1, 5), rng.randint(1, 5), rng.choice([3, 6, 20])
    logits = torch.randn(b, depth, vocab, generator=gen) * rng.choice([0.5, 2, 5])
    budgets = np.array([rng.choice([0, 1, 3, 8, 20]) for _ in range(b)])
    topks = np.array([min(rng.choice([1, 2, vocab]), max(x, 1), vocab) for x in budgets])
    spec = TreeSpec(budgets, topks, np.array([rng.randint(1, depth) for _ in range(b)]))
    vals, ids = draft_candidates(logits, int(topks[budgets > 0].max(initial=1)))
    trees = build_tree_batch(vals, ids, torch.randint(0, vocab, (b,), generator=gen), spec)
    n = trees.tokens.shape[1]
    probs = torch.softmax(torch.randn(b, n, vocab, generator=gen) * rng.choice([0.5, 3, 10]), -1)
    if rng.random() < 0.3:  # zero-mass candidates
        probs = probs.masked_fill(torch.rand(b, n, vocab, generator=gen) < 0.5, 0)
    thresholds = {
        "threshold_single": rng.choice([1.0, 1.0, 0.5, 0.0]),
        "threshold_acc": rng.choice([1.0, 1.0, 0.7, 0.0]),
    }
    return trees, probs, torch.rand(b, n, generator=gen), torch.rand(b, generator=gen), thresholds


def test_vectorised_tree_sampling_equals_the_scalar_walk():
    """The contract function, the engine's acceptance under SGLang's rule (``tree_verdicts``: the head over
    every node or along the walk, with the trees' actual depth or the drafted block's bound) and the
    scalar oracle agree exactly on predicts, accept_index, accept_token_num and draft_probs over 400
    random batches of device trees."""
    for seed in range(400):
        trees, probs, coins, final, thresholds = _random_sampling_case(seed)
        b, n = trees.tokens.shape
        vocab = probs.shape[-1]
        # What the engine's LM head gives through an identity head: logits whose law is these probs
        logits = torch.where(probs > 0, probs.log(), -1e4)
        law = TargetLaw.of([SamplingParams(temperature=1.0)] * b, coins, final, tuple(thresholds.values()))
        probs = filtered_probs(logits, law.sampling)  # [B, N, V]
        steps = trees.depth + 1
        next_token, next_sibling = torch.full((b, n), -1), torch.full((b, n), -1)
        for i in range(b):
            m = int(trees.sizes[i])
            if m > 1:
                retrieve = compile_ddtree_retrieve(trees.parents[i, :m], trees.logw[i, :m])
                next_token[i, :m], next_sibling[i, :m] = retrieve.next_token, retrieve.next_sibling
        outputs = []
        for kernel in (tree_sampling_reference, tree_speculative_sampling_target_only):
            out = (
                torch.zeros(b * n, dtype=torch.int32),
                torch.full((b, steps), -1, dtype=torch.int32),
                torch.zeros(b, dtype=torch.int32),
                torch.zeros_like(probs),
            )
            kernel(out[0], out[1], out[2], trees.tokens, torch.arange(b * n).view(b, n), next_token,
                   next_sibling, coins, final, probs, out[3], **thresholds)  # fmt: skip
            outputs.append(out)
        (p0, a0, n0, d0), (p1, a1, n1, d1) = outputs
        assert torch.equal(a0, a1) and torch.equal(n0, n1) and torch.equal(d0, d1), seed
        padded = PaddedTrees(trees.tokens, trees.depths, trees.parents, trees.device_sizes())
        engine = [
            tree_verdicts(logits, torch.eye(vocab), None, padded, law, depth, trees.branching, walk)
            for walk in (False, True)
            for depth in (trees.read_depth().depth, trees.depth)
        ]
        for path, tokens, lengths in engine:
            for i in range(b):
                m = int(n0[i]) + 1
                slots = a0[i, :m].long()
                assert torch.equal(p0[slots], p1[slots]), seed
                assert int(lengths[i]) == m
                assert (path[i, :m] + i * n).tolist() == slots.tolist()
                assert tokens[i, :m].tolist() == p0[slots].tolist()


def test_kernel_accepts_sglangs_deterministic_argument():
    """Callers written for sgl_kernel's signature pass ``deterministic``; the output does not depend on it."""
    tree, retrieve = make_tree(PARENTS, TOKENS)
    probs = torch.softmax(torch.randn(1, 5, 6, generator=torch.Generator().manual_seed(3)), dim=-1)
    coins, final = torch.rand(1, 5), torch.rand(1)
    results = []
    for deterministic in (True, False):
        predicts = torch.zeros(5, dtype=torch.int32)
        accept_index = torch.full((1, 3), -1, dtype=torch.int32)
        num = torch.zeros(1, dtype=torch.int32)
        tree_speculative_sampling_target_only(
            predicts, accept_index, num, tree.tokens[None], torch.arange(5)[None],
            retrieve.next_token[None], retrieve.next_sibling[None], coins, final, probs,
            torch.zeros_like(probs), deterministic=deterministic,
        )  # fmt: skip
        results.append((predicts.tolist(), accept_index.tolist(), num.tolist()))
    assert results[0] == results[1]


def _logits_of_kind(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if kind == "ties":  # few distinct logits
        return torch.randint(0, 4, shape, generator=gen).float()
    if kind == "flat":
        return torch.zeros(shape)
    scale = {"random": 1.0, "peaked": 10.0, "bf16": 2.0}[kind]
    x = torch.randn(shape, generator=gen) * scale
    return x.bfloat16().float() if kind == "bf16" else x


@pytest.mark.parametrize("chunk", [None, 3000])
@pytest.mark.parametrize("vocab", [7, 1000, 4096])
def test_sort_free_filters_equal_the_full_sort(vocab, chunk, monkeypatch):
    """Top-k, top-p and min-p without sorting the vocabulary equal the full-sort implementation (max abs
    difference <= 1e-6) on random, tied (few distinct logits), flat, peaked and bf16-rounded logits; also
    with the nucleus computed a few rows at a time (``chunk`` entries per call)."""
    if chunk is not None:
        monkeypatch.setattr(sampling_module, "CPU_NUCLEUS_CHUNK_ENTRIES", chunk)
    for seed in range(60):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        b, n = rng.randint(1, 4), rng.randint(1, 5)
        logits = _logits_of_kind(rng.choice(["random", "ties", "flat", "peaked", "bf16"]), (b, n, vocab), gen)
        params = [
            SamplingParams(
                temperature=rng.choice([0.5, 1.0, 1.3]),
                top_k=rng.choice([0, 0, 1, 5, 50]),
                top_p=rng.choice([1.0, 0.9, 0.5, 0.99, 1e-3]),
                min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
            )
            for _ in range(b)
        ]
        got = filtered_probs(logits, SamplingTensors.from_params(params))
        want = filtered_probs_reference(logits, SamplingTensors.from_params(params))
        assert (got - want).abs().max() <= 1e-6, (seed, params)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.8, top_k=20),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.95, min_p=0.02),
    ],
)
def test_batched_tree_sampling_emits_the_filtered_target_at_a_vocabulary_of_a_thousand(params):
    """The first and second emitted tokens of 20,000 independent walks over one tree (V = 1,000, the target's
    filters on) follow the filtered target: a G-test on the first token, and on the second given the most
    frequent first token (counts of tokens under 1% of the mass pooled)."""
    from scipy.stats import power_divergence

    vocab, rows = 1000, 20000
    gen = torch.Generator().manual_seed(7)
    draft = torch.randn(1, 3, vocab, generator=gen) * 3
    vals, ids = draft_candidates(draft, 8)
    one = build_tree_batch(
        vals, ids, torch.tensor([0]), TreeSpec(np.array([8]), np.array([8]), np.array([3]))
    )
    n = one.tokens.shape[1]
    logits = torch.randn(1, n, vocab, generator=gen) * 3
    logits[0, :, one.tokens[0, 1:]] += 7.0  # drafted tokens likely: walks go deep
    probs = filtered_probs(logits, SamplingTensors.from_params([params]))  # [1, N, V]
    children = children_table(one.parents, one.valid, one.branching).expand(rows, -1, -1)  # [R, N, C]
    coins, finals = torch.rand(rows, n, generator=gen), torch.rand(rows, generator=gen)
    _, tokens, lengths = walk_tree(children, one.tokens.expand(rows, -1), probs[0].__getitem__, coins, finals,
                                   one.depth + 1, 1.0, 1.0)  # fmt: skip

    def g_test(observed: torch.Tensor, law: torch.Tensor) -> float:
        law = law.double() / law.double().sum()
        big = law >= 0.01
        obs = torch.cat((observed[big], observed[~big].sum()[None])).double()
        exp = torch.cat((law[big], law[~big].sum()[None])) * observed.sum()
        keep = exp > 0
        assert obs[~keep].sum() == 0  # nothing emitted where the law has no mass
        return power_divergence(obs[keep], exp[keep], lambda_="log-likelihood").pvalue

    first = tokens[:, 0]
    assert g_test(torch.bincount(first, minlength=vocab), probs[0, 0]) > 1e-3
    top = int(torch.bincount(first, minlength=vocab).argmax())
    child = [j for j in range(1, n) if int(one.parents[0, j]) == 0 and int(one.tokens[0, j]) == top]
    if child:  # the second token after an accepted draft follows that node's row
        second = tokens[(first == top) & (lengths > 1), 1]
        assert g_test(torch.bincount(second, minlength=vocab), probs[0, child[0]]) > 1e-3
