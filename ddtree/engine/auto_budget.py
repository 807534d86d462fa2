"""The ``budget="auto"`` policy: how many drafted nodes each auto row verifies this round, and when drafting
does not pay at all. The math (cost model, calibration, the greedy choice) is
``ddtree.speculative.budget``'s; this is
where the engine feeds it what it measured and acts on its answer.

When the chosen trees surely stop paying against rounds without the drafter (the upper confidence bound of a
moving average over drafting rounds: one round's ratio follows how sure the drafter is at that one position),
auto rows run plain rounds for a stretch, then probe again. The round that stops, and every probe, still
verifies the pick it priced: its drafter pass is paid for, and the pick beats verifying nothing. It decided
before the target spoke: it prices its pick again with its own verdicts learned, and calls its stretch off
when the same decision then goes the other way. A probe learns even when it verifies nothing: whether the
target's next token equals the drafter's likeliest first token is exactly whether that node would have been
accepted, greedy or sampled. Stretches double while probes fail (1, 2, 4, ...), and may grow until probes
cost at most ``PROBE_SHARE`` of the plain rounds between them, so a drafter that never pays costs a few
percent, not a multiple.

While drafting goes on, a row whose chosen nodes are expected to bring fewer tokens than its row of the
drafter pass costs (at the round's tokens per second; a moving average over its drafting rounds) and fewer
than ``REST_WORTH`` rests alone (``Request.auto_rest``): it skips the drafter pass for a round, then 2, 4,
... while its probes keep saying so, so a batch mixing rows the drafter serves with rows it serves far worse
drafts for the former only.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.request import AutoStatus, Request
from ddtree.engine.scheduler import Scheduler
from ddtree.engine.verifier import Verdicts
from ddtree.speculative.budget import (
    AcceptanceCalibration,
    CostModel,
    MovingRatio,
    choose_counts,
    conditional_probs,
    rate_upper,
    tree_acceptance,
)
from ddtree.speculative.tree import TreeBatch

logger = logging.getLogger("ddtree")

AUTO_MAX_BACKOFF = 128  # stretches double up to this, or longer where a probe costs more than ...
PROBE_SHARE = 0.02  # ... this share of the plain rounds between two probes
START_WIDTH = 8  # drafted nodes a new request starts from (while drafting pays)
RECENT = 0.3  # weight of the newest drafting round in the moving average that decides
SURE = 2.0  # drafting stops when the average's upper bound (this many standard errors) is below plain's
# below this rate of accepted first drafts (its upper confidence bound at SURE), the drafter does not fit the
# target. The bound, not the rate: the README's quick start opens on a text the built-in drafter misses (1 of
# its first 15 first drafts) before a stretch it drafts at tau 3.4, and the rate alone gave up for good there
RARELY_ACCEPTED = 0.1
EVIDENCE = 4  # first drafts seen before the reason quotes the measured rate
# A row rests alone only while its drafts are expected to bring fewer tokens a round than this, whatever its
# drafter row costs: resting greedy rows whenever their drafts looked worth less than their drafter row
# (0.5-3 tokens at 16 rows here) ran greedy c = 16 at 1.91-2.09x `ar` against 2.20x without rests.
REST_WORTH = 0.25
# The weight a round keeps of the calibration's observations so far (a memory of about 30 rounds: hundreds
# of verified nodes at one row drafting, more in a batch): acceptance follows the text, which moves on. At 0.9
# the low bins forgot their misses between a test's prompts and auto never chose an empty tree there.
CALIBRATION_KEEP = 0.97


@dataclass
class AutoRound:
    """What a round's choice brought to the host, for learning once the verdicts are in."""

    logw: np.ndarray  # [B, N] candidates' cumulative draft log-probs, pop order (root first)
    tokens: np.ndarray  # [B, N] candidates' tokens
    parents: np.ndarray  # [B, N] candidates' parents (0: a first draft, a child of the root)
    candidates: np.ndarray  # [B] candidate nodes per row, root included
    auto: list[int] = field(default_factory=list)  # rows with budget "auto"
    widths: dict[int, int] = field(default_factory=dict)  # decided: auto rows' drafted nodes, by row
    # decided: plain rounds the auto rows take now, by their kind (None: no new stretch)
    skip: dict[str, int] | None = None
    # decided, by row: its own plain rounds now, and the moving average of its drafts' worth
    rests: dict[int, tuple[int, float]] = field(default_factory=dict)
    # a round that started a stretch: how it decided, for ``AutoBudget.learn`` to decide again with the
    # round's own verdicts in the calibration (None: no new stretch, or it was called off)
    stop: Stop | None = None


@dataclass
class Stop:
    """How a round decided to start a stretch (its pick is ``AutoRound.widths``): the tokens the other
    rows bring (``base``), the round's predicted seconds and plain decoding's tokens/s, the moving ratio
    before this round's sample, whether its mean decided (a probe, or rounds after a stop) rather than its
    upper bound, and each kind's stretch before it doubled."""

    base: float
    seconds: float
    plain_rate: float
    ratio: MovingRatio
    by_mean: bool
    backoff: dict[str, int]


class AutoBudget:
    """Chooses auto rows' tree sizes from expected tokens per second; learns from every round."""

    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        cost_model: CostModel | None,
        timed_draft: Callable[[int], float] | None = None,
    ) -> None:
        self.runner = runner
        self.timed_draft = timed_draft  # seconds of a drafter pass over n idle rows (seeds the cost model)
        self.shapes = runner.shapes
        self.scheduler = scheduler  # read only: its auto_skip, plain rounds left for auto rows by kind
        self.cost = cost_model or CostModel()  # measured at the first auto round, then kept current
        self.calibration = AcceptanceCalibration()
        self.status = AutoStatus()
        self._costs_measured = False
        self._seeding = False  # this round ran the seeding forwards
        self._ratio = MovingRatio(RECENT)  # expected tokens/s drafting over plain, over drafting rounds
        # By kind (``Request.auto_kind``): the length of its last stretch of plain rounds, 1, 2, 4, ...
        # AUTO_MAX_BACKOFF. Per kind: a greedy request that arrives while sampled rows sit out a stretch
        # drafts from its first round, and its own failed probe starts its own doubling; one stretch for all
        # made the bench's greedy prompt after a sampled one run plain for 8-127 rounds (tau 1.0 where it
        # drafts at 12.7).
        self._backoff: dict[str, int] = {}
        self._first: deque[tuple[bool, bool]] = deque(maxlen=64)  # recent first drafts: (greedy, accepted)
        self._said: set[str] = set()  # the kinds of reasons to run plain already logged

    @property
    def start_width(self) -> int:
        """A new request's first candidate width: none while drafting does not pay (it joins the stretch
        and the next probe), else ``START_WIDTH``."""
        return START_WIDTH if self.status.drafting else 0

    def choose(self, rows: list[Request], trees: TreeBatch, draft_rows: int) -> tuple[TreeBatch, AutoRound]:
        """Cut every "auto" row's candidate tree to the prefix of its pop order that maximises the batch's
        expected tokens per second (ddtree.speculative.budget), and start a stretch of plain rounds for the
        auto rows when even the best pick loses to a round without the drafter. Returns the cut trees and what
        the choice read from the device (the round's extra device->host copies, for auto rows only) and
        decided (the auto rows' widths, a stretch of plain rounds), for the scheduler to apply."""
        if not (self._costs_measured or self.cost.frozen):
            self._measure_costs(len(rows), max(r.start for r in rows) + 1)
        logw = trees.logw.cpu().numpy()  # [B, N]
        ids = torch.stack((trees.tokens, trees.parents)).cpu().numpy()  # [2, B, N]
        sizes = trees.sizes.copy()
        auto = [i for i, r in enumerate(rows) if r.auto and sizes[i] > 1]
        seen = AutoRound(logw, ids[0], ids[1], trees.sizes.copy(), auto)
        accepts = [self._expected_accepts(r, seen, i) for i, r in enumerate(rows)]  # [m_i] per row
        base = float(len(rows))  # every row commits at least its bonus token
        for i, m in enumerate(sizes):
            if i not in auto and m > 1:
                base += accepts[i][1:].sum()
        widest_fixed = max((m for i, m in enumerate(sizes) if i not in auto), default=1)
        b = len(rows)

        def seconds(total: np.ndarray, widest: np.ndarray) -> np.ndarray:
            width = np.maximum(widest + 1, widest_fixed)  # the forward pads every row to the widest tree
            return self.cost.round_seconds(b * width, draft_rows)

        probs = [np.exp(logw[i, 1 : sizes[i]]) for i in auto]  # [n_i] path probabilities, pop order
        gains = [accepts[i][1:] for i in auto]  # [n_i] calibrated acceptance, pop order
        counts = choose_counts(probs, gains, base, seconds)
        chosen_gain = base + sum(g[:k].sum() for g, k in zip(gains, counts, strict=True))
        widest = max(counts, default=0)
        priced = float(seconds(np.array(sum(counts)), np.array(widest)))
        rate = chosen_gain / priced
        plain_seconds = float(self.cost.round_seconds(b * widest_fixed, draft_rows - len(auto)))
        plain_rate = base / plain_seconds
        self.status.draft_ms = 1e3 * float(self.cost.draft.predict(len(auto)))
        self.status.plain_round_ms = 1e3 * plain_seconds
        # Drafting pays when the chosen trees beat a plain round that skips the drafter. One uncertain
        # position (a new line, a name) says little about the next rounds: the decision follows a moving
        # average of that ratio over drafting rounds and stops only when even its upper confidence bound
        # loses (the first rounds of a request never decide alone). After a stop the evidence is against
        # drafting: a probe decides on its own, and the rounds it resumes go on while their mean pays and
        # clear the stop's record (the doubling stretches) only once two rounds' worth of them has.
        probe = not self.status.drafting
        kinds = {rows[i].auto_kind for i in auto}
        suspect = any(self._backoff.get(k, 0) > 0 for k in kinds)
        if probe:
            self._ratio.reset()
        before = replace(self._ratio)
        # Until a drafter pass has been timed its cost is a guess of 0, which made the first two rounds
        # look 4x better than the rest and kept the average up for nine rounds at T = 1 and 16 rows.
        if self.cost.frozen or self.cost.draft.observed:
            self._ratio.add(rate / plain_rate)
        bound = self._ratio.mean if probe or suspect else self._ratio.upper(SURE)
        if not self._ratio.samples or bound >= 1.0:  # no timed drafter pass yet: no decision
            if self._ratio.settled:
                for k in kinds:
                    self._backoff.pop(k, None)
            self._say(True, "drafting", AutoStatus.reason)
        else:  # plain rounds for a stretch: 1, 2, 4, ... up to where the probes cost PROBE_SHARE or less;
            # at once there when the first drafts are rarely accepted (the drafter does not fit the target)
            cheap = math.ceil(self.status.draft_ms / (PROBE_SHARE * self.status.plain_round_ms))
            longest = max(AUTO_MAX_BACKOFF, cheap)
            kind, why = self._why_plain(gains)
            stretches = {k: self._backoff.get(k, 0) for k in kinds}
            seen.stop = Stop(base, priced, plain_rate, before, probe or suspect, stretches)
            for k in kinds:
                grown = longest if kind == "rarely accepted" else 2 * self._backoff.get(k, 0)
                self._backoff[k] = min(max(grown, 1), longest)
            seen.skip = {k: self._backoff[k] for k in kinds}
            self._say(False, kind, why, max(seen.skip.values()))
        for i, k in zip(auto, counts, strict=True):  # a stop's pick too: its drafter pass is paid for
            sizes[i] = k + 1
            seen.widths[i] = k
        if seen.skip is None:  # drafting goes on: rows whose drafts bring less than their drafter rows cost
            # rest alone. A row's nodes may be free in a forward padded to the widest tree, but its row of
            # the drafter pass is not: worth ``share`` tokens at the round's rate. As for the batch, one
            # uncertain position says little about the next: a row's drafts are judged by a moving average
            # of their expected tokens, never on its first drafting round, and only when nearly worthless.
            share = rate * self.cost.draft.per_unit
            for i, k, g in zip(auto, counts, gains, strict=True):
                value, before = float(g[:k].sum()), rows[i].auto_worth
                worth = value if before < 0 else RECENT * value + (1 - RECENT) * before
                rest = (
                    min(max(2 * rows[i].auto_backoff, 1), AUTO_MAX_BACKOFF)
                    if 0 <= before and worth < min(share, REST_WORTH)
                    else 0
                )
                seen.rests[i] = (rest, worth)
        return trees.cut(sizes, self.shapes.node_bucket(int(sizes.max(initial=1)))), seen

    def _why_plain(self, gains: list[np.ndarray]) -> tuple[str, str]:
        """The kind and the words of why auto rows run plain rounds now."""
        s = self.status
        rate = s.first_draft_acceptance if s.first_drafts >= EVIDENCE else None  # trusted once measured
        counts = f"{s.first_drafts_accepted} of {s.first_drafts}"
        seen = f"the drafter's first token was the target's in {counts} rounds"
        if rate_upper(s.first_drafts_accepted, s.first_drafts, SURE) < RARELY_ACCEPTED:
            greedy = [accepted for is_greedy, accepted in self._first if is_greedy]
            if rate_upper(sum(greedy), len(greedy), SURE) < RARELY_ACCEPTED:
                advice = "check that the drafter was trained for this target"
            else:  # sampled rows: the target's own entropy at these settings, not the drafter, is the cause
                advice = "at these sampling settings the target's next token is rarely the drafter's guess"
            return "rarely accepted", f"drafts are rarely accepted ({seen}): running plain decoding; {advice}"
        if rate is not None:  # what was measured, not one round's expectation
            accepted = seen
        else:
            expected = float(np.mean([g[0] if g.size else 0.0 for g in gains])) if gains else 0.0
            accepted = f"a row's first draft is accepted with probability {expected:.2f}"
        return "does not pay", (
            f"drafting does not pay here (a drafter pass costs {s.draft_ms:.1f} ms, a plain round "
            f"{s.plain_round_ms:.1f} ms, and {accepted}): running plain rounds, drafting again when a "
            "probe says it pays"
        )

    def _say(self, drafting: bool, kind: str, reason: str, stretch: int = 0) -> None:
        """Record the decision; warn in words, once per kind, when running plain is a verdict rather than a
        pause: the drafter surely does not fit, or probes have failed for a whole doubling (1 + 2 + ... + 128
        rounds). A pause a probe may soon end is routine and logged at debug level: the README's quick start
        pauses for 7 rounds on a stretch of text the built-in drafter misses, then drafts on at tau 3, and a
        warning that drafting does not pay was the first thing a newcomer read (issue 46)."""
        self.status.drafting, self.status.reason = drafting, reason
        if drafting:
            return
        lasting = kind == "rarely accepted" or stretch >= AUTO_MAX_BACKOFF
        if lasting and kind not in self._said:
            self._said.add(kind)
            logger.warning("budget auto: %s", reason)
        else:
            logger.debug("budget auto: %s", reason)

    def _expected_accepts(self, r: Request, seen: AutoRound, i: int) -> np.ndarray:
        """[m] P(accepted) of row i's candidate nodes, root first."""
        m = int(seen.candidates[i])
        return tree_acceptance(self.calibration, r.auto_kind, seen.logw[i, :m], seen.parents[i, :m])

    def learn(
        self, rows: list[Request], sizes: np.ndarray, seen: AutoRound | None, verdicts: Verdicts
    ) -> AutoStatus | None:
        """Calibrate the drafter against what the target accepted, in rounds whose candidates came to the
        host for the auto choice: every verified node of a ddtree row whose parent was accepted (the target
        saw it) or, where none was verified, the likeliest first draft, which would have been accepted
        exactly when it is the token the target committed next. (Only that one: whether any other
        unverified node would have been accepted depends on more than that token.) Returns the policy's
        state for the auto rows' stats (None: no auto row)."""
        self.calibration.forget(CALIBRATION_KEEP)  # every round: the text moves on in plain rounds too
        if seen is not None:
            self._calibrate(rows, sizes, seen, verdicts)
            if seen.stop is not None:
                self._decide_again(rows, seen)
        return self._record_rounds(rows, sizes, seen)

    def _decide_again(self, rows: list[Request], seen: AutoRound) -> None:
        """A round that started a stretch decided before the target spoke. Its verdicts are now in the
        calibration: priced again with them, the same pick may pay, and when the same rule (the moving
        ratio's mean or upper bound) then says so, the stretch is called off (drafting goes on next round,
        the doubling as it was). An under-confident drafter (trained on the target's distribution, it says
        0.2-0.6 where the target takes its drafts) otherwise saw probe after probe accepted and priced under
        plain decoding: on the README's quick start it ran 31-96 plain rounds in 5 of 6 runs. One lucky hit
        moves a fresh calibration bin a fifth of the way (its prior weighs 4 nodes)."""
        stop = seen.stop
        gain = stop.base + sum(
            self._expected_accepts(rows[i], seen, i)[1 : k + 1].sum() for i, k in seen.widths.items()
        )
        ratio = replace(stop.ratio)
        ratio.add(gain / stop.seconds / stop.plain_rate)
        if (ratio.mean if stop.by_mean else ratio.upper(SURE)) < 1.0:
            return
        for k, n in stop.backoff.items():
            if n:
                self._backoff[k] = n
            else:
                self._backoff.pop(k)
        self._ratio = ratio
        seen.skip, seen.stop = None, None
        self._say(True, "drafting", AutoStatus.reason)

    def _calibrate(self, rows: list[Request], sizes: np.ndarray, seen: AutoRound, verdicts: Verdicts) -> None:
        for i, (r, m) in enumerate(zip(rows, sizes, strict=True)):
            n = int(seen.candidates[i])
            if r.method != "ddtree" or n == 1:
                continue
            nodes, tokens = verdicts.nodes[i], verdicts.tokens[i]
            accepted = np.zeros(m, dtype=bool)  # [m] root first
            accepted[nodes] = True
            if m == 1:  # nothing verified: the likeliest first draft (node 1) tells what it would have done
                accepted, m = np.array([True, seen.tokens[i, 1] == tokens[0]]), 2
            parents = seen.parents[i, :m]
            tried = accepted[np.maximum(parents, 0)]  # nodes whose parent was accepted: the target saw them
            tried[0] = False
            steps = conditional_probs(seen.logw[i, :m], parents)
            self.calibration.observe(r.auto_kind, steps[tried], accepted[tried])
            if i in seen.auto:
                # node 1: the likeliest first draft
                self._first.append((r.params.greedy, bool(seen.tokens[i, 1] == tokens[0])))
        self.status.first_drafts = len(self._first)
        self.status.first_drafts_accepted = sum(accepted for _, accepted in self._first)

    def _record_rounds(
        self, rows: list[Request], sizes: np.ndarray, seen: AutoRound | None
    ) -> AutoStatus | None:
        """Count the auto rows' rounds with and without drafted nodes; a snapshot for their stats."""
        decided = seen is not None and seen.skip is not None
        self.status.stretch = max((seen.skip if decided else self.scheduler.auto_skip).values(), default=0)
        auto = [m for r, m in zip(rows, sizes, strict=True) if r.auto]
        if not auto:
            return None
        drafted = sum(1 for m in auto if m > 1)
        self.status.drafted_rounds += drafted
        self.status.plain_rounds += len(auto) - drafted
        return replace(self.status)

    def observe(self, verified_tokens: int, verify_seconds: float, draft_rows: int, draft_seconds: float,
                round_seconds: float) -> None:  # fmt: skip
        """A timed round's costs, for the cost model's online fit (not the round that seeded it: its timed
        forwards would count as that round's overhead)."""
        if self._seeding:
            self._seeding = False
            return
        self.cost.observe(verified_tokens, verify_seconds, draft_rows, draft_seconds, round_seconds)

    def _measure_costs(self, rows: int, context: int) -> None:
        """Seed the cost model with a few timed forwards of this round's rows and context (they write only
        the scratch block). Seeded with one row, a plain round of 16 rows looked 4-5x cheaper than it was
        (9 against 37 ms), and the first rounds of a batch stopped drafting at 2x plain decoding's speed."""
        self._costs_measured = self._seeding = True
        for width in (1, 8, 16, 8, 1, 16):
            self.cost.verify.observe(rows * width, self.runner.timed_forward(rows, width, context))
        # a token verified costs at least half what it did in these forwards (without the LM head): the
        # floor under a slope refitted to a few decayed tree rounds among many plain ones
        self.cost.verify.min_per_unit = self.cost.verify.per_unit / 2
        if self.timed_draft is not None:  # a drafter row's cost: what a row resting alone saves
            for n in (1, max(rows, 4), 1, max(rows, 4)):
                self.cost.draft.observe(n, self.timed_draft(n))
            # the same floor: at one batch size (a steady load) the slope refits to noise
            self.cost.draft.min_per_unit = self.cost.draft.per_unit / 2
