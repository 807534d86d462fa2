"""``budget="auto"``: how many drafted nodes each row verifies, chosen per round from expected tokens/second.

A best-first draft tree pops its nodes in descending path probability, so before the target runs we know,
for every prefix of the pop order, the expected number of tokens it commits: 1 (the bonus) plus the sum of
the drafted nodes' acceptance probabilities. Those come from the drafter's path probabilities, calibrated
online against what the target really accepted (the drafter may be over- or under-confident, and differently
for greedy and sampled rows). The seconds a round costs come from a cost model measured on the running
machine: the target forward as a linear function of the tokens it processes, the drafter pass and its trees
as a linear function of its rows, and the round's fixed overhead. The choice grows all rows' trees in one
global best-first order while the batch's expected tokens per second still rise (SmartSpec's goodput rule,
arXiv 2406.14066). Output is lossless whatever is chosen: verification accepts from any tree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

SPREAD = 0.01  # the share of the sizes' second moment their variance must reach to refit the slope


@dataclass
class LinearCost:
    """seconds = fixed + per_unit * units, fitted by exponentially weighted least squares (recent rounds
    count more, so the model follows the machine's load)."""

    fixed: float = 0.0
    per_unit: float = 0.0
    decay: float = 0.95
    sloped: bool = True  # False: a level only (per_unit stays as given)
    # the least per_unit a refit may give: after long stretches of one size (plain rounds) the few other
    # sizes' weights are noise, and a slope fitted to them fell to 0, making every tree look free
    min_per_unit: float = 0.0
    _stats: np.ndarray = field(default_factory=lambda: np.zeros(5))  # weight, sum x, sum y, sum xx, sum xy

    def predict(self, units: float) -> float:
        return self.fixed + self.per_unit * units

    @property
    def observed(self) -> bool:
        """Whether any measurement came in (before it the cost is its initial guess)."""
        return bool(self._stats[0] > 0)

    def observe(self, units: float, seconds: float) -> None:
        self._stats = self.decay * self._stats + np.array(
            [1.0, units, seconds, units * units, units * seconds]
        )
        w, sx, sy, sxx, sxy = self._stats
        var = w * sxx - sx * sx
        # A slope needs sizes that really differ among the weighted points: after a long run of one size
        # (plain rounds are all 1 token) the others' weights have decayed to rounding noise.
        if self.sloped and var > SPREAD * max(w * sxx, 1e-30):
            slope = (w * sxy - sx * sy) / var
            self.per_unit = max(slope, self.min_per_unit)
            self.fixed = max((sy - self.per_unit * sx) / w, 0.0)
        else:  # one size seen lately: keep the slope (no more than the data allow), move the level
            if sx > 0:
                self.per_unit = max(min(self.per_unit, sy / sx), self.min_per_unit)
            self.fixed = max(sy / w - self.per_unit * sx / w, 0.0)


@dataclass
class CostModel:
    """Seconds of one round: the target forward over ``tokens`` (all rows, padded) with the LM head and
    sampling over the verified nodes (both grow with the tokens: counted as the rest, a level, they made
    trees look free at batch 16 and T = 1, 0.42x plain decoding), the drafter pass and the trees built from
    it over ``draft_rows`` rows (0 = no pass: a plain round builds no tree; counted as the rest, the trees
    were charged to plain rounds too), and the rest of the round (masks, the commit). The rest is a level:
    fitted against the tokens, one slow round among hundreds of plain ones (the first auto round of a
    process) made every tree token look milliseconds dear."""

    verify: LinearCost = field(default_factory=LinearCost)
    draft: LinearCost = field(default_factory=LinearCost)
    overhead: LinearCost = field(default_factory=lambda: LinearCost(sloped=False))
    frozen: bool = False  # a given cost function (tests, or a user who measured it): no timing, no updates

    def observe(self, verify_tokens: int, verify_seconds: float, draft_rows: int, draft_seconds: float,
                round_seconds: float) -> None:  # fmt: skip
        """One round's measurements: the forwards' sizes and seconds, and the whole round's seconds."""
        if self.frozen:
            return
        self.verify.observe(verify_tokens, verify_seconds)
        if draft_rows:
            self.draft.observe(draft_rows, draft_seconds)
        self.overhead.observe(verify_tokens, max(round_seconds - verify_seconds - draft_seconds, 0.0))

    def round_seconds(self, tokens: int, draft_rows: int) -> float:
        draft = self.draft.predict(draft_rows) if draft_rows else 0.0
        # Never zero: before its first measurement the model knows nothing, and rates must stay finite.
        return np.maximum(self.overhead.predict(tokens) + self.verify.predict(tokens) + draft, 1e-9)


@dataclass
class MovingRatio:
    """An exponentially weighted mean of per-round ratios (drafting over plain, expected tokens per second)
    with its uncertainty: a round's ratio follows how sure the drafter is at that one position, so a few
    rounds are a few samples, and the weighted mean's standard error (from the weighted variance and the
    weights' effective sample size) says how far the next rounds may lie from it."""

    recent: float  # weight of the newest round
    _w: float = 0.0  # sum of weights
    _w2: float = 0.0  # sum of squared weights
    _sum: float = 0.0  # weighted sum of ratios
    _sq: float = 0.0  # weighted sum of squared ratios

    def reset(self) -> None:
        self._w = self._w2 = self._sum = self._sq = 0.0

    def add(self, ratio: float) -> None:
        keep = 1.0 - self.recent if self._w else 0.0
        weight = self.recent if self._w else 1.0
        self._w, self._w2 = keep * self._w + weight, keep * keep * self._w2 + weight * weight
        self._sum, self._sq = keep * self._sum + weight * ratio, keep * self._sq + weight * ratio * ratio

    @property
    def mean(self) -> float:
        return self._sum / self._w if self._w else float("nan")

    @property
    def samples(self) -> float:
        """The weights' effective sample size: (sum w)^2 / sum w^2."""
        return self._w * self._w / self._w2 if self._w2 else 0.0

    @property
    def settled(self) -> bool:
        """Two rounds' worth of evidence (one round says nothing of its spread)."""
        return self.samples >= 2.0 - 1e-9

    def upper(self, z: float) -> float:
        """mean + z standard errors; infinite until ``settled``."""
        if not self.settled:
            return float("inf")
        samples = self.samples
        var = max(self._sq / self._w - self.mean**2, 0.0) * samples / (samples - 1)
        return self.mean + z * (var / samples) ** 0.5


def rate_upper(successes: int, trials: int, z: float) -> float:
    """The Wilson score interval's upper end for a rate seen ``successes`` times in ``trials``: how high the
    rate may still be. A few trials say little (0 of 4 leaves 0.5 at z = 2), so a verdict that the rate is
    low waits until even this bound is low."""
    if trials == 0:
        return 1.0
    p, q = successes / trials, z * z / trials
    centre, spread = p + q / 2, z * (p * (1 - p) / trials + q / (4 * trials)) ** 0.5
    return min((centre + spread) / (1 + q), 1.0)


class AcceptanceCalibration:
    """P(a drafted node is accepted | its parent was, and the drafter's probability of its token given the
    parent), learned per kind ("greedy", "sampled").

    Conditional, not per path: a node at path probability 0.3 on the likeliest path (every step the
    drafter's first choice) is accepted far more often than a sibling at 0.3, and one table over path
    probabilities would undervalue the first and overvalue the second. ``tree_acceptance`` multiplies the
    calibrated steps along each node's path.

    Binned on the predicted probability; each bin starts with a weak prior at its own midpoint (the drafter
    taken at its word) and moves toward the observed acceptance rate as verified nodes come in.

    ``forget`` fades what was observed (never the prior) once a round: how often drafts are accepted
    changes along a text. Counts that never faded kept the misses of a text's hard opening for good: the
    README's quick start misses 14 of its first 15 first drafts, then drafts a stretch at tau 3.4, and with
    every miss still counted auto paused there for 7 rounds in 6 of 8 runs, against 1 of 6 now.
    (A scale shared by the bins, learned from every node, was tried: the opening's misses then lowered
    every bin, and pauses of 31 rounds came in 3 of 6 runs.)
    """

    def __init__(self, bins: int = 20, prior: float = 4.0) -> None:
        self.edges = np.linspace(0.0, 1.0, bins + 1)
        self._mid = (self.edges[:-1] + self.edges[1:]) / 2
        self._strength = prior
        self._counts: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # by kind: hits, nodes [bins], observed

    def _bins(self, probs: np.ndarray) -> np.ndarray:
        return np.clip(np.searchsorted(self.edges, probs, side="right") - 1, 0, len(self.edges) - 2)

    def _observed(self, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """This kind's hits and nodes per bin so far (zeros before any)."""
        zero = np.zeros_like(self._mid)
        return self._counts.get(kind, (zero, zero))

    def calibrate(self, kind: str, probs: np.ndarray) -> np.ndarray:
        hits, seen = self._observed(kind)
        k = self._strength
        return ((hits + k * self._mid) / (seen + k))[self._bins(probs)]

    def forget(self, keep: float) -> None:
        """Weigh every observation so far by ``keep``."""
        for kind, (hits, seen) in self._counts.items():
            self._counts[kind] = (keep * hits, keep * seen)

    def observe(self, kind: str, probs: np.ndarray, accepted: np.ndarray) -> None:
        hits, seen = self._observed(kind)
        b, n = self._bins(probs), self._mid.size
        self._counts[kind] = (
            hits + np.bincount(b, weights=accepted.astype(float), minlength=n),
            seen + np.bincount(b, minlength=n),
        )


def conditional_probs(logw: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """[N] each node's draft probability given its parent (the root's: 1), from one tree's cumulative draft
    log-probs and parents (root first, parents before children)."""
    return np.exp(logw - logw[np.maximum(parents, 0)])


def tree_acceptance(
    calibration: AcceptanceCalibration, kind: str, logw: np.ndarray, parents: np.ndarray
) -> np.ndarray:
    """[N] P(node accepted) for every node of one tree (root first: 1): the calibrated conditional
    acceptances multiplied along each node's path."""
    step = calibration.calibrate(kind, conditional_probs(logw, parents))
    step[0] = 1.0
    up = np.maximum(parents, 0)
    accept = step.copy()
    while True:  # one level more of every path per pass; a tree of depth D settles after D passes
        deeper = step * accept[up]
        if np.array_equal(deeper, accept):
            return accept
        accept = deeper


def choose_counts(
    order_probs: list[np.ndarray],
    gains: list[np.ndarray],
    base_tokens: float,
    seconds: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> list[int]:
    """Drafted nodes per row that maximise expected tokens per second.

    ``order_probs[b]`` are row b's candidate nodes' draft path probabilities in pop order (non-increasing),
    ``gains[b]`` their calibrated acceptance probabilities; ``base_tokens`` the tokens the batch commits with
    no drafted node (one per row, plus whatever fixed-budget rows bring); ``seconds(total, widest)`` the
    round's cost for arrays of (drafted nodes in all, drafted nodes of the widest row). Every pick keeps each
    row's nodes a prefix of its pop order (a valid tree). Two families of picks are scored:
      - prefixes of one global order of descending draft probability (best when the cost follows the
        total: a packed forward);
      - every row cut to the same width w (best when the cost follows the widest row: a forward that pads
        every row to the widest tree costs the same whether the others fill their width or not).
    The best-scoring pick wins, 0 nodes included; ties go to fewer nodes.
    """
    sizes = np.array([p.size for p in order_probs])
    if sizes.sum() == 0:
        return [0] * len(sizes)
    probs = np.concatenate(order_probs)
    owner = np.repeat(np.arange(len(sizes)), sizes)
    rank = np.concatenate([np.arange(1, n + 1) for n in sizes])  # a node's place in its row's pop order
    gain = np.concatenate(gains)
    order = np.argsort(-probs, kind="stable")  # stable: within a row, pop order is kept
    total = np.arange(0, order.size + 1)  # [K + 1] prefixes of the global order, 0 nodes first
    widest = np.concatenate(([0], np.maximum.accumulate(rank[order])))
    tokens = base_tokens + np.concatenate(([0.0], np.cumsum(gain[order])))
    prefix_rates = tokens / seconds(total, widest)
    # Same width for every row: row b takes min(w, n_b) nodes; cumulative gains per row, padded at the end.
    widths = np.arange(0, sizes.max() + 1)  # [W + 1]
    cum = np.zeros((len(sizes), widths.size))  # [B, W + 1] gain of row b's first w nodes
    for b, g in enumerate(gains):
        c = np.concatenate(([0.0], np.cumsum(g)))
        cum[b] = c[np.minimum(widths, g.size)]
    level_total = np.minimum(widths[None, :], sizes[:, None]).sum(axis=0)  # [W + 1]
    level_rates = (base_tokens + cum.sum(axis=0)) / seconds(level_total, widths)
    k, w = int(np.argmax(prefix_rates)), int(np.argmax(level_rates))
    if level_rates[w] > prefix_rates[k]:
        return np.minimum(w, sizes).tolist()
    return np.bincount(owner[order[:k]], minlength=len(sizes)).tolist()
