"""Greedy decoding is lossless: every method emits exactly the target's own greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ddtree.engine.verifier as verifier_module
import ddtree.speculative.verify as verify_module
from ddtree.engine import Engine
from ddtree.model.kv_cache import pack_buffers
from ddtree.request.params import SamplingParams
from ddtree.speculative.tree import TreeSpec, build_tree_batch, draft_candidates
from ddtree.speculative.verify import ancestor_mask
from tests.oracles import tree_row

PROMPTS = [[1, 5, 9, 22, 3], [7], [30, 2, 2, 14, 8, 19, 25, 11, 4, 0, 6, 13]]
NEW = 40


def hf_greedy(target, prompt: list[int], new: int, eos: int | None = None) -> list[int]:
    out = target.generate(
        torch.tensor([prompt]),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


def round_spans(result) -> list[tuple[int, int]]:
    """[begin, end) of the tokens each round emitted; the prefill token is its own span."""
    spans, pos = [(0, 1)], 1
    for length in result.stats.acceptance_lengths:
        spans.append((pos, min(pos + length, len(result.token_ids))))
        pos += length
    return spans


def test_greedy_matches_plain_decoding(pair):
    target, drafter = pair
    configs = [("ar", 1, None), ("dflash", 1, None)]
    configs += [("ddtree", b, k) for b in (1, 4, 16, 64, 256) for k in (1, 4, None)]
    params = SamplingParams(max_new_tokens=NEW)
    accepted_more_than_one = 0
    references = [hf_greedy(target, prompt, NEW) for prompt in PROMPTS]
    for method, budget, topk in configs:
        engine = Engine(target, drafter, method=method, budget=budget, topk=topk, max_num_seqs=len(PROMPTS))
        # the prompts as one batch (a row's output is its solo run's: tests/test_engine_batch.py)
        results = engine.generate(PROMPTS, params)
        for prompt, reference, result in zip(PROMPTS, references, results, strict=True):
            assert result.token_ids == reference, (method, budget, topk, prompt)
            assert result.finish_reason == "length"
            accepted_more_than_one += sum(n > 1 for n in result.stats.acceptance_lengths)
    assert accepted_more_than_one > 50  # the tree path was exercised, not just the bonus token


def test_greedy_trees_past_the_logits_bound_walk_and_match_plain_decoding(pair, monkeypatch):
    """Where every node's logits at once would pass ``GREEDY_ENTRIES`` (as 16 rows of 257 nodes at a real
    vocabulary do), the acceptance walks whatever the head's cost says, and emits plain greedy tokens."""
    target, drafter = pair
    monkeypatch.setattr(verifier_module, "GREEDY_ENTRIES", 5 * target.config.vocab_size)  # 5 nodes
    walks = []
    walk = verify_module.walk_paths
    monkeypatch.setattr(verify_module, "walk_paths", lambda *a: walks.append(1) or walk(*a))
    params = SamplingParams(max_new_tokens=NEW)
    engine = Engine(target, drafter, budget=64, max_num_seqs=2)
    monkeypatch.setattr(engine.runner, "head_floor_rows", 10**9)  # the cost alone: the head over all nodes
    results = engine.generate(PROMPTS[:2], params)
    for prompt, result in zip(PROMPTS[:2], results, strict=True):
        assert result.token_ids == hf_greedy(target, prompt, NEW)
    assert walks and any(n > 1 for r in results for n in r.stats.acceptance_lengths)


@pytest.mark.parametrize("draft_dtype", [torch.float32, torch.bfloat16])
def test_draft_precision_changes_proposals_not_output(pair, draft_dtype):
    """The drafter's LM head and MLPs may round (bf16 by default where it is native); only acceptance can
    change. The caller's drafter keeps its own weights."""
    target, drafter = pair
    engine = Engine(target, drafter, method="ddtree", budget=16, draft_dtype=draft_dtype)
    assert engine.runner.draft_head.dtype == draft_dtype
    layers = engine.runner.drafter.layers
    assert {p.dtype for layer in layers for p in layer.mlp.parameters()} == {draft_dtype}
    assert {p.dtype for p in drafter.parameters()} == {torch.float32}
    for prompt in PROMPTS:
        result = engine.generate(prompt, SamplingParams(max_new_tokens=NEW))
        assert result.token_ids == hf_greedy(target, prompt, NEW)
        assert max(result.stats.acceptance_lengths) > 1


def test_stop_token_inside_accepted_block_ends_generation_there(pair):
    target, drafter = pair
    engine = Engine(target, drafter, method="ddtree", budget=256)
    checked = 0
    for prompt in PROMPTS:
        full = engine.generate(prompt, SamplingParams(max_new_tokens=NEW))
        for begin, end in round_spans(full)[1:]:
            for pos in range(begin, end - 1):  # not the round's last token: strictly inside the block
                token = full.token_ids[pos]
                if token in full.token_ids[:pos]:
                    continue
                result = engine.generate(prompt, SamplingParams(max_new_tokens=NEW, stop_token_ids=(token,)))
                assert result.token_ids == full.token_ids[: pos + 1]
                assert result.finish_reason == "stop"
                assert result.token_ids == hf_greedy(target, prompt, NEW, eos=token)
                checked += 1
    assert checked >= 3


def test_max_new_tokens_ending_mid_block_is_exact(pair):
    target, drafter = pair
    engine = Engine(target, drafter, method="ddtree", budget=256)
    checked = 0
    for prompt in PROMPTS:
        full = engine.generate(prompt, SamplingParams(max_new_tokens=NEW))
        for begin, end in round_spans(full)[1:]:
            if end - begin < 2:
                continue
            limit = begin + 1  # ends after the first token of a multi-token round
            result = engine.generate(prompt, SamplingParams(max_new_tokens=limit))
            assert result.token_ids == full.token_ids[:limit]
            assert result.finish_reason == "length"
            assert sum(result.stats.acceptance_lengths) + 1 > limit  # the last round was cut
            checked += 1
    assert checked >= 3


def test_stream_deltas_add_up_to_the_result(pair):
    target, drafter = pair
    engine = Engine(target, drafter, method="ddtree", budget=16)
    deltas = list(engine.stream(PROMPTS[0], SamplingParams(max_new_tokens=NEW)))
    assert [t for d in deltas for t in d.token_ids] == hf_greedy(target, PROMPTS[0], NEW)
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == "length"


@pytest.mark.parametrize("kept_path", ["deepest", "first_child_chain"])
def test_kv_compaction_leaves_the_cache_of_a_fresh_forward(pair, kept_path):
    """After committing a round, the next logits equal a from-scratch HF forward over the committed tokens.

    The request's block table holds scattered, out-of-order blocks of the pool. The deepest path's slots
    are scattered through the tree block (a real gather); the chain of first children, nodes 0, 1, 2, ...,
    is already in place."""
    target, drafter = pair
    engine = Engine(target, drafter, max_batch_size=2, block_size=4)
    cache, forward = engine.runner.cache, engine.runner.forward
    tables = torch.zeros(1, cache.width + 1, dtype=torch.long)
    tables[0, : cache.width] = torch.randperm(engine.runner.num_blocks - 1)[: cache.width] + 1
    generator = torch.Generator().manual_seed(0)
    prompt = PROMPTS[2]
    start = len(prompt)

    def run(ids: list[int], positions: list[int], cols: list[int], visible: torch.Tensor) -> torch.Tensor:
        span = engine.runner.shapes.span(visible.shape[-1])
        visible = torch.nn.functional.pad(visible, (0, span - visible.shape[-1]))  # masked whole blocks
        write = cache.at(tables, torch.tensor([cols]), span)
        hidden, _ = forward(torch.tensor([ids]), torch.tensor([positions]), write, visible[None, None])
        return engine.runner.lm_head(hidden[0])  # [T, V]

    with torch.inference_mode():
        causal = torch.ones(start, start, dtype=torch.bool).tril()
        root = int(run(prompt, list(range(start)), list(range(start)), causal)[-1].argmax())
        # A random tree; keep its deepest root path so the kept slots are scattered through the tree block
        draft_logits = torch.randn(7, target.config.vocab_size, generator=generator)
        k = min(64, target.config.vocab_size)
        vals, cand = draft_candidates(draft_logits[None], k)
        spec = TreeSpec(np.array([64]), np.array([k]), np.array([7]))
        trees = build_tree_batch(vals, cand, torch.tensor([root]), spec)
        tree = tree_row(trees, 0)
        n = tree.num_nodes
        anc = ancestor_mask(trees)[0]  # [N, N]
        visible = torch.cat((torch.ones(n, start, dtype=torch.bool), anc), dim=1)
        positions = (tree.depths + start).tolist()
        run(tree.tokens.tolist(), positions, list(range(start, start + n)), visible)
        if kept_path == "deepest":
            path = [int(tree.depths.argmax())]
            while path[-1] != 0:
                path.append(int(tree.parents[path[-1]]))
            kept = path[::-1]
        else:  # in pop order a node's first child to appear is its most probable one
            kept = [0]
            for i, parent in enumerate(tree.parents.tolist()):
                if parent == kept[-1]:
                    kept.append(i)
        m = len(kept)
        padded = torch.tensor([kept + [0] * (trees.depth + 1 - m)])
        starts, lengths = torch.tensor([start]), torch.tensor([m])
        pack_buffers(cache.buffers, tables, starts, padded, lengths, cache.scratch, cache.block_size)
        committed = prompt + tree.tokens[kept].tolist()
        nxt = 3
        step = run([nxt], [start + m], [start + m], torch.ones(1, start + m + 1, dtype=torch.bool))[-1]
        fresh = target(torch.tensor([committed + [nxt]])).logits[0, -1]
    if kept_path == "deepest":
        assert m >= 3 and kept[-1] > m  # a real gather, not a prefix of the tree block
    else:
        assert m >= 2
    torch.testing.assert_close(step, fresh, atol=1e-5, rtol=0)


def test_the_compiled_kv_pack_moves_what_the_eager_one_moves():
    """The commit as a bucket's graph (``pack_buffers`` compiled, as accelerators run it) over paths whose
    moves overlap (a node moves onto a column a later node of its path is read from): every buffer ends
    as the eager moves leave it, with rows of several lengths, a root-only row and a dummy row (all
    scratch). Compiled, the gather must land in a buffer of its own before the scatter."""
    gen = torch.Generator().manual_seed(0)
    bs, width, rows, steps = 4, 12, 4, 9
    buffers = [torch.randn(60, bs, 2, 8, generator=gen) for _ in range(3)]  # [blocks, bs, kvh, D]
    owned = torch.randperm(59, generator=gen)[: 3 * width].view(3, width) + 1
    tables = torch.cat([owned, torch.zeros(1, width, dtype=torch.int64)])  # row 3: a dummy (scratch)
    tables = torch.cat([tables, torch.zeros(rows, 1, dtype=torch.int64)], dim=1)  # [4, width + 1]
    starts = torch.tensor([5, 0, 17, 1])
    compiled = torch.compile(pack_buffers, fullgraph=True, dynamic=False)
    for _ in range(10):
        path = torch.zeros(rows, steps, dtype=torch.int64)
        lengths = torch.tensor([int(torch.randint(2, steps + 1, (), generator=gen)), 1, 0, 0])
        lengths[2] = int(torch.randint(2, steps + 1, (), generator=gen))
        lengths[3] = int(torch.randint(1, steps + 1, (), generator=gen))
        for b in range(rows):
            nodes = torch.randperm(20, generator=gen)[: int(lengths[b]) - 1] + 1
            path[b, 1 : int(lengths[b])] = nodes.sort().values  # increasing, gaps: overlapping moves
        want = [buf.clone() for buf in buffers]
        pack_buffers(want, tables, starts, path, lengths, width * bs, bs)
        compiled(buffers, tables, starts, path, lengths, width * bs, bs)
        for got, expected in zip(buffers, want, strict=True):
            assert torch.equal(got, expected)
        assert any((path[b, 1 : int(lengths[b])] > torch.arange(1, int(lengths[b]))).any() for b in (0, 2))


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_seeded_sampled_request_is_reproducible(pair, method):
    target, drafter = pair
    engine = Engine(target, drafter, method=method, budget=16)
    params = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=24, seed=1234)
    first = engine.generate(PROMPTS[0], params).token_ids
    assert engine.generate(PROMPTS[0], params).token_ids == first
    other = SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=24, seed=4321)
    assert engine.generate(PROMPTS[0], other).token_ids != first
