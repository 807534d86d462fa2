"""Penalties and biases through the draft tree: every node's logits are penalised from the request's
output plus the node's own path, so penalised ``ddtree`` and ``dflash`` emit exactly penalised plain
decoding's tokens (greedy) and its law (sampled), whatever the budget and whoever shares the batch."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch

import tests.test_sampling_lossless as lossless
from ddtree import Engine, SamplingParams
from ddtree.errors import DDTreeError
from ddtree.request.penalties import RequestPenalties
from tests.conftest import real_size_models

PROMPTS = ["def fibonacci(n):", "class Stack:", "import os"]
NEW = 40


@pytest.fixture(scope="module")
def engine() -> Engine:
    # float32: the oracle is HF's own uncached forward, and in bf16 (what dtype auto picks on a CPU with
    # native bf16) its kernels and the engine's break near-ties differently
    return Engine.from_pretrained(max_num_seqs=16, budget=16, dtype=torch.float32)


def penalties_of(engine: Engine, params: SamplingParams, prompt_ids: list[int]) -> RequestPenalties:
    vocab = engine.runner.lm_head.weight.shape[0]
    return RequestPenalties.of(params, prompt_ids, engine.eos_token_ids, engine.tokenizer, vocab)


def penalise(logits: torch.Tensor, pen: RequestPenalties, output: list[int]) -> torch.Tensor:
    """One step of plain penalised decoding, token by token (the oracle): logits [V] after ``output``."""
    logits = logits.clone()
    for seq in pen.bad_sequences:
        if output[len(output) - len(seq) + 1 :] == list(seq[:-1]):
            logits[seq[-1]] = -torch.inf
    for token, bias in pen.bias:
        logits[token] += bias
    if len(output) < pen.min_tokens:
        logits[list(pen.held_back)] = -torch.inf
    counts = Counter(output)
    for token in set(pen.prompt_ids.tolist()) | set(output):
        if pen.repetition != 1.0:
            x = logits[token]
            logits[token] = x / pen.repetition if x > 0 else x * pen.repetition
    for token, count in counts.items():
        logits[token] = logits[token] - pen.frequency * count
        logits[token] = logits[token] - pen.presence
    return logits


@torch.inference_mode()
def plain_penalised_greedy(engine: Engine, prompt: str, params: SamplingParams) -> list[int]:
    """Greedy decoding with the target's own HF forward and the penalties applied as written above."""
    ids = engine.encode(prompt)
    pen = penalties_of(engine, params, ids)
    stops = set(params.stop_token_ids) | set(engine.eos_token_ids)
    out: list[int] = []
    while len(out) < params.max_new_tokens:
        logits = engine.target(input_ids=torch.tensor([ids + out])).logits[0, -1].float()
        token = int(penalise(logits, pen, out).argmax())
        out.append(token)
        if token in stops:
            break
    return out


CASES = {
    "frequency+presence": SamplingParams(max_new_tokens=NEW, frequency_penalty=0.8, presence_penalty=0.5),
    "repetition": SamplingParams(max_new_tokens=NEW, repetition_penalty=1.4),
    "logit_bias": SamplingParams(max_new_tokens=NEW, logit_bias={271: -100.0, 13: 2.0}),
    "min_tokens": SamplingParams(max_new_tokens=NEW, stop_token_ids=(271,), min_tokens=12),
    "bad_words": SamplingParams(max_new_tokens=NEW, bad_words=("Return", "path, os")),
    "all": SamplingParams(
        max_new_tokens=NEW,
        frequency_penalty=0.3,
        presence_penalty=-0.2,
        repetition_penalty=1.2,
        logit_bias={25: 1.5},
        min_tokens=12,
        bad_words=("self",),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_ddtree_and_dflash_emit_penalised_plain_decodings_tokens_at_every_budget(engine, case):
    params = CASES[case]
    reference = [plain_penalised_greedy(engine, p, params) for p in PROMPTS]
    plain = [r.token_ids for r in engine.generate(PROMPTS, SamplingParams(max_new_tokens=NEW), method="ar")]
    assert reference != plain  # the penalty changes what plain decoding says
    for method, budget in (("ar", None), ("dflash", None), ("ddtree", 1), ("ddtree", 16), ("ddtree", 64)):
        # the prompts as one batch (a row's output is its solo run's: tested below and in test_engine_batch)
        got = [r.token_ids for r in engine.generate(PROMPTS, params, method=method, budget=budget)]
        assert got == reference, (method, budget)


def test_min_tokens_and_bad_words_hold(engine):
    short = engine.generate("x = 1", SamplingParams(max_new_tokens=NEW, stop=["\n"]))
    assert short.finish_reason == "stop" and len(short.token_ids) < 10  # a stop string ends it early...
    held = engine.generate("x = 1", SamplingParams(max_new_tokens=NEW, stop=["\n"], min_tokens=10))
    assert held.finish_reason == "stop" and len(held.token_ids) >= 10  # ... but not before min_tokens
    for words in (("Return",), ("path, os",)):
        for prompt in PROMPTS:
            text = engine.generate(prompt, SamplingParams(max_new_tokens=NEW, bad_words=words)).text
            assert words[0] not in text, (prompt, text)
    free = [engine.generate(p, SamplingParams(max_new_tokens=NEW)).text for p in PROMPTS]
    assert "Return" in free[0] and "path, os" in free[2]  # the bans above had something to ban


def test_penalised_and_free_requests_share_a_batch_and_each_gets_its_solo_output(engine):
    specs = []
    for i, case in enumerate(CASES):
        specs.append((PROMPTS[i % 3], CASES[case], "ddtree"))
        specs.append((PROMPTS[i % 3], SamplingParams(max_new_tokens=24), "ddtree"))
    specs.append((PROMPTS[0], replace(CASES["all"], temperature=0.8, seed=3), "ddtree"))
    specs.append((PROMPTS[1], replace(CASES["repetition"], temperature=1.0, top_p=0.9, seed=4), "dflash"))
    ids = [engine.add_request(p, params, method=m) for p, params, m in specs]
    tokens = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            tokens[delta.request_id] += delta.token_ids
    solo = [engine.generate(p, params, method=m).token_ids for p, params, m in specs]
    assert [tokens[i] for i in ids] == solo


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"frequency_penalty": 2.5}, "frequency_penalty must be a number in [-2, 2]"),
        ({"presence_penalty": float("nan")}, "presence_penalty must be a number in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"logit_bias": {5: float("inf")}}, "logit_bias values must be finite"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias maps token ids to numbers"),
        ({"min_tokens": 200}, "min_tokens must be an integer in [0, max_new_tokens=128]"),
        ({"bad_words": ("",)}, "bad_words must be non-blank strings"),
    ],
)
def test_bad_penalties_are_one_line_errors(options, message):
    with pytest.raises(DDTreeError) as info:
        SamplingParams(**options)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_bias_outside_the_vocabulary_fails_add_request_and_nothing_else(engine):
    other = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4))
    with pytest.raises(DDTreeError, match="logit_bias names token 10000000, outside the vocabulary"):
        engine.add_request(PROMPTS[1], SamplingParams(logit_bias={10_000_000: 1.0}))
    assert engine.scheduler.find(other) is not None and engine.num_waiting == 1
    while engine.has_unfinished_requests():
        engine.step()


def test_bad_words_are_tokenized_as_vllm_does(engine):
    pen = penalties_of(engine, SamplingParams(bad_words=("return", "  path, os")), [])
    tok = engine.tokenizer
    plain, spaced = (tok.encode(w, add_special_tokens=False) for w in ("return", " return"))
    assert len(plain) == len(spaced) == 1  # single tokens: banned everywhere, both spellings
    assert dict(pen.bias) == {plain[0]: -np.inf, spaced[0]: -np.inf}
    assert tuple(tok.encode("path, os", add_special_tokens=False)) in pen.bad_sequences
    assert all(len(s) > 1 for s in pen.bad_sequences)


@torch.inference_mode()
def penalised_law(target, params: SamplingParams, pen: RequestPenalties) -> np.ndarray:
    """p(a, b, c) of the sampling tests' 6-token target with each step penalised after its prefix."""
    law = torch.ones(1, dtype=torch.float64)
    for depth in range(lossless.NEW_TOKENS):
        prefixes = list(itertools.product(range(lossless.VOCAB), repeat=depth))
        ids = torch.tensor([lossless.PROMPT + list(p) for p in prefixes])  # [V^depth, P + depth]
        logits = target(input_ids=ids).logits[:, -1].float()  # [V^depth, V]
        logits = torch.stack([penalise(row, pen, list(p)) for row, p in zip(logits, prefixes, strict=True)])
        law = (law[:, None] * lossless.hf_probs(logits, params)).flatten()
    return (law / law.sum()).numpy()


def test_sampled_ddtree_follows_the_penalised_target_distribution():
    """A G-test: 3-token continuations of the 6-token target under frequency, presence and repetition
    penalties (the prompt holds five of the six tokens), sampled through trees and batched with free
    companions, against the law enumerated with each step penalised after its own prefix."""
    target, drafter = lossless.build_models()
    engine = Engine(target, drafter, budget=lossless.BUDGET, max_num_seqs=128)
    params = replace(
        lossless.SETTINGS["T=1"], frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.5
    )
    pen = RequestPenalties.of(params, lossless.PROMPT, frozenset(), None, lossless.VOCAB)
    draws = lossless.draw(engine, "ddtree", params, lossless.N_FAST, seed=13, batch=128)
    law = penalised_law(target, params, pen)
    free = penalised_law(target, params, RequestPenalties(0.0, 0.0, 1.0, (), 0, (), ()))
    assert np.abs(law - free).sum() > 0.2  # the penalties move the law a long way
    chi2_p, g_p = lossless.fit_p_values(draws.counts, law)
    print(f"ddtree with penalties n={lossless.N_FAST}: chi-square p={chi2_p:.3g} G-test p={g_p:.3g}")
    assert draws.multi_token_rounds > 0  # drafted nodes were accepted under the penalties
    assert chi2_p > lossless.P_PASS and g_p > lossless.P_PASS, (chi2_p, g_p)
    assert lossless.fit_p_values(draws.counts, free)[1] < lossless.P_BROKEN  # and the test can tell


def test_penalties_at_a_real_vocabulary_keep_ddtree_equal_to_plain_decoding(tmp_path):
    """Qwen3-0.6B's shapes (vocabulary 151,936, GQA, head_dim 128; two random layers, float32 so that no
    near-tie decides): every node's counts are gathered and scattered at the real width."""
    target_dir, drafter_dir = real_size_models(tmp_path, layers=2)
    engine = Engine.from_pretrained(target_dir, drafter_dir, dtype=torch.float32, max_model_len=512)
    prompts = ["w5 w17 w300 w5 w17", "w9 w9 w9 w1000"]
    params = SamplingParams(
        max_new_tokens=8, frequency_penalty=1.0, repetition_penalty=1.5, min_tokens=4, logit_bias={7: 3.0}
    )
    reference = [r.token_ids for r in engine.generate(prompts, params, method="ar")]
    assert reference != [r.token_ids for r in engine.generate(prompts, SamplingParams(max_new_tokens=8))]
    got = [r.token_ids for r in engine.generate(prompts, params, method="ddtree", budget=64)]
    assert got == reference
