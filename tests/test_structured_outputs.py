"""Structured outputs through the draft tree: every node's target distribution is the grammar-masked one,
so constrained ``ddtree`` and ``dflash`` emit exactly constrained plain decoding's tokens, whatever the
budget and whoever shares the batch, and every output matches its constraint."""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import replace

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import tests.test_sampling_lossless as lossless
from ddtree import Engine, SamplingParams
from ddtree.errors import DDTreeError
from ddtree.request.params import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
REGEX = r"def [a-z_]{1,12}\((x|n)\):"
CHOICES = ("yes", "no", "maybe so")
CONSTRAINTS = {
    "json": StructuredOutputs.of_schema(SCHEMA),
    "regex": StructuredOutputs(regex=REGEX),
    "choice": StructuredOutputs(choice=CHOICES),
}
PROMPTS = ["def fibonacci(n):", "class Stack:", "import os"]


@pytest.fixture(scope="module")
def engine() -> Engine:
    # float32: the oracle is HF's own uncached forward, and in bf16 (what dtype auto picks on a CPU with
    # native bf16) its kernels and the engine's break near-ties differently
    return Engine.from_pretrained(max_num_seqs=16, budget=16, dtype=torch.float32)


def check(kind: str, text: str, finished: bool = True) -> None:
    """A finished text matches its constraint (the stop token ended it). One cut by max_new_tokens is a
    prefix of a match: JSON allows any whitespace, and a model may spend its tokens on it."""
    if not finished:
        return
    if kind == "json":
        value = json.loads(text)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int), text
        assert isinstance(value["name"], str) and len(value["name"]) <= 12, text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def run(engine: Engine, specs: list[tuple[str, SamplingParams, str, int | None]]) -> list[str]:
    """All the requests in one batch; their texts in order."""
    ids = [engine.add_request(p, params, method=m, budget=b) for p, params, m, b in specs]
    texts = dict.fromkeys(ids, "")
    while engine.has_unfinished_requests():
        for delta in engine.step():
            texts[delta.request_id] += delta.text
    return [texts[i] for i in ids]


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_ddtree_and_dflash_emit_constrained_plain_decodings_tokens_at_every_budget(engine, kind):
    params = SamplingParams(max_new_tokens=48, structured_outputs=CONSTRAINTS[kind])
    results = [engine.generate(p, params, method="ar") for p in PROMPTS]
    for r in results:
        check(kind, r.text, r.finish_reason == "stop")
    assert sum(r.finish_reason == "stop" for r in results) >= 2  # the checks above checked something
    reference = [r.token_ids for r in results]
    for method, budget in (("dflash", None), ("ddtree", 1), ("ddtree", 16), ("ddtree", 64)):
        got = [engine.generate(p, params, method=method, budget=budget).token_ids for p in PROMPTS]
        assert got == reference, (method, budget)


def test_a_grammar_that_starts_after_a_marker_leaves_the_text_before_it_free(engine, monkeypatch):
    """``start_after`` (a reasoning parser's end of thinking): free text up to the marker's first run, the
    constraint after it; the run may end anywhere in a draft tree, and every method agrees with ``ar``."""
    from ddtree.request.grammar import GrammarState

    started_in_trees = []
    walk = GrammarState.tree_masks

    def spy(self, tokens, parents):
        masks = walk(self, tokens, parents)
        if self.waiting_for:  # trees in which the marker's run ends at some node: masked below it
            started_in_trees.append(bool((masks != -1).any()))
        return masks

    monkeypatch.setattr(GrammarState, "tree_masks", spy)
    for prompt in PROMPTS:
        free = engine.generate(prompt, SamplingParams(max_new_tokens=48), method="ar").token_ids
        marker = tuple(free[2:4])  # a two-token run the model writes by itself, first at position 2
        assert all(tuple(free[i : i + 2]) != marker for i in range(2))
        spec = replace(CONSTRAINTS["regex"], start_after=marker)
        params = SamplingParams(max_new_tokens=48, structured_outputs=spec)
        reference = engine.generate(prompt, params, method="ar")
        assert reference.token_ids[:4] == free[:4] and reference.finish_reason == "stop"
        check("regex", engine.tokenizer.decode(reference.token_ids[4:], skip_special_tokens=True))
        for method, budget in (("dflash", None), ("ddtree", 16), ("ddtree", 64)):
            got = engine.generate(prompt, params, method=method, budget=budget).token_ids
            assert got == reference.token_ids, (prompt, method, budget)
    assert any(started_in_trees)  # the grammar started inside a draft tree, not only between rounds


def test_constrained_and_free_requests_share_a_batch_and_each_gets_its_solo_output(engine):
    free = SamplingParams(max_new_tokens=24)
    specs = []
    for i, kind in enumerate(CONSTRAINTS):
        params = SamplingParams(max_new_tokens=48, structured_outputs=CONSTRAINTS[kind])
        specs.append((PROMPTS[i], params, "ddtree", 16))
        specs.append((PROMPTS[i], free, "ddtree", 16))
    seeded = SamplingParams(
        temperature=0.8, seed=5, max_new_tokens=48, structured_outputs=CONSTRAINTS["json"]
    )
    specs.append((PROMPTS[0], seeded, "ddtree", 16))
    batched = run(engine, specs)
    solo = [run(engine, [spec])[0] for spec in specs]
    assert batched == solo
    unconstrained = [engine.generate(p, free, method="ar").text for p in PROMPTS]
    assert batched[1::2][:3] == unconstrained  # the free rows: plain decoding, untouched by the masks
    for kind, text in zip(CONSTRAINTS, batched[0::2], strict=False):
        check(kind, text, finished=kind != "json" or text.endswith("}"))


def test_seeded_samples_match_their_constraint_and_repeat(engine):
    configs = (("ar", None), ("dflash", None), ("ddtree", 1), ("ddtree", 16), ("ddtree", 64))
    # Sampled JSON under any_whitespace mostly spends its tokens on whitespace (newlines are likely here)
    compact = CONSTRAINTS | {"json": StructuredOutputs.of_schema(SCHEMA, disable_any_whitespace=True)}
    for kind, spec in compact.items():
        finished = 0
        # Seeds 5..9: three of their JSON samples close within 48 tokens (the integer may run long)
        for seed, (method, budget) in enumerate(configs, start=5):
            params = SamplingParams(
                temperature=1.0, top_p=0.95, seed=seed, max_new_tokens=48, structured_outputs=spec
            )
            prompt = PROMPTS[seed % len(PROMPTS)]
            first = engine.generate(prompt, params, method=method, budget=budget)
            check(kind, first.text, first.finish_reason == "stop")
            finished += first.finish_reason == "stop"
            if budget == 16:
                assert engine.generate(prompt, params, method=method, budget=budget).text == first.text
        assert finished >= 2, kind  # the checks above checked whole outputs


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            lambda: StructuredOutputs(json='{"type": "object", "properties": 5}'),
            "invalid structured-output json",
        ),
        (lambda: StructuredOutputs(regex="(unclosed"), "invalid structured-output regex"),
    ],
)
def test_a_constraint_that_cannot_compile_fails_add_request_in_one_line_and_nothing_else(
    engine, spec, message
):
    other = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=4))
    with pytest.raises(DDTreeError, match=message) as info:
        engine.add_request(PROMPTS[1], SamplingParams(structured_outputs=spec()))
    assert "\n" not in str(info.value)
    assert engine.scheduler.find(other) is not None and engine.num_waiting == 1
    while engine.has_unfinished_requests():
        engine.step()


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token a character, a..f (f the end of text), for the 6-token target of the sampling tests."""
    model = Tokenizer(models.WordLevel({c: i for i, c in enumerate("abcdef")}, unk_token="a"))
    model.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=model, eos_token="f")


@torch.inference_mode()
def masked_law(target, params: SamplingParams, allowed: list[set[int]]) -> np.ndarray:
    """p(a, b, c) with each step's logits restricted to ``allowed[step]`` before the sampling filters."""
    law = torch.ones(1, dtype=torch.float64)
    for depth in range(lossless.NEW_TOKENS):
        prefixes = itertools.product(range(lossless.VOCAB), repeat=depth)
        ids = torch.tensor([lossless.PROMPT + list(p) for p in prefixes])  # [V^depth, P + depth]
        logits = target(input_ids=ids).logits[:, -1].double()  # [V^depth, V]
        forbidden = [t for t in range(lossless.VOCAB) if t not in allowed[depth]]
        logits[:, forbidden] = -torch.inf
        law = (law[:, None] * lossless.hf_probs(logits, params)).flatten()
    return (law / law.sum()).numpy()


def test_sampled_ddtree_follows_the_grammar_masked_target_distribution():
    """A G-test: 3-token continuations of the sampling tests' 6-token target under the regex
    [ab][a-d][bce], sampled through trees (budget 4 of a random drafter: mostly forbidden nodes, some
    accepted) and batched with free companions, against the law enumerated with each step masked."""
    target, drafter = lossless.build_models()
    engine = Engine(target, drafter, tokenizer=char_tokenizer(), budget=lossless.BUDGET, max_num_seqs=128)
    spec = StructuredOutputs(regex="[ab][a-d][bce]")
    params = replace(lossless.SETTINGS["T=1"], structured_outputs=spec)
    draws = lossless.draw(engine, "ddtree", params, lossless.N_FAST, seed=11, batch=128)
    law = masked_law(target, params, [{0, 1}, {0, 1, 2, 3}, {1, 2, 4}])
    chi2_p, g_p = lossless.fit_p_values(draws.counts, law)
    print(f"ddtree under a regex n={lossless.N_FAST}: chi-square p={chi2_p:.3g} G-test p={g_p:.3g}")
    assert draws.multi_token_rounds > 0  # drafted nodes were accepted under the masks
    assert chi2_p > lossless.P_PASS and g_p > lossless.P_PASS, (chi2_p, g_p)
