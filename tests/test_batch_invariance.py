"""The batch-invariant path of exact (seeded) rows, part by part, bit for bit against the same computation
done alone (``ddtree.model.invariance``; end to end through the engine: ``test_seeded_equality.py``).

The oracles here import nothing from the code under test: a row alone is one ``F.linear`` call over that
row; a tree node's attention is its query alone over its committed columns and its ancestors (walked from
the parents list) in order, computed head by head in float64 and rounded to bf16."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from ddtree import Engine, SamplingParams
from ddtree.bench.prompts import BUILTIN_PROMPTS
from ddtree.model import invariance
from ddtree.model.invariance import ExactRows, RowRegime, probe
from ddtree.model.precision import fast_low_precision
from tests.conftest import moe_drafter, tiny_moe_target

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
        with ExactRows(torch.tensor(rows), b).linear():
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


HEADS, KV, D = 8, 2, 64


def alone(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The oracle: one query [heads, D] over exactly its visible keys/values [kv, S, D] in order, one head
    at a time, in float64 (products of bf16 values are exact there), rounded to bf16 at the end."""
    group = HEADS // KV
    out = []
    for h in range(HEADS):
        k, v = keys[h // group].double(), values[h // group].double()  # [S, D]
        w = torch.softmax((k @ q[h].double()) * D**-0.5, dim=0)  # [S]
        out.append((w[:, None] * v).sum(0))
    return torch.stack(out).to(BF16)  # [heads, D]


def batch_of(row: torch.Tensor, span: int, at: int) -> torch.Tensor:
    """A batch of 3 rows [3, heads, S, D] with ``row`` [heads, S', D] at index ``at``, the others random,
    the span ``span``: other company, another span."""
    out = torch.randn(3, row.shape[0], span, row.shape[2], dtype=BF16)
    out[at, :, : row.shape[1]] = row
    return out


def tree_outputs(parents: list[int], keys, values, q, start: int, span: int) -> torch.Tensor:
    """The tree's nodes' exact attention [heads, N, D] in a verify batch (row 2 of 3, span ``span``): the
    tree's columns after the committed ``start``, each node seeing those and its ancestors (``tree_mask``'s
    layout), masked columns up to the span."""
    n = len(parents)
    mask = torch.rand(3, 1, n, span) < 0.5  # the other rows: anything
    mask[2] = False
    mask[2, 0, :, :start] = True
    for j, path in enumerate(paths_from_parents(parents)):
        mask[2, 0, j, [start + i for i in path]] = True
    k, v, qs = batch_of(keys, span, 2), batch_of(values, span, 2), batch_of(q, n, 2)
    exact = ExactRows(torch.tensor([2]), 3)
    return exact.attend(torch.zeros(3, HEADS, n, D, dtype=BF16), qs, k, v, mask, D**-0.5)[2]


def prefill_outputs(keys, values, q, offset: int, span: int) -> torch.Tensor:
    """A prefill chunk's exact attention [heads, T, D] (T = q's positions after ``offset`` cached
    columns, causal), row 0 of a batch of 3 over ``span`` columns."""
    t = q.shape[1]
    k, v, qs = batch_of(keys, span, 0), batch_of(values, span, 0), batch_of(q, t, 0)
    cols = torch.arange(span)
    mask = (cols <= offset + torch.arange(t)[:, None]).expand(3, 1, t, span)
    exact = ExactRows(torch.tensor([0]), 3)
    return exact.attend(torch.zeros(3, HEADS, t, D, dtype=BF16), qs, k, v, mask, D**-0.5)[0]


@pytest.mark.parametrize("start", [5, 40, 130])
def test_a_tree_node_attends_as_its_query_alone_in_any_batch_and_span(start):
    """Each node of a best-first tree (row 2 of a verify batch, its ancestors among masked siblings) gets,
    bit for bit, the attention of its query alone over its sequence (the committed columns, then its
    root-to-node path), and so does the last position of a prefill chunk of that path: what a query
    attends does not depend on the method, the rows beside it or the columns they need."""
    torch.manual_seed(start)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 8, 9, 10, 11, 12, 13, 14, 15]  # a 17-node tree, depth 12
    n = len(parents)
    keys, values = (torch.randn(KV, start + n, D, dtype=BF16) * 4 for _ in range(2))
    q = torch.randn(HEADS, n, D, dtype=BF16) * 4
    tree = tree_outputs(parents, keys, values, q, start, span=start + n + 40)
    assert torch.equal(tree, tree_outputs(parents, keys, values, q, start, span=start + n))
    for j, path in enumerate(paths_from_parents(parents)):
        cols = list(range(start)) + [start + i for i in path]
        seq_k, seq_v = keys[:, cols], values[:, cols]  # plain decoding's cache for node j
        assert torch.equal(tree[:, j], alone(q[:, j], seq_k, seq_v)), f"node {j}"
        chunk = torch.randn(HEADS, len(path), D, dtype=BF16)
        chunk[:, -1] = q[:, j]
        prefill = prefill_outputs(seq_k, seq_v, chunk, start, span=len(cols) + 7)
        assert torch.equal(prefill[:, -1], tree[:, j]), f"node {j}: prefill"


def test_a_prefill_positions_attention_is_the_same_in_any_chunking(monkeypatch):
    """70 positions after 30 cached columns, prefilled as one chunk, as chunks of 1, 7 and the rest (a
    preempted row's recompute, another chunk budget), and with the score bound forcing inner chunks of 3
    queries: every position's attention is the same bits."""
    torch.manual_seed(2)
    keys, values = (torch.randn(KV, 100, D, dtype=BF16) * 4 for _ in range(2))
    q = torch.randn(HEADS, 70, D, dtype=BF16) * 4
    whole = prefill_outputs(keys, values, q, 30, span=112)
    lo = 0
    for size in (1, 7, 62):
        part = prefill_outputs(
            keys[:, : 30 + lo + size],
            values[:, : 30 + lo + size],
            q[:, lo : lo + size],
            30 + lo,
            span=30 + lo + size + 16 * size,
        )
        assert torch.equal(part, whole[:, lo : lo + size]), f"chunk at {lo}"
        lo += size
    monkeypatch.setattr(invariance, "EXACT_SCORES", 3 * HEADS * 112)
    assert torch.equal(prefill_outputs(keys, values, q, 30, span=112), whole)


@pytest.mark.parametrize("width", [1, 7, 64])
def test_a_context_in_column_chunks_gives_every_query_its_bits_alone(monkeypatch, width):
    """The float64 scratch bound (``EXACT_BYTES``) splits a long context into column chunks with an online
    softmax: at chunks of 1, 7 and 64 columns every tree node (ancestors among masked siblings, columns
    masked to the span) and every prefill position still equals its query alone over its own columns."""
    per_column = KV * 2 * D  # float64 keys and values of one row
    monkeypatch.setattr(invariance, "EXACT_BYTES", 8 * per_column * width)
    torch.manual_seed(7)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 8, 9, 10, 11, 12, 13, 14, 15]
    start, n = 130, len(parents)
    keys, values = (torch.randn(KV, start + n, D, dtype=BF16) * 4 for _ in range(2))
    q = torch.randn(HEADS, n, D, dtype=BF16) * 4
    tree = tree_outputs(parents, keys, values, q, start, span=start + n + 40)
    for j, path in enumerate(paths_from_parents(parents)):
        cols = list(range(start)) + [start + i for i in path]
        assert torch.equal(tree[:, j], alone(q[:, j], keys[:, cols], values[:, cols])), f"node {j}"
    prefill = prefill_outputs(keys, values, q, start, span=start + n + 9)
    for i in range(n):
        cols = list(range(start + i + 1))
        assert torch.equal(prefill[:, i], alone(q[:, i], keys[:, cols], values[:, cols])), f"position {i}"


def test_the_exact_passes_float64_scratch_is_bounded_at_a_long_context():
    """Sixteen exact decode rows over 40,960 columns at Qwen3-0.6B's attention shapes (16 heads over 8 KV
    heads of 128): their keys and values alone would take 10.7 GB in float64. The float64 buffers the pass
    keeps stay within ``EXACT_BYTES``, and the plan's reserve (``exact_scratch_bytes``) is under 1 GiB in
    bf16 and nothing in float32 (peaks measured beside it: docs/benchmarks.md, +40 MiB for 4 such rows)."""
    rows, heads, kv, d, span = 16, 16, 8, 128, 40_960
    keys = torch.zeros(1, span, kv, d, dtype=BF16).expand(rows, -1, -1, -1).transpose(1, 2)
    q = torch.randn(rows, heads, 1, d, dtype=BF16)
    mask = torch.ones(rows, 1, 1, span, dtype=torch.bool)
    invariance.SCRATCH.clear()
    with torch.inference_mode():
        ExactRows(torch.arange(rows), rows).attend(None, q, keys, keys, mask, d**-0.5)
    kept = sum(buf.numel() * 8 for buf in invariance.SCRATCH.values())
    assert kept <= invariance.EXACT_BYTES
    assert invariance.exact_scratch_bytes(BF16) < 1 << 30
    assert invariance.exact_scratch_bytes(torch.float32) == 0


def test_exact_attention_runs_inside_and_outside_inference_mode_alike(monkeypatch):
    """The float64 copies go to kept buffers; one made under inference mode (an engine's step) must not be
    the one a call outside it (a training step, a test) writes into."""
    monkeypatch.setattr(invariance, "SCRATCH", {})  # the first buffers made here, under inference mode
    torch.manual_seed(4)
    q = torch.randn(2, HEADS, 3, D, dtype=BF16)
    keys, values = (torch.randn(2, KV, 40, D, dtype=BF16) for _ in range(2))
    mask = torch.ones(2, 1, 3, 40, dtype=torch.bool)
    exact = ExactRows(torch.tensor([0, 1]), 2)
    with torch.inference_mode():
        inside = exact.attend(None, q, keys, values, mask, D**-0.5)
    assert torch.equal(exact.attend(None, q, keys, values, mask, D**-0.5), inside)


def test_an_sdpa_call_over_the_tree_layout_is_not_its_query_alone():
    """The mutation the tree test must catch: bf16 SDPA over the batch's layout (the fast path) gives some
    node other bits than its query alone, so the float64 path is what the equality above rests on."""
    torch.manual_seed(5)
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, 6, 8, 9, 10, 11, 12, 13, 14, 15]
    start, n = 40, 17
    keys, values = (torch.randn(KV, start + n, D, dtype=BF16) * 4 for _ in range(2))
    q = torch.randn(HEADS, n, D, dtype=BF16) * 4
    mask = torch.zeros(1, 1, n, start + n + 40, dtype=torch.bool)
    mask[..., :start] = True
    for j, path in enumerate(paths_from_parents(parents)):
        mask[0, 0, j, [start + i for i in path]] = True
    k, v = (F.pad(x, (0, 0, 0, 40))[None] for x in (keys, values))
    fast = F.scaled_dot_product_attention(q[None], k, v, attn_mask=mask, enable_gqa=True)[0]
    differ = 0
    for j, path in enumerate(paths_from_parents(parents)):
        cols = list(range(start)) + [start + i for i in path]
        differ += not torch.equal(fast[:, j], alone(q[:, j], keys[:, cols], values[:, cols]))
    assert differ > 0


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
    monkeypatch.setattr(ExactRows, "whole", False)  # the batch's call runs, and is kept
    monkeypatch.setattr(ExactRows, "attend", lambda self, out, *args: out)
    assert equal_to_ar() < 3


def greedy_mismatches(batch_invariant: bool) -> dict[str, list[int]]:
    """Greedy bf16 over the 12 first built-in bench prompts (48 tokens): per method, the prompts whose
    batched output differs from plain decoding of the prompt alone."""
    engine = Engine.from_pretrained(dtype=BF16, batch_invariant=batch_invariant, max_num_seqs=12)
    lines = BUILTIN_PROMPTS.read_text().splitlines()[:12]
    prompts = [json.loads(line)["prompt"] for line in lines]
    sp = SamplingParams(temperature=0.0, max_new_tokens=48, ignore_eos=True)
    alone = [engine.generate(p, sp, method="ar").token_ids for p in prompts]
    out = {}
    for method, budget in [("ar", None), ("ddtree", 16), ("ddtree", "auto"), ("dflash", None)]:
        batched = engine.generate(prompts, sp, method=method, budget=budget)
        out[f"{method}@{budget}"] = [i for i, r in enumerate(batched) if r.token_ids != alone[i]]
    return out


def test_a_batch_invariant_engine_decodes_greedy_bf16_as_plain_decoding_alone():
    """``batch_invariant=True`` makes every row exact, greedy ones too: batched greedy bf16 ``ar``,
    ``ddtree`` (budgets 16 and auto) and ``dflash`` emit what plain decoding emits for each prompt alone,
    token for token, with no tie allowed."""
    assert greedy_mismatches(True) == {"ar@None": [], "ddtree@16": [], "ddtree@auto": [], "dflash@None": []}


@pytest.mark.skipif(fast_low_precision(torch.device("cpu")) != BF16, reason="needs native bf16 matmuls")
def test_without_batch_invariance_greedy_bf16_depends_on_the_batch():
    """The mutation for the test above: the default engine's batched greedy bf16 leaves the prompts' lone
    outputs for some of them on this CPU (near-ties the batch's kernels round the other way; 2-3 of 12
    per method measured), so the equality above is the flag's doing."""
    assert any(greedy_mismatches(False).values())


def mla_runs() -> list[list[list[int]]]:
    """A tiny bf16 MLA + MoE target (DeepSeek-V3's layout) under ``batch_invariant``: six greedy and seeded
    requests, each alone with ``ar``, then all at once with ``ddtree`` / ``dflash``, in a pool that
    preempts them, and prefilled in 5-token chunks (positions a verify round computed in the absorbed
    form come back through a prefill's expanded one)."""
    target = tiny_moe_target("deepseek_v3").to(BF16)
    drafter = moe_drafter(target).to(BF16)
    prompts = [[2 + (7 * i + 5 * j) % 29 for j in range(12 + i)] for i in range(6)]
    sampled = SamplingParams(max_new_tokens=60, ignore_eos=True, temperature=1.0)
    sps = [replace(sampled, seed=i) if i % 2 else replace(sampled, temperature=0.0) for i in range(6)]
    common = dict(max_num_seqs=6, batch_invariant=True, prefill_gap_rounds=None)
    engine = Engine(target, drafter, max_model_len=256, **common)
    runs = [[engine.generate(p, sp, method="ar").token_ids for p, sp in zip(prompts, sps, strict=True)]]
    pool = 2 * -(-(20 + 60 + engine.runner.drafter.block_size) // 16) * engine.runner.block_bytes
    tight = Engine(target, drafter, max_model_len=96, kv_cache_memory=pool, **common)
    chunked = Engine(target, drafter, max_model_len=256, max_num_batched_tokens=5, **common)
    for e, method, budget in [(engine, "ddtree", 16), (engine, "dflash", None), (tight, "ddtree", 8)]:
        runs.append([r.token_ids for r in e.generate(prompts, sps, method=method, budget=budget)])
    runs.append([r.token_ids for r in chunked.generate(prompts, sps, method="ddtree", budget=8)])
    assert tight.num_preemptions > 0
    return runs


@pytest.mark.parametrize("columns", [None, 5])
def test_an_mla_targets_exact_rows_are_the_same_alone_batched_preempted_and_chunked(monkeypatch, columns):
    """MLA's exact rows attend in one float64 absorbed form in a prefill and in a verify round alike, so
    greedy and seeded outputs equal plain decoding alone through batching, preemption and chunking; also
    with the float64 scratch bound splitting every context into passes of 5 columns a row."""
    if columns is not None:
        monkeypatch.setattr(invariance, "EXACT_BYTES", 8 * columns * (32 + 8))  # kv_lora_rank + rope dims
    alone, *others = mla_runs()
    for run in others:
        assert run == alone


def test_without_the_float64_latent_form_a_preempted_mla_row_changes(monkeypatch):
    """The mutation for the test above: with the exact rows' MLA attention left to the batch's bf16 call
    (absorbed in a verify round, expanded in a prefill), a preempted row's recomputed positions round
    differently and its output leaves plain decoding's (3 of 6 rows measured)."""
    monkeypatch.setattr(ExactRows, "whole", False)
    monkeypatch.setattr(ExactRows, "attend_latent", lambda self, out, *args: out)
    alone, *others = mla_runs()
    assert any(run != alone for run in others)
