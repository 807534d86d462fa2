"""Logprobs come from the target's own distribution, for tokens accepted from the tree and for the bonus."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.request.params import SamplingParams

PROMPT = [1, 5, 9, 22, 3]


def teacher_forced_logprobs(target, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """log p(token_i | prompt, tokens_<i) from one plain forward: [len(tokens), V]."""
    with torch.inference_mode():
        logits = target(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_a_plain_forward_at_every_emitted_position(pair, temperature):
    target, drafter = pair
    engine = Engine(target, drafter, method="ddtree", budget=64)
    params = SamplingParams(temperature=temperature, max_new_tokens=30, seed=5, logprobs=3)
    result = engine.generate(PROMPT, params)
    assert any(n > 1 for n in result.stats.acceptance_lengths)  # some tokens came from the tree
    reference = teacher_forced_logprobs(target, PROMPT, result.token_ids)
    assert [lp.token for lp in result.logprobs] == result.token_ids
    chosen = torch.tensor([lp.logprob for lp in result.logprobs])
    torch.testing.assert_close(
        chosen, reference.gather(1, torch.tensor(result.token_ids)[:, None])[:, 0], atol=1e-4, rtol=0
    )
    for lp, row in zip(result.logprobs, reference, strict=True):
        top = row.topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in lp.top]), top.values, atol=1e-4, rtol=0)


def test_logprobs_do_not_depend_on_the_method(pair):
    target, drafter = pair
    params = SamplingParams(max_new_tokens=20, logprobs=0)
    results = [
        Engine(target, drafter, method=m, budget=32).generate(PROMPT, params)
        for m in ("ar", "dflash", "ddtree")
    ]
    for other in results[1:]:
        assert other.token_ids == results[0].token_ids
        a = torch.tensor([lp.logprob for lp in results[0].logprobs])
        b = torch.tensor([lp.logprob for lp in other.logprobs])
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        assert all(lp.top == [] for lp in other.logprobs)


def test_logprobs_are_off_by_default_and_bounded(pair):
    target, drafter = pair
    assert Engine(target, drafter).generate(PROMPT, SamplingParams(max_new_tokens=5)).logprobs == []
    with pytest.raises(DDTreeError, match="logprobs"):
        SamplingParams(logprobs=21)
