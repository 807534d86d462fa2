from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from ddtree.errors import DDTreeError
from ddtree.model.capture import node_ladder, pick
from ddtree.sglang import DraftTree, compile_ddtree_retrieve
from ddtree.speculative.tree import TreeShape, TreeSpec, build_tree_batch, draft_candidates, top_k_rows
from tests import oracles
from tests.oracles import best_first_tree, build_ddtree_tree, tree_row

CASES = [
    # (L, V, budget, topk)
    (1, 2, 1, None),
    (1, 5, 3, None),
    (1, 5, 30, 2),
    (2, 3, 4, None),
    (2, 4, 30, None),
    (3, 3, 7, 2),
    (3, 5, 12, None),
    (3, 6, 20, 3),
    (4, 2, 9, None),
    (4, 3, 25, None),
    (4, 4, 30, 2),
    (4, 6, 17, 1),
]


def _prefixes(tree: DraftTree) -> dict[tuple[int, ...], float]:
    """Token prefix (root excluded) of every non-root node -> its logw."""
    tokens, parents, logw = tree.tokens.tolist(), tree.parents.tolist(), tree.logw.tolist()
    out = {}
    for i in range(1, tree.num_nodes):
        prefix, j = [], i
        while j != 0:
            prefix.append(tokens[j])
            j = parents[j]
        out[tuple(reversed(prefix))] = logw[i]
    return out


def _brute_force(logits: torch.Tensor, budget: int, topk: int | None) -> dict[tuple[int, ...], float]:
    """Score every prefix over the top-K tokens per depth and keep the ``budget`` best."""
    depth_max, vocab = logits.shape
    k = min(budget if topk is None else topk, vocab)
    logp = torch.log_softmax(logits.double(), dim=-1)  # [L, V]
    allowed = [logp[d].topk(k).indices.tolist() for d in range(depth_max)]
    scored = {}
    for length in range(1, depth_max + 1):
        for prefix in itertools.product(*allowed[:length]):
            scored[prefix] = sum(logp[d, t].item() for d, t in enumerate(prefix))
    best = sorted(scored, key=scored.get, reverse=True)[:budget]
    return {p: scored[p] for p in best}


def _num_prefixes(depth_max: int, k: int) -> int:
    return sum(k**length for length in range(1, depth_max + 1))


def _check_structure(tree: DraftTree, root_token: int) -> None:
    tokens, depths, parents = tree.tokens.tolist(), tree.depths.tolist(), tree.parents.tolist()
    assert tokens[0] == root_token and depths[0] == 0 and parents[0] == -1
    assert tree.logw[0].item() == 0.0
    for t in (tree.tokens, tree.depths, tree.parents):
        assert t.dtype == torch.int64 and t.device.type == "cpu" and t.shape == (tree.num_nodes,)
    assert tree.logw.dtype == torch.float32 and tree.logw.shape == (tree.num_nodes,)
    siblings: set[tuple[int, int]] = set()  # (parent, token)
    for i in range(1, tree.num_nodes):
        p = parents[i]
        assert 0 <= p < i
        assert depths[i] == depths[p] + 1
        assert (p, tokens[i]) not in siblings, "two siblings share a token"
        siblings.add((p, tokens[i]))
        assert tree.logw[i] <= tree.logw[p]


@pytest.mark.parametrize("depth_max,vocab,budget,topk", CASES)
def test_tree_is_the_budget_most_probable_prefixes(depth_max, vocab, budget, topk):
    gen = torch.Generator().manual_seed(1000 * depth_max + 10 * vocab + budget)
    logits = torch.randn(depth_max, vocab, generator=gen) * 2.0
    tree = build_ddtree_tree(logits, budget, topk=topk, root_token=7)
    got, want = _prefixes(tree), _brute_force(logits, budget, topk)
    assert set(got) == set(want)
    keys = sorted(want)
    assert torch.allclose(
        torch.tensor([got[p] for p in keys]), torch.tensor([want[p] for p in keys]), atol=1e-5
    )


@pytest.mark.parametrize(
    "vocab,k,scale", [(32768, 32, 3.0), (32768, 1, 0.0), (151936, 64, 8.0), (8192, 5, 1.0)]
)
def test_grouped_top_k_equals_full_top_k(vocab, k, scale):
    """The strided-group shortcut returns exactly ``topk``'s values, and ids holding those values."""
    gen = torch.Generator().manual_seed(vocab + k)
    x = torch.randn(15, vocab, generator=gen) * scale  # scale 0: every entry ties
    x[3, 100:140] = 50.0  # many equal maxima in one row
    values, indices = top_k_rows(x, k)
    want = x.topk(k, dim=-1)
    assert torch.equal(values, want.values)
    assert torch.equal(x.gather(1, indices), values)
    assert all(len(set(row)) == k for row in indices.tolist())
    if scale > 0:  # without ties the ids are unique and must agree
        assert torch.equal(indices[torch.arange(15) != 3], want.indices[torch.arange(15) != 3])


@pytest.mark.parametrize("seed", [1, 3])
def test_tree_with_tied_draft_logits_has_distinct_siblings_and_the_best_scores(seed):
    """With ties the chosen prefixes are not unique, so the check is on what is: the scores of the
    ``budget`` best prefixes, and a valid tree (distinct siblings, logw = sum of per-depth log-probs).
    """
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, 3, (3, 12), generator=gen).float()  # 3 distinct values: many ties
    tree = build_ddtree_tree(logits, 40)
    _check_structure(tree, root_token=0)
    logp = torch.log_softmax(logits.double(), dim=-1)
    got = _prefixes(tree)
    for prefix, logw in got.items():
        assert abs(logw - sum(logp[d, t].item() for d, t in enumerate(prefix))) < 1e-5
    want = sorted(_brute_force(logits, 40, None).values(), reverse=True)
    assert torch.allclose(torch.tensor(sorted(got.values(), reverse=True)), torch.tensor(want), atol=1e-5)


def test_tree_over_a_large_vocabulary_is_the_budget_most_probable_prefixes():
    """Budget 256 over 32k tokens and 15 positions (the grouped top-k path) against an exact reference."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(15, 32768, generator=gen) * 4.0
    tree = build_ddtree_tree(logits, 256)
    logp = torch.log_softmax(logits, dim=-1).double()
    got = _prefixes(tree)
    assert len(got) == 256
    for prefix, logw in got.items():  # each prefix's logw is the sum of its per-depth log-probs
        assert abs(logw - sum(logp[d, t].item() for d, t in enumerate(prefix))) < 1e-4
    # Nothing left out beats the 256th: no child or next sibling of a chosen prefix scores higher.
    worst = min(got.values())
    ranked = logp.argsort(dim=-1, descending=True)[:, :257].tolist()
    for prefix in [(), *got]:
        d = len(prefix)
        if d < 15:
            child = next(t for t in ranked[d] if prefix + (t,) not in got)
            assert sum(logp[i, t].item() for i, t in enumerate((*prefix, child))) <= worst + 1e-6


@pytest.mark.parametrize("depth_max,vocab,budget,topk", CASES)
def test_tree_structure_invariants(depth_max, vocab, budget, topk):
    gen = torch.Generator().manual_seed(7 + depth_max * vocab + budget)
    logits = torch.randn(depth_max, vocab, generator=gen)
    tree = build_ddtree_tree(logits, budget, topk=topk, root_token=123)
    _check_structure(tree, root_token=123)
    k = min(budget if topk is None else topk, vocab)
    assert tree.num_nodes == min(budget, _num_prefixes(depth_max, k)) + 1


def test_budget_beyond_all_prefixes_returns_all_of_them():
    logits = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    tree = build_ddtree_tree(logits, budget=1000)
    all_prefixes = {p for n in range(1, 4) for p in itertools.product(range(3), repeat=n)}
    assert set(_prefixes(tree)) == all_prefixes
    assert tree.num_nodes == 3 + 9 + 27 + 1


def test_topk_larger_than_vocab_is_clamped():
    logits = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    tree = build_ddtree_tree(logits, budget=50, topk=10)
    assert tree.num_nodes == 3 + 9 + 1


def test_topk_one_gives_a_greedy_chain():
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    greedy = logits.argmax(-1).tolist()
    for budget in (1, 3, 5, 9):
        tree = build_ddtree_tree(logits, budget, topk=1)
        n = min(budget, 5)
        assert tree.parents.tolist() == [-1] + list(range(n))
        assert tree.depths.tolist() == list(range(n + 1))
        assert tree.tokens[1:].tolist() == greedy[:n]


def test_low_precision_logits_are_accepted():
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(3)).bfloat16()
    tree = build_ddtree_tree(logits, budget=8)
    _check_structure(tree, root_token=0)
    assert tree.num_nodes == 9


def _walk(next_token: list[int], next_sibling: list[int]) -> list[int]:
    """Depth-first walk from the root, the way the verification kernel descends."""
    visited, stack = [], [next_token[0]] if next_token[0] != -1 else []
    while stack:
        node = stack.pop()
        visited.append(node)
        if next_sibling[node] != -1:
            stack.append(next_sibling[node])
        if next_token[node] != -1:
            stack.append(next_token[node])
    return visited


@pytest.mark.parametrize("depth_max,vocab,budget,topk", CASES)
def test_retrieve_encodes_every_node_once_with_siblings_by_descending_logw(depth_max, vocab, budget, topk):
    logits = torch.randn(depth_max, vocab, generator=torch.Generator().manual_seed(budget))
    tree = build_ddtree_tree(logits, budget, topk=topk)
    ret = compile_ddtree_retrieve(tree.parents, tree.logw)
    ref = oracles.compile_ddtree_retrieve(tree.parents, tree.logw)  # the scalar sort
    assert torch.equal(ret.next_token, ref.next_token) and torch.equal(ret.next_sibling, ref.next_sibling)
    next_token, next_sibling = ret.next_token.tolist(), ret.next_sibling.tolist()
    assert ret.next_token.dtype == ret.next_sibling.dtype == torch.int64
    assert sorted(_walk(next_token, next_sibling)) == list(range(1, tree.num_nodes))
    assert next_sibling[0] == -1
    logw, parents = tree.logw.tolist(), tree.parents.tolist()
    for node in range(tree.num_nodes):
        chain, child = [], next_token[node]
        while child != -1:
            chain.append(child)
            child = next_sibling[child]
        assert chain == sorted(chain, key=lambda c: (-logw[c], c))  # descending logw, ties by index
        assert sorted(chain) == [i for i in range(tree.num_nodes) if parents[i] == node]


def test_retrieve_breaks_logw_ties_by_node_index():
    parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2])
    logw = torch.tensor([0.0, -1.0, -0.5, -1.0, -2.0, -2.0, -3.0])
    ret = compile_ddtree_retrieve(parents, logw)
    assert ret.next_token.tolist() == [2, 4, 6, -1, -1, -1, -1]
    assert ret.next_sibling.tolist() == [-1, 3, 1, -1, 5, -1, -1]


def test_retrieve_of_root_only_tree_is_empty():
    ret = compile_ddtree_retrieve(torch.tensor([-1]), torch.tensor([0.0]))
    assert ret.next_token.tolist() == [-1] and ret.next_sibling.tolist() == [-1]


def test_retrieve_rejects_mismatched_shapes():
    with pytest.raises(DDTreeError):
        compile_ddtree_retrieve(torch.tensor([-1, 0]), torch.tensor([0.0]))


def _random_batch(seed: int):
    """A batch of rows with their own budgets (0: root only), branching caps and depths, over logits that
    are flat (every entry ties), tied (three values), peaked or plain random."""
    rng = random.Random(seed)
    b, depth, vocab = rng.randint(1, 6), rng.randint(1, 6), rng.choice([2, 3, 5, 8, 40, 300])
    kind = rng.choice(["flat", "ties", "peaked", "random"])
    gen = torch.Generator().manual_seed(seed)
    logits = {
        "flat": lambda: torch.zeros(b, depth, vocab),
        "ties": lambda: torch.randint(0, 3, (b, depth, vocab), generator=gen).float(),
        "peaked": lambda: torch.randn(b, depth, vocab, generator=gen) * 8,
        "random": lambda: torch.randn(b, depth, vocab, generator=gen),
    }[kind]()
    budgets = np.array([rng.choice([0, 1, 2, 3, 7, 16, 40, 256, rng.randint(1, 256)]) for _ in range(b)])
    topks = np.array([min(rng.choice([1, 2, 3, vocab, 1000]), max(x, 1), vocab) for x in budgets])
    depths = np.array([rng.randint(1, depth) for _ in range(b)])
    return logits, TreeSpec(budgets, topks, depths), torch.randint(0, vocab, (b,), generator=gen)


def test_device_trees_equal_the_heaps_on_a_thousand_random_batches():
    """Same nodes in the same order, same parents, depths and scores, row by row, ties included: the heap
    consumes the same ranked candidates, so only the tree algorithm differs."""
    for seed in range(1000):
        logits, spec, roots = _random_batch(seed)
        k = int(spec.topks[spec.budgets > 0].max(initial=1))
        vals, ids = draft_candidates(logits, k)
        batch = build_tree_batch(vals, ids, roots, spec)
        for b in range(len(roots)):
            if spec.budgets[b] == 0:
                want = DraftTree.root_only(int(roots[b]))
            else:
                kb, depth = int(spec.topks[b]), int(spec.depths[b])
                cands = [row[:kb] for row in vals[b, :depth].tolist()]
                tokens = [row[:kb] for row in ids[b, :depth].tolist()]
                want = best_first_tree(cands, tokens, int(spec.budgets[b]), int(roots[b]))
            got = tree_row(batch, b)
            for field in ("tokens", "depths", "parents", "logw"):
                assert torch.equal(getattr(got, field), getattr(want, field)), (seed, b, field)
        assert batch.depth >= max(int(tree_row(batch, b).depths.max()) for b in range(len(roots)))


def test_device_tree_of_a_large_vocabulary_equals_the_heap():
    """Budget 256 over 151,936 tokens (the grouped top-k path), the real vocabulary's shape."""
    logits = torch.randn(2, 15, 151936, generator=torch.Generator().manual_seed(4)) * 4.0
    spec = TreeSpec(np.array([256, 100]), np.array([256, 8]), np.array([15, 15]))
    vals, ids = draft_candidates(logits, 256)
    batch = build_tree_batch(vals, ids, torch.tensor([1, 2]), spec)
    for b in range(2):
        want = build_ddtree_tree(logits[b], int(spec.budgets[b]), topk=int(spec.topks[b]), root_token=b + 1)
        assert torch.equal(tree_row(batch, b).tokens, want.tokens)
        assert torch.equal(tree_row(batch, b).parents, want.parents)


EXTRA = 2  # a bucket's dummy rows


def test_a_bucket_wide_beam_builds_the_same_trees_and_dummy_rows_have_no_node():
    """With fixed shapes the beam is as wide, branching and deep as the node bucket allows whatever the
    rows ask (one graph per bucket): the trees are the ones a beam sized for the batch builds, padded with
    empty nodes, and the bucket's dummy rows hold no node at all."""
    for seed in range(300):
        logits, spec, roots = _random_batch(seed)
        b, depth, vocab = logits.shape
        k = int(spec.topks[spec.budgets > 0].max(initial=1))
        if not spec.budgets.any():
            continue
        n = pick(node_ladder(512), int(spec.sizes(int(spec.budgets.max()), k).max()))
        if n == 1:
            continue
        shape = TreeShape.bucket(n, depth, vocab)
        vals, ids = draft_candidates(logits, shape.k)  # [B, L, K]: the natural beam reads the first k
        natural = build_tree_batch(vals[..., :k].contiguous(), ids[..., :k].contiguous(), roots, spec)
        padded_spec = TreeSpec(*(np.pad(x, (0, EXTRA)) for x in (spec.budgets, spec.topks, spec.depths)))
        pad = lambda x: torch.cat((x, torch.zeros(EXTRA, *x.shape[1:], dtype=x.dtype)))  # noqa: E731
        bucket = build_tree_batch(pad(vals), pad(ids), pad(roots), padded_spec, shape, rows=b)
        assert np.array_equal(bucket.sizes, natural.sizes), seed
        m = natural.tokens.shape[1]
        for field in ("tokens", "depths", "parents", "logw"):
            got, want = getattr(bucket, field), getattr(natural, field)
            assert torch.equal(got[:, :m], want), (seed, field)
            assert not got[:, m:].any(), (seed, field)  # columns past the widest tree: padding
        assert bucket.padded.tokens.shape == (b + EXTRA, n) and not bucket.padded.sizes[b:].any()
