"""Capture-ready decoding: padding to fixed shapes changes no output, and compiled rounds never recompile.

The built-in pair decodes mixed batches (every method, several budgets, greedy and seeded sampling) three
ways: with the default shapes, padded to batch and node buckets that force dummy rows and nodes, and
compiled. Greedy tokens and seeded samples must be identical. The drafter runs in float32 here: its bf16
logits are coarse enough for exact ties between tree nodes, and a compiled kernel's last-bit differences
may order tied nodes differently (either order is a valid tree, but the seeded draws then differ).

``DDTREE_TEST_DEVICE=cuda`` runs the engines on CUDA (compiled with CUDA graphs), as
``scripts/accelerator_check.sh`` does.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch._dynamo.utils import counters

from ddtree import DDTreeError
from ddtree.bench.step_ops import OpCounter, count_steps
from ddtree.engine import Engine
from ddtree.engine.clock import StageClock
from ddtree.model import capture
from ddtree.model.attention import PagedBlockMask, attend
from ddtree.model.capture import batch_ladder, node_ladder, pick, tree_mask
from ddtree.model.kv_cache import KVLayout, PagedKVCache
from ddtree.request.params import SamplingParams
from ddtree.speculative.budget import CostModel, LinearCost

DEVICE = os.environ.get("DDTREE_TEST_DEVICE", "cpu")
OPTIONS = dict(max_model_len=256, dtype=torch.float32, draft_dtype=torch.float32, device=DEVICE)
PROMPTS = [
    "def fibonacci(n):",
    "The capital of France is",
    "import numpy as np\n\n",
    "Once upon a time",
    "for i in range(10):",
]


def requests(new: int, largest: int = 16) -> list[tuple[str, SamplingParams, str, int | None]]:
    """(prompt, params, method, budget): every method, budgets that fill or underfill their bucket."""
    greedy = SamplingParams(max_new_tokens=new)
    return [
        (PROMPTS[0], greedy, "ddtree", largest),
        (PROMPTS[1], SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=new), "ddtree", 3),
        (PROMPTS[2], greedy, "dflash", None),
        (PROMPTS[3], SamplingParams(temperature=1.0, top_k=20, seed=2, max_new_tokens=new), "ar", None),
        (PROMPTS[4], SamplingParams(temperature=0.7, seed=3, max_new_tokens=new, logprobs=2), "ddtree", 8),
    ]


def same_runs(a: list, b: list) -> bool:
    """Two runs emitted the same tokens and logprob tokens; a logprob rounded to 4 decimals by kernels that
    round differently may land one unit apart (-0.4707 / -0.4708 seen), never more."""
    for (tokens_a, logprobs_a), (tokens_b, logprobs_b) in zip(a, b, strict=True):
        if tokens_a != tokens_b or [t for t, _ in logprobs_a] != [t for t, _ in logprobs_b]:
            return False
        if any(abs(x - y) > 1.5e-4 for (_, x), (_, y) in zip(logprobs_a, logprobs_b, strict=True)):
            return False
    return True


def run(engine: Engine, specs) -> list:
    """Decode the requests as one continuously batched run (more requests than rows: admissions mid-run)."""
    ids = [engine.add_request(p, sp, method=m, budget=b) for p, sp, m, b in specs]
    done: dict[str, list] = {i: [[], []] for i in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            done[delta.request_id][0] += delta.token_ids
            done[delta.request_id][1] += [(lp.token, round(lp.logprob, 4)) for lp in delta.logprobs]
    return [done[i] for i in ids]


@pytest.fixture(scope="module")
def eager() -> Engine:
    return Engine.from_pretrained(max_batch_size=4, **OPTIONS)


def sibling(eager: Engine, **options) -> Engine:
    """An engine on the eager engine's models, tokenizer and context (256 tokens), with other options."""
    return Engine(eager.target, eager.runner.drafter, eager.tokenizer, max_model_len=256, **options)


def test_ladders_cover_every_size_with_the_smallest_bucket():
    assert batch_ladder(16) == (1, 2, 4, 8, 16)
    assert batch_ladder(6) == (1, 2, 4, 6)
    assert batch_ladder(1) == (1,)
    assert node_ladder(16) == (1, 2, 3, 5, 9, 17)
    assert node_ladder(17) == (1, 2, 3, 5, 9, 17, 33)
    assert node_ladder(0) == (1,)
    assert [pick((1, 2, 3, 5, 9, 17), n) for n in (1, 4, 9, 10, 17)] == [1, 5, 9, 17, 17]
    with pytest.raises(DDTreeError):
        pick((1, 5), 6)


def test_tree_mask_shows_committed_columns_and_ancestors_only():
    rng = np.random.default_rng(0)
    b, n, span = 3, 5, 16
    starts = np.array([1, 4, 11])
    anc = rng.random((b, n, n)) < 0.5
    expected = np.zeros((b, n, span), dtype=bool)
    for r in range(b):
        expected[r, :, : starts[r]] = True
        for j in range(n):
            if starts[r] + j < span:
                expected[r, :, starts[r] + j] = anc[r, :, j]
    got = tree_mask(torch.from_numpy(starts), torch.from_numpy(anc), span)
    assert got.shape == (b, 1, n, span)
    assert np.array_equal(got[:, 0].numpy(), expected)


def test_bucket_options_are_checked_before_anything_runs(eager: Engine):
    target, drafter = eager.target, eager.runner.drafter
    with pytest.raises(
        DDTreeError, match=r"largest of batch_buckets must be the maximum batch size \(4\), got 2"
    ):
        Engine(target, drafter, max_batch_size=4, fixed_shapes=True, batch_buckets=[1, 2])
    with pytest.raises(DDTreeError, match="batch_buckets"):
        Engine(target, drafter, max_batch_size=4, fixed_shapes=True, batch_buckets=[0, 4])
    with pytest.raises(DDTreeError, match="node_buckets needs fixed shapes"):
        Engine(target, drafter, node_buckets=[5])
    with pytest.raises(DDTreeError, match="span_buckets may not exceed"):
        Engine(target, drafter, max_model_len=64, fixed_shapes=True, span_buckets=[16, 100])
    with pytest.raises(DDTreeError, match="compile=True needs fixed shapes"):
        Engine(target, drafter, compile=True, fixed_shapes=False)
    with pytest.raises(DDTreeError, match="largest node bucket"):
        Engine(target, drafter, budget=32, fixed_shapes=True, node_buckets=[5, 17])
    with pytest.raises(DDTreeError, match="attention='flex' needs compile=True"):
        Engine(target, drafter, attention="flex")
    with pytest.raises(DDTreeError, match="attention must be one of sdpa, flex"):
        Engine(target, drafter, compile=True, attention="paged")
    with pytest.raises(DDTreeError, match="span_buckets is for attention='sdpa'"):
        Engine(target, drafter, compile=True, attention="flex", span_buckets=[32])
    padded = Engine(target, drafter, budget=8, fixed_shapes=True, node_buckets=[5, 17])
    with pytest.raises(DDTreeError, match="largest node bucket"):
        padded.add_request("x", budget=17)
    assert padded.num_waiting == 0


def test_padded_rows_and_nodes_change_no_output(eager: Engine):
    """Buckets of 3 and 4 rows, 4, 7, 13, 17 nodes and 24 (rounded to 32), 48 or all the table's columns
    read: dummy rows, dummy nodes, every tree size padded, rows growing from one span bucket into the next."""
    padded = sibling(
        eager,
        max_batch_size=4,
        draft_dtype=torch.float32,
        fixed_shapes=True,
        batch_buckets=[3, 4],
        node_buckets=[4, 7, 13, 17],
        span_buckets=[24, 48],
    )
    shapes = []
    verify = padded.runner.verify_forward

    def spy(ids, positions, cols, starts, anc, tables, span, features, block_mask):
        widest = int(anc.diagonal(dim1=1, dim2=2).sum(-1).max())  # a real node sees itself, padding not
        shapes.append((tuple(ids.shape), span, padded.num_running, widest))
        return verify(ids, positions, cols, starts, anc, tables, span, features, block_mask)

    padded.runner.verify_forward = spy
    specs = requests(new=40)
    assert same_runs(run(padded, specs), run(eager, specs))
    assert {s[0] for s in shapes} <= {(b, n) for b in (3, 4) for n in (4, 7, 13, 17)}
    spans = {s[1] for s in shapes}
    assert spans <= {32, 48, padded.runner.cache.capacity} and len(spans) >= 2  # rows grew into wider spans
    assert any(rows < shape[0] for shape, _, rows, _ in shapes)  # dummy rows
    assert any(widest < shape[1] for shape, _, _, widest in shapes)  # dummy nodes


def compiled_pair(eager: Engine, **options) -> Engine:
    """A compiled two-row sibling: one batch bucket, so a batch alone runs as a dummy-padded pair."""
    return sibling(
        eager, max_batch_size=2, draft_dtype=torch.float32, compile=True, batch_buckets=[2], **options
    )


@pytest.fixture(scope="module")
def compiled(eager: Engine) -> Engine:
    with pytest.MonkeyPatch.context() as patch:  # the round's graphs too, as on an accelerator
        patch.setattr(capture, "COMPILE_ROUND_ON_CPU", True)
        engine = compiled_pair(eager, node_buckets=[17, 257])  # each bucket: five graphs, ~100 s cold
    assert engine.runner.shapes.round_compiled
    return engine


def test_compiled_rounds_never_recompile_and_match_eager(eager: Engine, compiled: Engine):
    """After the start-up warm-up, 50+ rounds of mixed budgets (256 included: SGLang's capture failed above
    8) and batch sizes compile nothing more, break no graph and emit exactly what the eager engine emits."""
    assert compiled.warmup_seconds > 0
    graphs = counters["stats"]["unique_graphs"]
    rounds = []
    step = compiled.core._round

    def count(*args):
        rounds.append(compiled.num_running)
        return step(*args)

    compiled.core._round = count
    specs = requests(new=48, largest=256)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = run(compiled, specs)
    assert len(rounds) >= 50 and set(rounds) == {1, 2}
    assert counters["stats"]["unique_graphs"] == graphs  # nothing compiled after the warm-up
    assert sum(counters["graph_break"].values()) == 0
    assert same_runs(got, run(eager, specs))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_a_compiled_decode_step_makes_the_same_few_eager_calls_whatever_the_budget(
    eager: Engine, compiled: Engine, sampled: bool
):
    """With compile=True the tree, the verify inputs, the acceptance (sampling filters included) and the KV
    pack are graphs too: a decode step of two rows calls its six graphs once each and
    makes the same few eager ops beside them at budgets 4, 16 and 256 (node buckets 17 and 257), none of
    them per layer (the eager pack is a gather and a scatter per layer buffer), where the eager engine's
    step grows with the budget."""
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    if sampled:
        params = SamplingParams(temperature=1.0, top_p=0.9, seed=0, max_new_tokens=40, ignore_eos=True)

    def ops_per_step(engine: Engine, budget: int) -> tuple[float, OpCounter]:
        for prompt in PROMPTS[:2]:
            engine.add_request(prompt, params, budget=budget)
        for _ in range(3):  # the prefills and a first round
            engine.step()
        ops, _, counter = count_steps(engine, 3)
        while engine.has_unfinished_requests():  # to the end: the next test's run sees no stray delta
            engine.step()
        return ops, counter

    counts = {}
    for budget in (4, 16, 256):
        counts[budget], counter = ops_per_step(compiled, budget)
        graphs = (
            "draft_forward",
            "tree_graph",
            "inputs_graph",
            "verify_forward",
            "accept_graph",
            "pack_graph",
        )
        assert counter.calls == dict.fromkeys(graphs, 3)
        assert counter.ops["aten.index_put_"] == counter.ops["aten.index"] == 0  # no move outside a graph
    # two rows' slots, uploads, candidates; sampled: the coins and the lattice's whole-vocabulary edges
    bound = 90 if sampled else 60
    assert max(counts.values()) <= bound and max(counts.values()) - min(counts.values()) <= 0.15 * bound
    eager_ops, _ = ops_per_step(eager, 256)
    assert eager_ops > 4 * counts[256]


def test_compiled_rounds_after_prefix_cache_hits_match_a_cold_eager_engine(eager: Engine, compiled: Engine):
    """Requests that share a prefix (hits mid-run, after their first owner finished) change no captured
    shape: nothing recompiles, and the tokens are a cold eager engine's."""
    system = "You are a careful Python programmer. Write small, clear functions with docstrings. " * 2
    specs = [(system + p, sp, m, b) for p, sp, m, b in requests(new=24)]
    cold = sibling(eager, max_batch_size=4, enable_prefix_caching=False)
    hits = compiled.blocks.hit_tokens
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = run(compiled, specs)
    full = len(compiled.encode(system)) // 16 * 16 - 16  # the system prompt's full blocks, at least
    assert full >= 16 and compiled.blocks.hit_tokens - hits >= 3 * full  # two rows at a time: three hit
    assert same_runs(got, run(cold, specs))


def test_stage_timing_is_opt_in(eager: Engine, monkeypatch):
    """Without profiling no stage is timed; with it the stages are marked by ``StageClock`` (CUDA events
    read after the round's sync), so in neither case does a stage boundary wait for the device: the only
    synchronising clock read is the prefill's end."""
    points, synced = [], []
    point, now = StageClock._point, eager.core._now
    monkeypatch.setattr(StageClock, "_point", lambda self: points.append(1) or point(self))
    monkeypatch.setattr(eager.core, "_now", lambda: synced.append(True) or now())
    try:
        quiet = eager.generate(PROMPTS[0], SamplingParams(max_new_tokens=20), budget=16)  # auto is timed
        quiet_points, quiet_synced = len(points), list(synced)
        eager.profile = True
        timed = eager.generate(PROMPTS[0], SamplingParams(max_new_tokens=20), budget=16)
    finally:
        eager.profile = False
    assert set(quiet.stats.stage_seconds.values()) == {0.0} and quiet.stats.decode_seconds > 0
    assert quiet_points == 0 and quiet_synced == [True]  # the prefill's end only
    assert len(points) == 12 * timed.stats.rounds and synced == [True, True]  # 6 stages x (start, end)
    assert all(timed.stats.stage_seconds[s] > 0 for s in ("draft", "tree", "verify", "commit"))
    assert timed.token_ids == quiet.token_ids


def test_auto_rows_catch_up_a_long_backlog_with_repeated_fixed_passes(eager: Engine):
    """A cost where drafting never pays (a drafter pass costs 50 plain rounds, so even a whole block
    accepted loses; at 5 a probe that took 16 nodes paid, and its stretch was rightly called off): "auto"
    rows run plain for 1, 2, 4, ... 16 rounds and probe in between; a backlog longer than the pass's
    one-block context takes several passes, and the probes' drafts are still accepted (the drafter's cache
    caught up exactly)."""
    cost = CostModel(verify=LinearCost(1.0, 0.001), draft=LinearCost(50.0, 0.0), frozen=True)
    padded = sibling(
        eager,
        budget="auto",
        max_batch_size=2,
        fixed_shapes=True,
        node_buckets=[5, 17],
        cost_model=cost,
    )
    passes = []
    draft_pass = padded.proposer.draft_pass

    def spy(slots, c, tables, fixed):
        passes.append((len(padded.scheduler.running[0].stats.acceptance_lengths), fixed))
        return draft_pass(slots, c, tables, fixed)

    padded.proposer.draft_pass = spy
    params = SamplingParams(max_new_tokens=90)
    # A prompt whose first drafts the built-in drafter gets right: probes that all miss would teach
    # nothing of the backlog's catch-up.
    got = padded.generate(PROMPTS[1], params)
    assert got.token_ids == eager.generate(PROMPTS[1], params, method="ar").token_ids
    rounds = [n for n, fixed in passes if fixed]
    assert max(rounds.count(n) for n in set(rounds)) >= 2  # one round, several passes
    probes = [a for a, n in zip(got.stats.acceptance_lengths, got.stats.drafted_nodes, strict=True) if n]
    assert max(probes) > 1


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile")
def test_paged_block_mask_shows_each_row_its_own_columns_only():
    """The flex backend's mask over the pool equals the dense tree mask over each row's gathered columns:
    uncompiled flex (a dense reference over every pool column) against SDPA, rows with shuffled blocks,
    committed lengths from 0 to a block short of the table, a dummy row; the block lists end at each
    row's last needed block."""
    gen = torch.Generator().manual_seed(0)
    b, n, heads, kv_heads, d, bs, width = 4, 5, 4, 2, 16, 4, 6
    cache = PagedKVCache(1, 1 + b * width, bs, width, KVLayout.gqa(kv_heads, d), torch.float32, "cpu")
    cache.keys[0].normal_(generator=gen)
    cache.values[0].normal_(generator=gen)
    tables = torch.zeros(b, width + 1, dtype=torch.int64)
    tables[:3, :width] = (torch.randperm(b * width, generator=gen)[: 3 * width] + 1).view(3, width)
    starts = torch.tensor([0, 7, width * bs - n, 1])  # row 3: a dummy (all scratch), sees nothing real
    anc = torch.rand(b, n, n, generator=gen) < 0.5
    q = torch.randn(b, heads, n, d, generator=gen)
    cols = torch.full((b, n), cache.scratch, dtype=torch.int64)  # write nothing: read what is there
    mask = PagedBlockMask(cache, b, n, torch.device("cpu")).update(tables, starts, anc)
    assert mask.kv_num_blocks[:3, 0, 0].tolist() == [-(-(s + n) // bs) for s in starts[:3].tolist()]
    span = width * bs
    dense = attend(
        q, *cache.at(tables, cols, span).write(0, *_no_new(cache, b)), tree_mask(starts, anc, span)
    )
    flex = attend(q, *cache.at(tables, cols, None).write(0, *_no_new(cache, b)), mask)
    assert torch.allclose(flex[:3], dense[:3], atol=1e-5)


def _no_new(cache: PagedKVCache, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values for one token per row into the scratch column (the test only reads)."""
    k = torch.zeros(b, cache.keys[0].shape[2], 5, cache.keys[0].shape[3])
    return k, k


@pytest.fixture(scope="module")
def compiled_flex(eager: Engine) -> Engine:
    # One verify shape and one drafter shape: on a fresh machine each flex graph compiles for a minute.
    return compiled_pair(eager, node_buckets=[17], attention="flex")


def test_flex_attention_rounds_never_recompile_and_match_eager(eager: Engine, compiled_flex: Engine):
    """FlexAttention over the paged pool (each row reads its own blocks up to its length), compiled:
    no compile after the warm-up, no graph break, and the same greedy tokens, seeded samples and
    logprobs as the eager SDPA engine."""
    graphs = counters["stats"]["unique_graphs"]
    specs = requests(new=32)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = run(compiled_flex, specs)
    assert counters["stats"]["unique_graphs"] == graphs
    assert sum(counters["graph_break"].values()) == 0
    assert compiled_flex.runner.shapes.block_masks  # the rounds went through the flex backend
    assert same_runs(got, run(eager, specs))
