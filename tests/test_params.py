"""The one place each request option is checked: method, budget, topk, acceptance thresholds, and tau."""

from __future__ import annotations

import math

import pytest

from ddtree.errors import DDTreeError
from ddtree.params import METHODS, check_accept_thresholds, check_speculative_options
from ddtree.stats import mean_acceptance_length


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
