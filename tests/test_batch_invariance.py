"""The batch-invariant path of exact (seeded) rows, part by part, bit for bit against the same computation
done alone (``ddtree.model.invariance``; end to end through the engine: ``test_seeded_equality.py``).

The oracles here import nothing from the code under test: a row alone is one ``F.linear`` call over that
row; a tree node's attention is plain decoding's call (``attention.attend``, the primitive both use), one
query whose keys are its committed columns and its ancestors (walked from the parents list) in order, then
masked columns up to the span."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ddtree import Engine, SamplingParams
from ddtree.model import invariance
from ddtree.model.attention import attend
from ddtree.model.invariance import ExactRows, InvariantLinear, PathLayout, RowRegime, probe
from ddtree.model.precision import fast_low_precision

BF16 = torch.bfloat16


@pytest.mark.parametrize("k", [768, 2048])
def test_an_exact_rows_linear_outputs_are_its_bits_alone_at_any_batch(k):
    """Batches of 1-300 rows x 1-40 positions ([B, T, K], the forward's) and flat [M, K] inputs (an LM
    head over nodes): every exact row's outputs equal its positions computed alone, each as a call of the
    probed regime's fewest rows (copies of itself; ``probe`` is checked against plain calls below)."""
    torch.manual_seed(0)
    weight = torch.randn(256, k, dtype=BF16) / k**0.5
    lo = probe(weight, None).lo
    for b, t, rows in [
        (1, 40, [0]),
        (3, 17, [0, 2]),
        (12, 17, [0, 11]),
        (5, 1, [4]),
        (9, 33, [0, 8]),
        (300, 1, [7]),
    ]:
        x = torch.randn(b, t, k, dtype=BF16)
        with InvariantLinear(torch.tensor(rows), b):
            out = F.linear(x, weight)  # [B, T, 256]
            flat = F.linear(x.reshape(-1, k), weight)  # [B * T, 256]: wholly chunked
        for r in rows:
            alone = torch.cat([F.linear(x[r, i : i + 1].repeat(lo, 1), weight)[:1] for i in range(t)])
            assert torch.equal(out[r], alone), (b, t, r)
            assert torch.equal(flat[r * t : (r + 1) * t], alone), (b, t, r)


@pytest.mark.parametrize("shape", [(256, 768), (256, 2048), (1024, 4096)])
def test_a_probed_regime_holds_at_every_call_size_inside_it(shape):
    """The probe tries some call sizes; its promise covers all of them: at every size from ``lo`` to 64 and
    at its ``hi``, every row of a call on other data has the bits of that row alone (``lo`` copies)."""
    torch.manual_seed(3)
    weight = torch.randn(*shape, dtype=BF16) / shape[1] ** 0.5
    rows = probe(weight, None)
    x = torch.randn(rows.hi, shape[1], dtype=BF16)
    alone = torch.cat([F.linear(x[i : i + 1].repeat(rows.lo, 1), weight)[:1] for i in range(rows.hi)])
    for m in [*range(rows.lo, min(rows.hi, 64) + 1), rows.hi]:
        assert torch.equal(F.linear(x[:m], weight), alone[:m]), f"{m} rows"


def paths_from_parents(parents: list[int]) -> list[list[int]]:
    """Each node's root-to-node path from its parent (-1: the root)."""
    paths: list[list[int]] = []
    for j, p in enumerate(parents):
        paths.append([j] if p < 0 else [*paths[p], j])
    return paths


def test_each_tree_node_attends_as_plain_decoding_would_over_its_path():
    """Two rows with their trees in one verify batch: the exact row's nodes' attention equals, bit for bit,
    a single-query SDPA over [its committed columns, its ancestors in order] (plain decoding's keys)."""
    torch.manual_seed(1)
    heads, kv, d, n, span = 8, 2, 64, 9, 96
    parents = [[-1, 0, 0, 1, 1, 2, 3, 3, 6], [-1, 0, 1, 2, 0, 4, 4, 1, 7]]  # two best-first trees
    starts = torch.tensor([40, 70])
    anc = torch.zeros(2, n, n, dtype=torch.bool)
    for b, ps in enumerate(parents):
        for j, path in enumerate(paths_from_parents(ps)):
            anc[b, j, path] = True
    q = torch.randn(2, heads, n, d, dtype=BF16)
    keys = torch.randn(2, kv, span, d, dtype=BF16)
    values = torch.randn(2, kv, span, d, dtype=BF16)
    rel = torch.arange(span)[None] - starts[:, None]
    block = anc.gather(2, rel.clamp(0, n - 1)[:, None].expand(2, n, span))
    mask = ((rel < 0)[:, None] | (block & ((rel >= 0) & (rel < n))[:, None]))[:, None]  # [2, 1, N, span]
    shared = attend(q, keys, values, mask)
    rows = torch.tensor([1])
    exact = ExactRows(rows, (1,), 2, PathLayout.of(rows, starts, anc, span))
    out = exact.attend(shared.clone(), q, keys, values, mask, None)
    assert torch.equal(out[0], shared[0])  # the other row keeps the one shared call
    start = int(starts[1])
    for j, path in enumerate(paths_from_parents(parents[1])):
        cols = list(range(start)) + [start + i for i in path]
        cols += [span - 1] * (span - len(cols))  # trailing columns, masked as plain decoding's are
        seen = (torch.arange(span) < start + len(path))[None, None, None]  # [1, 1, 1, span]
        oracle = attend(q[1:, :, j : j + 1], keys[1:, :, cols], values[1:, :, cols], seen)
        assert torch.equal(out[1:, :, j : j + 1], oracle), f"node {j}"


def test_each_prefill_position_attends_as_its_own_query():
    """A causal prefill chunk of 50 positions after 30 cached columns: each exact position's attention equals
    the single-query call plain decoding makes at that position."""
    torch.manual_seed(2)
    heads, kv, d, t, cached, span = 8, 2, 64, 50, 30, 96
    q = torch.randn(2, heads, t, d, dtype=BF16)
    keys = torch.randn(2, kv, span, d, dtype=BF16)
    values = torch.randn(2, kv, span, d, dtype=BF16)
    positions = cached + torch.arange(t)
    mask = (torch.arange(span)[None] <= positions[:, None])[None, None].expand(2, 1, t, span)
    shared = attend(q, keys, values, mask)
    out = ExactRows(torch.tensor([0]), (0,), 2).attend(shared.clone(), q, keys, values, mask, None)
    for i, p in enumerate(positions.tolist()):
        seen = (torch.arange(span) <= p)[None, None, None]  # [1, 1, 1, span]: plain decoding's query
        oracle = attend(q[:1, :, i : i + 1], keys[:1], values[:1], seen)
        assert torch.equal(out[:1, :, i : i + 1], oracle), f"position {p}"
    assert torch.equal(out[1], shared[1])


@pytest.mark.skipif(fast_low_precision(torch.device("cpu")) != BF16, reason="needs native bf16 matmuls")
def test_without_the_invariant_path_seeded_speculation_leaves_plain_decoding(monkeypatch):
    """The engine-level equality (test_seeded_equality.py, bfloat16) is the invariant path's doing: with
    its linears unchunked and its attention the batch's shared call, seeded ``ddtree`` leaves seeded
    ``ar``'s tokens on this CPU, as it did before (0 of 20 prompts equal, docs/benchmarks.md)."""
    engine = Engine.from_pretrained(dtype=BF16)
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):"]
    sps = [SamplingParams(temperature=1.0, seed=i, max_new_tokens=48, ignore_eos=True) for i in range(3)]

    def equal_to_ar() -> int:
        return sum(
            engine.generate(p, sp, method="ddtree", budget=16).token_ids
            == engine.generate(p, sp, method="ar").token_ids
            for p, sp in zip(prompts, sps, strict=True)
        )

    assert equal_to_ar() == 3
    monkeypatch.setattr(invariance, "regime", lambda weight, bias: RowRegime(1, 1 << 30))  # one call
    monkeypatch.setattr(ExactRows, "attend", lambda self, out, *args: out)
    assert equal_to_ar() < 3
