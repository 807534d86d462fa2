"""DDTree over a DFlash2 lattice: the trees hold the best paths by the sum of their edges' log-probs.

The builder is held to an exhaustive oracle written here from the definition (every path of candidates
enumerated and scored, the best ``budget`` kept under the documented tie rule, which must be prefix-closed).
Through the engine, a DFlash2 drafter's trees are the oracle's over the lattice it drafted, its ``dflash``
chain is the lattice's greedy walk, greedy output is the target's for every method, and sampled output
follows the target's law (the G-test of ``test_sampling_lossless``, which a biased acceptance fails).
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from ddtree.engine import Engine
from ddtree.engine.proposer import Proposer
from ddtree.model.capture import node_ladder, pick
from ddtree.model.loader import DEFAULT_TARGET, load_drafter, load_target
from ddtree.request.params import SamplingParams
from ddtree.speculative.dflash2 import DFlash2Drafter
from ddtree.speculative.drafter import dflash_config
from ddtree.speculative.tree import TreeShape, TreeSpec, build_tree_batch, lattice_tree
from tests import test_sampling_lossless as lossless
from tests.conftest import builtin_dflash
from tests.oracles import tree_row
from tests.test_dflash2 import SELECTOR, public_config, random_weights, write

PROMPTS = ["def fibonacci(n):", "The quick brown fox", "for i in range(10):"]
NEW = 24

# -- the exhaustive oracle ---------------------------------------------------------------------------------

Path = tuple[int, ...]  # candidate indices, one a depth


def best_paths(edges: list, budget: int, topk: int, depth: int) -> list[tuple[Path, float]]:
    """The ``budget`` best paths (and scores) through one row's lattice ``edges`` [L][K][K] (python floats;
    [d][p][c]: candidate c at depth d + 1 after candidate p, depth 1's rows alike), best first.

    Every path up to ``depth`` whose every edge ranks below ``topk`` among its parent's successors (by
    descending log-prob, ties by candidate index) is scored by adding its edges from the root in float64.
    Order: higher score; ties shallower first, then within a depth by (score, the parent's order, the
    candidate index), recursively.
    """
    k = len(edges[0][0])

    def rank(d: int, p: int, c: int) -> int:
        return sorted(range(k), key=lambda x: (-edges[d][p][x], x)).index(c)

    scored: dict[Path, tuple[float, tuple]] = {(): (0.0, ())}  # path -> (score, within-depth key)
    frontier: list[Path] = [()]
    for d in range(depth):
        grown = []
        for path in frontier:
            parent = path[-1] if path else 0
            score, key = scored[path]
            for c in range(k):
                if rank(d, parent, c) < topk:
                    child_score = score + edges[d][parent][c]
                    scored[path + (c,)] = (child_score, (-child_score, key, c))
                    grown.append(path + (c,))
        frontier = grown
    ordered = sorted((p for p in scored if p), key=lambda p: (-scored[p][0], len(p), scored[p][1]))
    best = ordered[:budget]
    chosen = set(best)
    assert all(p[:i] in chosen for p in best for i in range(1, len(p))), "the best paths are not a tree"
    return [(p, scored[p][0]) for p in best]


def tree_paths(trees, b: int) -> list[tuple[tuple[int, ...], float]]:
    """Row b's nodes in pop order as (token path from the root, root excluded; logw)."""
    tree = tree_row(trees, b)
    tokens, parents, logw = tree.tokens.tolist(), tree.parents.tolist(), tree.logw.tolist()
    out = []
    for i in range(1, len(tokens)):
        path, j = [], i
        while j > 0:
            path.append(tokens[j])
            j = parents[j]
        out.append((tuple(reversed(path)), logw[i]))
    return out


def expected_paths(edges: torch.Tensor, ids: torch.Tensor, budget: int, topk: int, depth: int) -> list:
    """The oracle's paths of one row (edges [L, K, K], ids [L, K]) as (token path, logw in float32)."""
    best = best_paths(edges.tolist(), budget, topk, depth)
    table = ids.tolist()
    return [(tuple(table[d][c] for d, c in enumerate(p)), float(np.float32(score))) for p, score in best]


def random_lattice(seed: int):
    """A batch of rows (own budgets, 0: the root alone; branching caps; depths) over a lattice whose edge
    log-probs are flat (every edge ties), tied (three levels), peaked or plain random; ids distinct per
    position. Small enough to enumerate: at most ~1,000 paths a row."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    k = rng.randint(1, 5)
    depth = rng.randint(1, max(1, min(5, int(np.log(1000) / np.log(max(k, 2))))))
    b, vocab = rng.randint(1, 4), rng.choice([k, k + 1, 50])
    kind = rng.choice(["flat", "ties", "peaked", "random"])
    scores = {
        "flat": lambda: torch.zeros(b, depth, k, k),
        "ties": lambda: torch.randint(0, 3, (b, depth, k, k), generator=gen).float(),
        "peaked": lambda: torch.randn(b, depth, k, k, generator=gen) * 8,
        "random": lambda: torch.randn(b, depth, k, k, generator=gen),
    }[kind]()
    scores[:, 0] = scores[:, 0, :1]  # depth 1: every row is the root's
    edges = torch.log_softmax(scores, dim=-1)  # [B, L, K, K]
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(b * depth)]).view(b, depth, k)
    paths = sum(k**d for d in range(1, depth + 1))
    budgets = np.array(
        [rng.choice([0, 1, 2, 5, 16, paths, paths + 3, rng.randint(1, paths)]) for _ in range(b)]
    )
    topks = np.array([rng.choice([1, 2, k, 100]) for _ in range(b)])
    depths = np.array([rng.randint(1, depth) for _ in range(b)])
    roots = torch.randint(0, vocab, (b,), generator=gen)
    return edges, ids, TreeSpec(budgets, topks, depths), roots, vocab


def assert_trees_are_the_oracles(trees, edges, ids, spec: TreeSpec, roots, seed: int) -> None:
    for b in range(len(roots)):
        assert int(trees.tokens[b, 0]) == int(roots[b])
        budget, topk, depth = (int(x[b]) for x in (spec.budgets, spec.topks, spec.depths))
        want = expected_paths(edges[b], ids[b], budget, topk, depth) if budget else []
        assert tree_paths(trees, b) == want, (seed, b)
        assert trees.sizes[b] == 1 + len(want)


# -- the builder -------------------------------------------------------------------------------------------


def test_lattice_trees_equal_the_exhaustive_best_first_oracle():
    """Same nodes in the same order with the same scores, row by row, ties and budgets past every path
    included."""
    for seed in range(300):
        edges, ids, spec, roots, _ = random_lattice(seed)
        assert_trees_are_the_oracles(build_tree_batch(edges, ids, roots, spec), edges, ids, spec, roots, seed)


def test_a_bucket_shaped_lattice_tree_is_the_same_and_dummy_rows_have_no_node():
    """With fixed shapes (a node bucket's width, depth and branching, dummy rows) the trees are the same."""
    extra = 2
    for seed in range(100):
        edges, ids, spec, roots, vocab = random_lattice(seed)
        if not spec.budgets.any():
            continue
        b, depth, k = ids.shape
        n = pick(node_ladder(512), int(spec.sizes(int(spec.budgets.max()), k, lattice=True).max()))
        if n == 1:
            continue
        pad = lambda x: torch.cat((x, torch.zeros(extra, *x.shape[1:], dtype=x.dtype)))  # noqa: E731
        padded_spec = TreeSpec(*(np.pad(x, (0, extra)) for x in (spec.budgets, spec.topks, spec.depths)))
        shape = TreeShape.bucket(n, depth, vocab)
        trees = build_tree_batch(pad(edges), pad(ids), pad(roots), padded_spec, shape, rows=b)
        assert_trees_are_the_oracles(trees, edges, ids, spec, roots, seed)
        assert trees.padded.tokens.shape == (b + extra, n) and not trees.padded.sizes[b:].any()


def test_the_compiled_lattice_builder_is_one_graph_per_bucket_and_builds_the_oracles_trees():
    """``lattice_tree`` compiled as the engine compiles its round graphs (``fullgraph``, static shapes):
    lattices of one bucket's shape reuse one graph (no recompile, no break) and give the oracle's trees."""
    compiled = torch.compile(lattice_tree, fullgraph=True, dynamic=False)
    b, depth, k, vocab, n = 3, 4, 3, 50, 17
    shape = TreeShape.bucket(n, depth, vocab)
    for seed in range(6):
        gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
        scores = torch.randn(b, depth, k, k, generator=gen) * (1 + 4 * (seed % 2))
        scores[:, 0] = scores[:, 0, :1]  # depth 1: every row is the root's
        edges = torch.log_softmax(scores, dim=-1)  # [B, L, K, K]
        ids = torch.stack([torch.randperm(vocab, generator=gen)[:k] for _ in range(b * depth)])
        ids = ids.view(b, depth, k)  # distinct per position
        spec = TreeSpec(rng.integers(0, n, b), rng.integers(1, k + 1, b), rng.integers(1, depth + 1, b))
        roots = torch.randint(0, vocab, (b,), generator=gen)
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            trees = build_tree_batch(edges, ids, roots, spec, shape, compiled, rows=b)
        assert_trees_are_the_oracles(trees, edges, ids, spec, roots, seed)


def test_branching_one_follows_the_greedy_edge():
    """topk 1 gives the lattice's greedy chain: at each depth the best edge after the previous choice,
    not the best marginal candidate."""
    scores = [[[0.0, 1.0, 2.0]] * 3, [[5.0, 0, 0], [5.0, 0, 0], [0, 5.0, 0]]]  # [L, K parent, K]
    edges = torch.log_softmax(torch.tensor(scores), dim=-1)[None]  # [1, 2, 3, 3]
    ids = torch.tensor([[[10, 11, 12], [20, 21, 22]]])  # candidate 0 is a position's best marginal
    trees = build_tree_batch(edges, ids, torch.tensor([7]), TreeSpec(*np.array([[2], [1], [2]])))
    first, second = float(edges[0, 0, 0, 2]), float(edges[0, 1, 2, 1])
    assert tree_paths(trees, 0) == [((12,), pytest.approx(first)), ((12, 21), pytest.approx(first + second))]


# -- through the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def builtin_pair(tmp_path_factory):
    """The built-in target and a DFlash2 drafter over the built-in drafter's trained DFlash layers
    (``builtin_dflash``; identity convolutions) with a random candidate selector: drafts are accepted,
    and the selector's pair scores move the lattice away from the marginals."""
    target, tokenizer = load_target(DEFAULT_TARGET)
    dflash = builtin_dflash(tmp_path_factory.mktemp("dflash"))
    config = public_config(json.loads((dflash / "config.json").read_text()))
    weights = random_weights(config, 1, load_file(str(dflash / "model.safetensors")))
    drafter = load_drafter(write(tmp_path_factory.mktemp("dflash2") / "converted", config, weights))
    assert isinstance(drafter, DFlash2Drafter)
    return target, drafter, tokenizer


@pytest.mark.parametrize("fixed", [False, True], ids=["eager", "fixed-shapes"])
def test_greedy_methods_with_a_dflash2_drafter_emit_the_targets_tokens(builtin_pair, fixed):
    params = SamplingParams(max_new_tokens=NEW)
    outputs, accepted = {}, {}
    for method, budget in [("ar", 1), ("dflash", 16), ("ddtree", 1), ("ddtree", 16)]:
        engine = Engine(
            *builtin_pair, method=method, budget=budget, max_num_seqs=len(PROMPTS), fixed_shapes=fixed
        )
        results = engine.generate(PROMPTS, params)
        outputs[method, budget] = [r.token_ids for r in results]
        accepted[method, budget] = sum(n - 1 for r in results for n in r.stats.acceptance_lengths)
    reference = outputs["ar", 1]
    assert all(len(tokens) == NEW for tokens in reference)
    assert all(got == reference for got in outputs.values()), outputs
    assert accepted["dflash", 16] > 10 and accepted["ddtree", 16] > 10  # the trees were drafted and read


@pytest.mark.parametrize("method", ["ddtree", "dflash"])
def test_the_engines_trees_are_the_oracles_over_the_drafted_lattice(builtin_pair, method, monkeypatch):
    """Every round's tree is the exhaustive oracle's over the lattice the drafter gave that round (for
    ``dflash``: branching 1, the greedy edge after each choice), anchored at the row's root; greedy and
    sampled rows (whose edges are normalised over the vocabulary) alike."""
    lattices, rounds = [], []
    lattice, trees = DFlash2Drafter.lattice, Proposer.trees

    def spy_lattice(self, hidden, logits, anchors, whole=None):
        ids, edges = lattice(self, hidden, logits, anchors, whole)
        lattices.append((ids, edges, anchors, whole))
        return ids, edges

    def spy_trees(self, rows, drafting, hidden):
        built = trees(self, rows, drafting, hidden)
        # per drafting row: its row, budget and depth as the proposer asks (the room is never short here)
        asked = [(rows.index(r), self.budget(r), self.depth(r), r.params.greedy) for r in drafting]
        rounds.append((len(lattices), asked, built))
        return built

    monkeypatch.setattr(DFlash2Drafter, "lattice", spy_lattice)
    monkeypatch.setattr(Proposer, "trees", spy_trees)
    engine = Engine(*builtin_pair, method=method, budget=5, max_num_seqs=len(PROMPTS))
    engine.generate(PROMPTS, [SamplingParams(max_new_tokens=NEW, temperature=i % 2) for i in range(3)])
    drafted = [(lattices[n - 1], asked, built) for n, asked, built in rounds if asked]
    assert len(drafted) >= 3 and len(lattices) == len(drafted)
    for (ids, edges, anchors, whole), asked, built in drafted:
        for d, (b, budget, depth, greedy) in enumerate(asked):
            assert int(built.tokens[b, 0]) == int(anchors[d])
            assert (whole is not None and d in whole) != greedy  # sampled rows: edges over the vocabulary
            budget, topk = (depth, 1) if method == "dflash" else (budget, budget)
            assert tree_paths(built, b) == expected_paths(edges[d], ids[d], budget, topk, depth)


# -- sampled output keeps the target's law -----------------------------------------------------------------

T07_TOP_P = SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=lossless.NEW_TOKENS)


@pytest.fixture(scope="module")
def sampling_pair():
    """The sampling tests' 6-token target and a random DFlash2 drafter for it (random selector codebooks:
    the lattice is not the marginals)."""
    target, _ = lossless.build_models()
    config = dflash_config(
        target.config, num_layers=1, block_size=4, mask_token_id=lossless.VOCAB - 1, initializer_range=0.5
    )
    config.dflash_config |= SELECTOR | {"selector_top_k": 4}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(lossless.DRAFTER_SEED)
        drafter = DFlash2Drafter(config).eval()
        for codebook in (
            drafter.candidate_selector.predecessor_codebook,
            drafter.candidate_selector.successor_codebook,
        ):
            torch.nn.init.normal_(codebook)
    return target, drafter


@pytest.mark.parametrize("threshold_acc", [1.0, lossless.BIASED_ACCEPTANCE], ids=["lossless", "biased"])
def test_sampled_ddtree_over_a_lattice_follows_the_target_distribution(sampling_pair, threshold_acc):
    """A G-test at T=0.7, top-p 0.9 of 3-token continuations sampled through lattice trees against the
    target's exact law; the same check at the same sample count rejects a biased acceptance rule."""
    engine = Engine(
        *sampling_pair, budget=lossless.BUDGET, max_num_seqs=128, accept_threshold_acc=threshold_acc
    )
    draws = lossless.draw(engine, "ddtree", T07_TOP_P, lossless.N_FAST, seed=0, batch=128)
    chi2_p, g_p = lossless.fit_p_values(draws.counts, lossless.exact_law(sampling_pair[0], T07_TOP_P))
    print(f"lattice ddtree T=0.7 top-p 0.9 n={lossless.N_FAST}: chi-square p={chi2_p:.3g} G-test p={g_p:.3g}")
    if threshold_acc == 1.0:
        lossless.assert_tree_path_exercised(draws, "ddtree")
        assert chi2_p > lossless.P_PASS and g_p > lossless.P_PASS, (chi2_p, g_p)
    else:
        assert chi2_p < lossless.P_BROKEN and g_p < lossless.P_BROKEN, (chi2_p, g_p)
