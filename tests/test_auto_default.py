"""Never slower than plain decoding: budget "auto" is the default, turns drafting off where it does not pay
(saying why, once) and keeps it on where it does; whatever it picks, the output is plain decoding's."""

from __future__ import annotations

import json
import logging
import re

import numpy as np
import pytest
import torch

from ddtree.bench.cli import DEFAULT_BUDGETS
from ddtree.cli import build_parser, main
from ddtree.engine import Engine
from ddtree.engine.auto_budget import AUTO_MAX_BACKOFF, AutoRound
from ddtree.engine.verifier import Verdicts
from ddtree.request.params import AUTO, SamplingParams
from ddtree.speculative.budget import (
    AcceptanceCalibration,
    CostModel,
    LinearCost,
    rate_upper,
    tree_acceptance,
)
from ddtree.speculative.tree import TreeBatch
from tests.conftest import tiny_drafter, tiny_target

BIG_VOCAB = 2048  # a random drafter's first token matches the target's about once in this many rounds


def test_auto_is_the_default_budget_of_the_engine_and_every_command():
    engine = Engine(*(lambda t: (t, tiny_drafter(t)))(tiny_target()))
    assert engine.config.budget == AUTO
    for command in (["generate", "x"], ["serve"]):
        assert build_parser().parse_args(command).budget == AUTO
    assert DEFAULT_BUDGETS.split(",")[0] == AUTO


def test_a_drafter_that_is_never_accepted_settles_on_plain_rounds_warns_once_and_equals_ar(caplog):
    target = tiny_target(vocab=BIG_VOCAB)
    engine = Engine(target, tiny_drafter(target))  # random weights: its drafts are not the target's
    prompt, params = list(range(3, 11)), SamplingParams(max_new_tokens=240)
    with caplog.at_level(logging.DEBUG, logger="ddtree"):
        result = engine.generate(prompt, params)
    plain = engine.generate(prompt, params, method="ar")
    assert result.token_ids == plain.token_ids
    drafted = np.array(result.stats.drafted_nodes) > 0
    # Stretches of plain rounds double (1, 2, 4, ...) while probes fail: a few dozen drafting rounds at
    # most, none of them after the first quarter but the probes.
    assert drafted.sum() <= 24 and drafted[len(drafted) // 4 :].sum() <= 4, result.stats.drafted_nodes
    status = result.stats.auto
    assert not status.drafting and status.first_drafts >= 4 and status.first_draft_acceptance < 0.1
    # One row's few first drafts (about ten in 240 tokens) are no proof that the drafter does not fit: the
    # reason says what was measured, a pause is logged at debug level, and a warning comes once the probes
    # have failed for a whole doubling.
    assert status.reason.startswith("drafting does not pay here") and "0 of " in status.reason
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "does not pay" in warned[0], warned  # once, not every round
    assert any(r.levelno == logging.DEBUG and "budget auto" in r.getMessage() for r in caplog.records)
    # The next request starts in the stretch: it probes, it does not draft from its first round.
    again = engine.generate(list(range(20, 28)), SamplingParams(max_new_tokens=60))
    assert sum(n > 0 for n in again.stats.drafted_nodes) <= 2


@pytest.mark.parametrize(
    ("params", "blames"),
    [
        (SamplingParams(max_new_tokens=64), "trained for this target"),
        (SamplingParams(temperature=1.0, seed=0, max_new_tokens=64), "sampling settings"),
    ],
)
def test_a_batch_of_missed_first_drafts_says_the_drafts_are_rarely_accepted_and_whom_to_blame(
    caplog, params, blames
):
    """Eight rows give the evidence one row takes hundreds of rounds to gather: dozens of first drafts, none
    the target's, put the rate's upper confidence bound under 0.1. Greedy rows blame the drafter; sampled
    rows, whose rare acceptance may be the target's own entropy at their settings, blame the settings."""
    target = tiny_target(vocab=BIG_VOCAB)
    engine = Engine(target, tiny_drafter(target))
    prompts = [list(range(3 + i, 11 + i)) for i in range(8)]
    with caplog.at_level(logging.WARNING, logger="ddtree"):
        results = engine.generate(prompts, params)
    status = engine.auto.status
    assert not status.drafting and status.first_drafts >= 37 and status.first_drafts_accepted == 0
    assert status.reason.startswith("drafts are rarely accepted") and blames in status.reason
    said = [r.getMessage() for r in caplog.records if "rarely accepted" in r.getMessage()]
    assert len(said) == 1, said
    other = "sampling settings" if blames == "trained for this target" else "trained for this target"
    assert other not in status.reason
    if params.greedy:
        assert [r.token_ids for r in results] == [r.token_ids for r in engine.generate(prompts, params, "ar")]


def test_the_rarely_accepted_bound_is_seldom_below_the_true_rate():
    """``rate_upper`` at z = 2 is an upper confidence bound: for a drafter accepted at exactly the threshold
    (0.1), a verdict that the rate is below it comes in about 2% of runs of any length, never in most (as
    the rate alone did: 1 of 15 first drafts is 0.07). A bound of the rate itself fails this."""
    rng = np.random.default_rng(0)
    for trials in (4, 15, 40, 64):
        hits = rng.binomial(trials, 0.1, size=20_000)
        wrong = np.mean([rate_upper(int(h), trials, 2.0) < 0.1 for h in hits])
        assert wrong < 0.05, (trials, wrong)
    assert rate_upper(1, 15, 2.0) > 0.1 and rate_upper(0, 64, 2.0) < 0.1


def test_stretches_grow_past_the_doubling_cap_while_a_probe_costs_more_than_two_percent():
    target = tiny_target(vocab=BIG_VOCAB)
    probe_costs_50_rounds = CostModel(
        verify=LinearCost(fixed=1e-3), draft=LinearCost(fixed=5e-2), overhead=LinearCost(), frozen=True
    )
    engine = Engine(target, tiny_drafter(target), cost_model=probe_costs_50_rounds)
    engine.auto._backoff["greedy"] = AUTO_MAX_BACKOFF  # as after a long run of failed probes
    engine.auto.status.drafting = False
    engine.generate(list(range(3, 11)), SamplingParams(max_new_tokens=4))  # its first round probes
    assert engine.auto._backoff["greedy"] == 2 * AUTO_MAX_BACKOFF
    assert engine.scheduler.auto_skip["greedy"] >= 2 * AUTO_MAX_BACKOFF - 3


def test_when_drafting_does_not_pay_the_reason_gives_the_measured_acceptance_not_one_rounds_guess():
    """The built-in pair with a drafter pass priced at 50 ms: auto stops drafting for the cost, and says
    how often the drafter's first token was the target's over the rounds it drafted, not what one round's
    tree expected (at T = 0.7 one round's guess read 0.04 where half the first drafts were accepted)."""
    draft_costs_50ms = CostModel(
        verify=LinearCost(fixed=1e-3), draft=LinearCost(fixed=5e-2), overhead=LinearCost(), frozen=True
    )
    base = Engine.from_pretrained(dtype=torch.float32)
    engine = Engine(base.target, base.runner.drafter, base.tokenizer, cost_model=draft_costs_50ms)
    engine.auto.status.drafting = True  # as if a probe had just resumed drafting
    result = engine.generate("def fibonacci(n):\n    ", SamplingParams(max_new_tokens=64))
    status = result.stats.auto
    assert not status.drafting and status.first_drafts >= 4
    assert status.reason.startswith("drafting does not pay here")
    said = re.search(r"the drafter's first token was the target's in (\d+) of (\d+) rounds", status.reason)
    assert said is not None, status.reason  # the counts when it stopped (probes may have added rounds since)
    accepted, rounds = map(int, said.groups())
    assert 4 <= rounds <= status.first_drafts and accepted >= 1


def test_the_builtin_pair_keeps_drafting_and_equals_ar():
    # float32: budget auto's trees follow measured timing, and in bfloat16 a tree of another shape can round
    # a near-tie the other way (issue 44: bf16 kernels are not batch- or tree-invariant); a busy CI box
    # changed the trees and one token of the 96. Exact equality is the claim, so it is tested where it holds.
    engine = Engine.from_pretrained(dtype=torch.float32)
    params = SamplingParams(max_new_tokens=96)
    prompt = "def fibonacci(n):\n    "
    result = engine.generate(prompt, params)
    assert result.token_ids == engine.generate(prompt, params, method="ar").token_ids
    drafted = np.array(result.stats.drafted_nodes) > 0
    assert drafted.mean() >= 0.75 and result.stats.tau > 2.0, result.stats.drafted_nodes
    auto = result.stats.auto
    assert auto.drafting and auto.reason.startswith("drafting")
    # the drafter's first token is the target's about 0.6 of the time here (0.62-0.65 measured on an idle
    # machine), counted over the 17-20 rounds auto drafts: the trees it picks follow the machine's timing,
    # so the rounds, and the count, move (9 of 19 on a loaded CI box). A drafter that does not fit sits
    # near 0 (test_a_drafter_that_is_never_accepted_...).
    assert auto.first_draft_acceptance > 0.3


def test_tree_acceptance_multiplies_the_calibrated_steps_along_each_path():
    cal = AcceptanceCalibration()
    #          root  a     b     a1    a1x   b1
    parents = np.array([-1, 0, 0, 1, 3, 2])
    # each node's draft probability given its parent, inside a calibration bin (on an edge, the last bit
    # of exp(log) picks the bin: this machine's libm put 0.9 below it)
    steps = np.array([1.0, 0.62, 0.33, 0.52, 0.87, 0.78])
    logw = np.log(steps)
    for j in range(1, len(steps)):
        logw[j] = logw[parents[j]] + np.log(steps[j])
    got = tree_acceptance(cal, "greedy", logw, parents)
    c = cal.calibrate("greedy", steps)  # the prior: each bin's midpoint
    want = [1.0, c[1], c[2], c[1] * c[3], c[1] * c[3] * c[4], c[2] * c[5]]
    np.testing.assert_allclose(got, want, rtol=1e-12)


@pytest.mark.parametrize(("committed", "hit"), [(7, 1.0), (8, 0.0)])
def test_a_first_draft_that_was_not_verified_still_teaches_the_calibration(committed, hit):
    """Nothing verified (0 nodes chosen): the likeliest first draft (token 7, drafted with probability 0.42)
    would have been accepted exactly when the target committed 7; its unverified sibling teaches nothing."""
    target = tiny_target(vocab=BIG_VOCAB)
    engine = Engine(target, tiny_drafter(target))
    engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=8))
    engine.step()  # the prefill
    row = engine.running[0]
    cal = engine.auto.calibration
    seen = AutoRound(
        logw=np.log([[1.0, 0.42, 0.2]]),
        tokens=np.array([[5, 7, 9]]),
        parents=np.array([[-1, 0, 0]]),
        candidates=np.array([3]),
        auto=[0],
    )
    engine.auto.learn([row], np.array([1]), seen, Verdicts([[committed]], [[0]], [None], [None]))
    hits, count = cal._counts["greedy"]
    at = cal._bins(np.array([0.42]))[0]
    assert count[at] == 1 and hits[at] == hit
    assert count.sum() == 1  # the sibling (0.2) is not observed
    assert engine.auto.status.first_drafts == 1 and engine.auto.status.first_drafts_accepted == hit


@pytest.mark.parametrize(
    ("committed", "accepted", "resumes"), [([7, 9, 4], [0, 1, 2], True), ([8], [0], False)]
)
def test_a_probe_whose_own_verdicts_make_its_pick_pay_calls_off_the_stretch_it_started(
    committed, accepted, resumes
):
    """A probe prices its pick before the target speaks, at the drafter's word: a chain drafted at 0.52 a
    step is worth 1.8 tokens where a round with a drafter pass must bring 2 to match plain decoding, so it
    starts a stretch, and still verifies the pick (its drafter pass is paid for). Both nodes accepted: priced
    again with that learned (0.68 a step), the pick pays, the probe's rule (the ratio itself) says draft, and
    drafting goes on next round with the doubling as it was. The first node missed: the stretch stands."""
    costs = CostModel(verify=LinearCost(fixed=1e-2), draft=LinearCost(fixed=1e-2), overhead=LinearCost())
    costs.frozen = True  # a plain round 10 ms for 1 token; a drafting round 20 ms
    target = tiny_target(vocab=BIG_VOCAB)
    engine = Engine(target, tiny_drafter(target), cost_model=costs)
    engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=8))
    engine.step()  # the prefill
    row = engine.running[0]
    engine.auto.status.drafting = False  # this round is a probe
    steps = np.array([1.0, 0.52, 0.52])
    trees = TreeBatch(
        tokens=torch.tensor([[5, 7, 9]]),
        depths=torch.tensor([[0, 1, 2]]),
        parents=torch.tensor([[-1, 0, 1]]),
        logw=torch.tensor(np.log(np.cumprod(steps))[None], dtype=torch.float32),
        sizes=np.array([3]),
        depth=2,
    )
    cut, seen = engine.auto.choose([row], trees, 1)
    assert seen.skip == {"greedy": 1} and not engine.auto.status.drafting  # priced under plain decoding
    assert cut.sizes.tolist() == [3] and seen.widths == {0: 2}  # the stop verifies its pick
    engine.auto.learn([row], cut.sizes, seen, Verdicts([committed], [accepted], [None], [None]))
    assert engine.auto.status.drafting == resumes
    assert seen.skip == (None if resumes else {"greedy": 1})
    assert engine.auto._backoff.get("greedy", 0) == (0 if resumes else 1)


def test_the_readmes_quick_start_drafts_and_warns_of_nothing(capsys, caplog):
    """Issue 46: the newcomer's first command, exactly as the README gives it. Its greedy text opens on a
    stretch the built-in drafter misses (1 of its first 15 first drafts), where auto may pause for a few
    rounds; then it drafts on. Auto once read those misses as a drafter that does not fit and ran plain
    decoding for the rest of the output (3 of 4 runs), and it warned of a pause that later probes undid."""
    with caplog.at_level(logging.DEBUG, logger="ddtree"):
        main(["generate", "def fibonacci(n):", "--stats"])
    err = capsys.readouterr().err
    stats = json.loads(err[err.index("{") :])
    assert stats["auto"]["drafting"] and stats["tau"] > 2.0, stats
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert "budget auto" not in err


def test_a_greedy_request_drafts_while_sampled_rows_sit_out_their_stretch():
    """Stretches are per kind: sampled rows' rare acceptance says nothing of a greedy row's. One stretch for
    every auto row made the bench's greedy prompt that followed a sampled one run plain for 8-127 rounds,
    tau 1.0 where it drafts at 12.7. A sampled request in the same stretch still sits it out."""
    engine = Engine.from_pretrained(dtype=torch.float32)
    engine.auto.status.drafting = False  # as after sampled rows' drafts stopped paying
    engine.scheduler.auto_skip = {"sampled": 100}
    greedy = engine.generate("def fibonacci(n):\n    ", SamplingParams(max_new_tokens=48))
    assert sum(n > 0 for n in greedy.stats.drafted_nodes[:4]) >= 2, greedy.stats.drafted_nodes
    assert greedy.stats.tau > 2.0
    sampled = engine.generate("import os\n", SamplingParams(temperature=0.7, seed=0, max_new_tokens=16))
    assert engine.scheduler.auto_skip.get("sampled", 0) > 0
    assert all(n == 0 for n in sampled.stats.drafted_nodes), sampled.stats.drafted_nodes
