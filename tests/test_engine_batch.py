"""Continuous batching changes no output: a request emits the same tokens alone or in any batch.

The built-in pair (real tokenizer, a drafter that gets accepted) decodes a mixed batch: prompt lengths 1 to
300 tokens, every method, budgets 1 to 64, greedy and seeded sampling with every filter, stop strings,
max_tokens and logprobs. Each request is compared with its solo run, and greedy ones with HF generate.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from ddtree import DDTreeError
from ddtree.engine import Engine
from ddtree.engine.verifier import Verifier
from ddtree.request.params import SamplingParams

NEW = 40


@dataclass(frozen=True)
class Spec:
    prompt_tokens: int
    params: SamplingParams
    method: str
    budget: int = 16
    topk: int | None = None


SPECS = [
    Spec(1, SamplingParams(max_new_tokens=NEW), "ddtree", 64),
    Spec(300, SamplingParams(max_new_tokens=NEW), "ddtree", 1),
    Spec(37, SamplingParams(max_new_tokens=NEW, logprobs=3), "dflash"),
    Spec(120, SamplingParams(max_new_tokens=NEW), "ar"),
    Spec(64, SamplingParams(max_new_tokens=NEW), "ddtree", 32, 2),
    Spec(9, SamplingParams(max_new_tokens=25, stop=("return",)), "ddtree", 8),
    Spec(
        200, SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_new_tokens=NEW, logprobs=2), "ddtree", 16
    ),
    Spec(15, SamplingParams(temperature=1.0, top_k=20, seed=2, max_new_tokens=NEW), "dflash"),
    Spec(80, SamplingParams(temperature=0.6, min_p=0.05, seed=3, max_new_tokens=NEW), "ar"),
    Spec(
        45,
        SamplingParams(temperature=0.7, top_k=20, top_p=0.95, seed=4, max_new_tokens=NEW, stop=("\n\n",)),
        "ddtree",
        64,
        4,
    ),
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    # float32: a seeded row equals its solo run where the forwards agree to the bit (bfloat16's batched and
    # solo forwards round differently enough to flip a sample now and then: docs/benchmarks.md)
    return Engine.from_pretrained(max_batch_size=16, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(engine: Engine) -> list[list[int]]:
    """Token-id prompts of each spec's length, cut from real Python source."""
    source = Engine.__doc__ + open(torch.__file__).read()
    ids = engine.encode(source)
    return [ids[i * 7 : i * 7 + spec.prompt_tokens] for i, spec in enumerate(SPECS)]


def solo(engine: Engine, prompt: list[int], spec: Spec):
    return engine.generate(prompt, spec.params, method=spec.method, budget=spec.budget, topk=spec.topk)


def run_batch(engine: Engine, requests: list[tuple[list[int], Spec]]) -> dict[str, dict]:
    """Add every request, step until all finish; returns per request id its tokens, logprobs and reason."""
    out: dict[str, dict] = {}
    for prompt, spec in requests:
        rid = engine.add_request(prompt, spec.params, method=spec.method, budget=spec.budget, topk=spec.topk)
        out[rid] = {"tokens": [], "logprobs": [], "finish": None}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            record = out[delta.request_id]
            record["tokens"] += delta.token_ids
            record["logprobs"] += delta.logprobs
            record["finish"] = delta.finish_reason
    return out


def assert_same_logprobs(batched, alone) -> None:
    assert len(batched) == len(alone)
    for b, a in zip(batched, alone, strict=True):
        assert b.token == a.token and [t for t, _ in b.top] == [t for t, _ in a.top]
        assert b.logprob == pytest.approx(a.logprob, abs=1e-5)
        assert [v for _, v in b.top] == pytest.approx([v for _, v in a.top], abs=1e-5)


def hf_greedy(engine: Engine, prompt: list[int], new: int) -> list[int]:
    out = engine.target.generate(
        torch.tensor([prompt]),
        max_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()


def test_mixed_batch_equals_solo_runs_and_hf_generate(engine, prompts):
    alone = [solo(engine, p, spec) for p, spec in zip(prompts, SPECS, strict=True)]
    batched = list(run_batch(engine, list(zip(prompts, SPECS, strict=True))).values())
    for prompt, spec, a, b in zip(prompts, SPECS, alone, batched, strict=True):
        assert b["tokens"] == a.token_ids, spec
        assert b["finish"] == a.finish_reason, spec
        if spec.params.logprobs is not None:
            assert_same_logprobs(b["logprobs"], a.logprobs)
        if spec.params.greedy and not spec.params.stop:
            assert a.token_ids == hf_greedy(engine, prompt, spec.params.max_new_tokens), spec
    assert sum(a.stats.tau > 1.5 for a in alone if a.stats.method != "ar") >= 3  # drafts got accepted
    assert any(a.finish_reason == "stop" for a in alone)  # a stop string ended a request


def test_lm_head_over_visited_nodes_or_all_nodes_gives_the_same_outputs(engine, prompts, monkeypatch):
    """The verifier's two ways to take the LM head (each row's current node a depth, or every node at
    once) give the same tokens, finish reasons and logprobs, greedy and seeded, on the mixed batch."""
    requests = list(zip(prompts, SPECS, strict=True))
    runs, walked = [], []
    visit = Verifier.visit_nodes
    monkeypatch.setattr(
        Verifier, "visit_nodes", lambda self, *a, **k: walked.append(visit(self, *a, **k)) or walked[-1]
    )
    for floor in (1, 10**9):  # 1: walk when the trees have more nodes than levels; 10^9: never
        monkeypatch.setattr(engine.runner, "head_floor_rows", floor)
        walked.clear()
        runs.append(list(run_batch(engine, requests).values()))
        assert any(walked) == (floor == 1)  # chains (as many levels as nodes) never walk
    for spec, walk, whole in zip(SPECS, *runs, strict=True):
        assert walk["tokens"] == whole["tokens"] and walk["finish"] == whole["finish"], spec
        assert_same_logprobs(walk["logprobs"], whole["logprobs"])


def test_requests_added_mid_decode_and_aborted_leave_the_others_unchanged(engine, prompts):
    specs = SPECS[:6]
    alone = [solo(engine, p, spec) for p, spec in zip(prompts[:6], specs, strict=True)]
    tokens: dict[str, list[int]] = {}
    ids = []
    for prompt, spec in zip(prompts[:3], specs[:3], strict=True):
        ids.append(engine.add_request(prompt, spec.params, method=spec.method, budget=spec.budget))
    doomed = engine.add_request(prompts[7], SPECS[7].params, method="ddtree")
    steps = aborted = 0
    while engine.has_unfinished_requests():
        if steps == 3:  # the first requests are mid-decode: three more join, one is aborted
            assert engine.abort(doomed)
            for prompt, spec in zip(prompts[3:6], specs[3:], strict=True):
                ids.append(
                    engine.add_request(
                        prompt, spec.params, method=spec.method, budget=spec.budget, topk=spec.topk
                    )
                )
        for delta in engine.step():
            if delta.request_id == doomed and steps >= 3:  # as vLLM: one last delta, "abort", no tokens
                assert delta.finish_reason == "abort" and not delta.token_ids
                aborted += 1
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
        steps += 1
    assert aborted == 1
    assert not engine.abort(doomed)  # gone for good
    assert [tokens[i] for i in ids] == [a.token_ids for a in alone]


def test_request_over_the_kv_capacity_fails_alone_before_it_starts(engine, prompts):
    spec = SPECS[0]
    expected = solo(engine, prompts[0], spec).token_ids
    engine.add_request(prompts[0], spec.params, method=spec.method, budget=spec.budget)
    with pytest.raises(DDTreeError, match="exceeds the context of 2048 tokens"):
        engine.add_request(prompts[1], SamplingParams(max_new_tokens=2048 - 299))
    assert engine.num_waiting == 1
    got = []
    while engine.has_unfinished_requests():
        got += [t for d in engine.step() for t in d.token_ids]
    assert got == expected


def test_batch_never_holds_more_rows_than_max_batch_size():
    engine = Engine.from_pretrained(max_batch_size=3, max_model_len=256)
    for i in range(7):
        engine.add_request([5 + i, 9, 11], SamplingParams(max_new_tokens=6, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        engine.step()
        seen.append((engine.num_running, engine.num_waiting))
    assert max(running for running, _ in seen) == 3
    assert seen[0] == (3, 4)


def test_a_prefill_step_holds_at_most_max_num_batched_tokens_and_longer_prompts_are_chunked():
    # Off: the repeated prompts would hit the prefix cache and prefill only their last tokens
    engine = Engine.from_pretrained(max_num_batched_tokens=64, max_model_len=512, enable_prefix_caching=False)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for _ in range(5):
        engine.add_request(list(range(2, 22)), params)  # 20 tokens: three fit in 64
    long_id = engine.add_request(list(range(2, 202)), params)  # longer than the bound: chunked
    prefill = engine.runner.prefill
    steps = []

    def spy(chunks, tables, **options):
        steps.append([len(ids) for ids, _ in chunks])
        return prefill(chunks, tables, **options)

    engine.runner.prefill = spy
    results = {}
    while engine.has_unfinished_requests():
        results.update((d.request_id, d) for d in engine.step())
    assert all(len(s) * max(s) <= 64 for s in steps)
    assert steps[:2] == [[20, 20, 20], [20, 20, 20]]  # the long prompt's first chunk is cut to the rows'
    assert sum(sum(s) for s in steps) == 5 * 20 + 200  # every prompt token prefilled once
    assert len(steps) >= 2 + 180 // 64  # the rest of the long prompt, in chunks of at most 64
    assert results[long_id].finish_reason == "length"
