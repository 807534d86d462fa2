"""The one place each request option is checked: method, budget, topk, acceptance thresholds, sampling
values' bounds, and tau."""

from __future__ import annotations

import math

import pytest

from ddtree.errors import DDTreeError
from ddtree.request.params import (
    LOGIT_BIAS_RANGE,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    METHODS,
    PENALTY_RANGE,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
    StructuredOutputs,
    check_accept_thresholds,
    check_speculative_options,
)
from ddtree.request.stats import mean_acceptance_length


def test_speculative_options_pass_through_when_valid() -> None:
    for method in METHODS:
        assert check_speculative_options(method, 16, None) == (method, 16, None)
    assert check_speculative_options("ddtree", 1, 1) == ("ddtree", 1, 1)


@pytest.mark.parametrize(
    "method, budget, topk, message",
    [
        ("tree", 16, None, "unknown method 'tree'; choose one of ddtree, dflash, ar"),
        ("ddtree", 0, None, "budget must be an integer >= 1 or 'auto', got 0"),
        ("ddtree", True, None, "budget must be an integer >= 1 or 'auto', got True"),
        ("ddtree", 2.0, None, "budget must be an integer >= 1 or 'auto', got 2.0"),
        ("ddtree", 16, 0, "topk must be an integer >= 1, got 0"),
        ("ddtree", 16, False, "topk must be an integer >= 1, got False"),
    ],
)
def test_speculative_options_refused_with_one_message(method, budget, topk, message) -> None:
    with pytest.raises(DDTreeError) as err:
        check_speculative_options(method, budget, topk)
    assert str(err.value) == message


@pytest.mark.parametrize("single, acc", [(1, 1), (0, 0), (0.0, 1.0), (0.5, 0.25)])
def test_thresholds_accept_sglangs_whole_domain(single, acc) -> None:
    assert check_accept_thresholds(single, acc) == (float(single), float(acc))


@pytest.mark.parametrize("bad", [-0.1, 1.5, math.nan, math.inf, "1", True, None])
def test_thresholds_outside_unit_interval_are_refused(bad) -> None:
    with pytest.raises(DDTreeError, match="accept_threshold_single must be a number in \\[0, 1\\]"):
        check_accept_thresholds(bad, 1.0)
    with pytest.raises(DDTreeError, match="accept_threshold_acc must be a number in \\[0, 1\\]"):
        check_accept_thresholds(1.0, bad)


def test_tau_is_the_mean_acceptance_length_and_zero_without_rounds() -> None:
    assert mean_acceptance_length([1, 2, 6]) == 3.0
    assert mean_acceptance_length([]) == 0.0


def test_sampling_values_at_their_bounds_are_accepted() -> None:
    SamplingParams(temperature=MAX_TEMPERATURE, top_k=MAX_TOP_K, seed=-(2**63))
    SamplingParams(presence_penalty=PENALTY_RANGE[0], frequency_penalty=PENALTY_RANGE[1], seed=2**64 - 1)
    for rep in REPETITION_PENALTY_RANGE:
        SamplingParams(repetition_penalty=rep, logit_bias=dict.fromkeys((0, 7), LOGIT_BIAS_RANGE[0]))
    SamplingParams(logit_bias={1: LOGIT_BIAS_RANGE[1]}, stop=("\U0001f600",), bad_words=("²١",))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"temperature": 1e300}, "temperature must be a number in [0, 1e+06], got 1e+300"),
        ({"temperature": math.inf}, "temperature must be a number in [0, 1e+06], got inf"),
        ({"top_k": 2**63 - 1}, f"top_k must be an integer in [0, {MAX_TOP_K}] (0 disables it)"),
        ({"top_k": -1}, "top_k must be an integer in [0, "),
        ({"repetition_penalty": 1e-300}, "repetition_penalty must be a finite number > 0 in [0.01, 100]"),
        ({"repetition_penalty": 1e300}, "repetition_penalty must be a finite number > 0 in [0.01, 100]"),
        ({"repetition_penalty": math.nan}, "repetition_penalty must be a finite number > 0 in [0.01, 100]"),
        (
            {"logit_bias": {3: 1e39}},
            "logit_bias values must be finite, in [-100, 100], got 1e+39 for token 3",
        ),
        ({"logit_bias": {3: 100.5}}, "logit_bias values must be finite, in [-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias keys must be token ids >= 0, got -1"),
        ({"seed": 2**64}, "seed must be an integer in [-2**63, 2**64)"),
        ({"seed": -(2**63) - 1}, "seed must be an integer in [-2**63, 2**64)"),
        ({"stop": ("ok", "a\ud800")}, "stop[1] is not valid Unicode text: a lone surrogate at character 1"),
        (
            {"bad_words": ("\udfff",)},
            "bad_words[0] is not valid Unicode text: a lone surrogate at character 0",
        ),
    ],
)
def test_sampling_values_float32_or_the_tokenizer_cannot_take_are_refused(options, message) -> None:
    """Each bound keeps a value the engine could not use from entering (docs/inputs.md)."""
    with pytest.raises(DDTreeError) as err:
        SamplingParams(**options)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_constraint_that_is_not_unicode_text_is_refused() -> None:
    with pytest.raises(DDTreeError, match="structured outputs' choice\\[1\\] is not valid Unicode text"):
        StructuredOutputs(choice=("yes", "n\ud800"))
    with pytest.raises(DDTreeError, match="structured outputs' regex is not valid Unicode text"):
        StructuredOutputs(regex="[a-z]\udc00")
