"""Acceptance statistics shared by the engine's stats, the server, the bench and training's evaluation."""

from __future__ import annotations

from collections.abc import Sequence


def mean_acceptance_length(lengths: Sequence[float]) -> float:
    """tau: the mean of per-round acceptance lengths (accepted drafts + 1); 0.0 when there was no round."""
    return sum(lengths) / len(lengths) if lengths else 0.0
