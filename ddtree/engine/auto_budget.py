"""The ``budget="auto"`` policy: how many drafted nodes each auto row verifies this round, and when drafting
does not pay at all. The math (cost model, calibration, the greedy choice) is ``ddtree.budget``'s; this is
where the engine feeds it what it measured and acts on its answer.
"""

from __future__ import annotations

import numpy as np

from ddtree.budget import AcceptanceCalibration, CostModel, choose_counts
from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.request import Request
from ddtree.engine.scheduler import Scheduler
from ddtree.engine.verifier import Verdict
from ddtree.tree import TreeBatch

AUTO_MAX_BACKOFF = 128  # the longest stretch of plain rounds before "auto" rows draft again


class AutoBudget:
    """Chooses auto rows' tree sizes from expected tokens per second; learns from every round."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, cost_model: CostModel | None, now) -> None:
        self.runner = runner
        self.scheduler = scheduler  # its auto_skip: plain rounds left for auto rows
        self.now = now
        self.cost = cost_model or CostModel()  # measured at the first auto round, then kept current
        self.calibration = AcceptanceCalibration()
        self._costs_measured = False
        self._auto_backoff = 0  # length of the last stretch of plain rounds: 1, 2, 4, ... AUTO_MAX_BACKOFF

    def choose(self, rows: list[Request], trees: TreeBatch, draft_rows: int) -> tuple[TreeBatch, np.ndarray]:
        """Cut every "auto" row's candidate tree to the prefix of its pop order that maximises the batch's
        expected tokens per second (ddtree.budget), and start a stretch of plain rounds for the auto rows
        when even the best pick loses to a round without the drafter. Returns the cut trees and the trees'
        draft log-probs on the host [B, N] (the round's one extra device->host copy, for auto rows only)."""
        if not (self._costs_measured or self.cost.frozen):
            self._measure_costs()
        logw = trees.logw.cpu().numpy()  # [B, N]
        sizes = trees.sizes.copy()
        auto = [i for i, r in enumerate(rows) if r.auto and sizes[i] > 1]
        base = float(len(rows))  # every row commits at least its bonus token
        for i, m in enumerate(sizes):
            if i not in auto and m > 1:
                base += self._expected_accepts(rows[i], np.exp(logw[i, 1:m])).sum()
        widest_fixed = max((m for i, m in enumerate(sizes) if i not in auto), default=1)
        b = len(rows)

        def seconds(total: np.ndarray, widest: np.ndarray) -> np.ndarray:
            width = np.maximum(widest + 1, widest_fixed)  # the forward pads every row to the widest tree
            return self.cost.round_seconds(b * width, draft_rows)

        probs = [np.exp(logw[i, 1 : sizes[i]]) for i in auto]  # [n_i] path probabilities, pop order
        gains = [self._expected_accepts(rows[i], p) for i, p in zip(auto, probs, strict=True)]
        counts = choose_counts(probs, gains, base, seconds)
        # Drafting pays when the chosen trees beat a plain round that skips the drafter altogether.
        chosen_gain = base + sum(g[:k].sum() for g, k in zip(gains, counts, strict=True))
        widest = max(counts, default=0)
        rate = chosen_gain / seconds(np.array(sum(counts)), np.array(widest))
        plain_rate = base / self.cost.round_seconds(b * widest_fixed, draft_rows - len(auto))
        # The drafter pass costs about the same for one row as for all, so the stretch is batch-wide.
        if rate < plain_rate:  # back off: 1, 2, 4, ... plain rounds, then probe again
            self._auto_backoff = min(max(2 * self._auto_backoff, 1), AUTO_MAX_BACKOFF)
            self.scheduler.auto_skip = self._auto_backoff
        else:
            self._auto_backoff = 0
        for i, k in zip(auto, counts, strict=True):
            sizes[i] = k + 1
            rows[i].auto_width = k
        return trees.cut(sizes), logw

    def _expected_accepts(self, r: Request, probs: np.ndarray) -> np.ndarray:
        return self.calibration.calibrate("greedy" if r.params.greedy else "sampled", probs)

    def learn(
        self, rows: list[Request], sizes: np.ndarray, logw: np.ndarray | None, verdicts: list[Verdict]
    ) -> None:
        """Record each row's drafted nodes and, in rounds whose draft log-probs came to the host for the
        auto choice (``logw`` [B, N]), calibrate them against what the target accepted (ddtree rows)."""
        for r, m in zip(rows, sizes, strict=True):
            r.stats.drafted_nodes.append(int(m) - 1)
        if logw is None:
            return
        for i, (r, m, (nodes, _)) in enumerate(zip(rows, sizes, verdicts, strict=True)):
            if r.method != "ddtree" or m == 1:
                continue
            accepted = np.zeros(m - 1, dtype=bool)
            accepted[[j - 1 for j in nodes[1:]]] = True
            kind = "greedy" if r.params.greedy else "sampled"
            self.calibration.observe(kind, np.exp(logw[i, 1:m]), accepted)

    def observe(self, verified_tokens: int, verify_seconds: float, draft_rows: int, draft_seconds: float,
                round_seconds: float) -> None:  # fmt: skip
        """A timed round's costs, for the cost model's online fit."""
        self.cost.observe(verified_tokens, verify_seconds, draft_rows, draft_seconds, round_seconds)

    def _measure_costs(self) -> None:
        """Seed the cost model with a few timed forwards (they write only the scratch block)."""
        self._costs_measured = True
        for tokens in (1, 8, 32, 8, 1, 32):
            self.cost.verify.observe(tokens, self.runner.timed_forward(tokens))
