"""Tree-build micro-benchmark: the engine's tree stage alone (``draft_candidates`` then the batched
device beam ``build_tree_batch``), at budgets and vocabularies beyond the model's.

The engine's own ``tree`` stage is timed on the built-in drafter (V = 4096). Large targets have 32k-152k
tokens and are run at budgets of hundreds of nodes, so the bench also times the builder on synthetic draft
logits of that size: ``scale * N(0, 1)`` per entry, where the scale sets how peaked the per-position
distributions are (scale 1: flat, top-1 probability ~0.001; scale 6: top-1 probability ~0.5, like a
confident drafter), for one row and for a batch of rows built together, as a round builds them.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ddtree.speculative.tree import TreeSpec, build_tree_batch, draft_candidates

SCALES = (1.0, 3.0, 6.0)


def build(logits: torch.Tensor, budget: int) -> None:
    """One round's tree stage for ``logits`` [B, L, V]: every row a best-first tree of ``budget`` nodes."""
    rows, positions, _ = logits.shape
    full = np.full(rows, budget, dtype=np.int64)
    spec = TreeSpec(budgets=full, topks=full, depths=np.full(rows, min(positions, budget), dtype=np.int64))
    vals, ids = draft_candidates(logits, budget)  # [B, L, K] each
    build_tree_batch(vals, ids, torch.zeros(rows, dtype=torch.int64), spec)


def measure_tree_build(
    vocab: int = 32768,
    positions: int = 15,
    budgets: tuple[int, ...] = (32, 256),
    scales: tuple[float, ...] = SCALES,
    rows: tuple[int, ...] = (1, 16),
    repeats: int = 10,
    seed: int = 0,
) -> list[dict]:
    """Median milliseconds of one tree stage per (scale, rows, budget), with the logits' mean top-1
    probability."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for scale in scales:
        logits = torch.randn(max(rows), positions, vocab, generator=gen) * scale  # [B, L, V]
        top1 = torch.softmax(logits[0], dim=-1).amax(dim=-1).mean().item()
        for b in rows:
            for budget in budgets:
                build(logits[:b], budget)  # warm-up: allocations, lazy initialisation
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    build(logits[:b], budget)
                    times.append(time.perf_counter() - t)
                out.append(
                    {
                        "vocab": vocab,
                        "positions": positions,
                        "rows": b,
                        "budget": budget,
                        "scale": scale,
                        "top1_probability": top1,
                        "median_ms": statistics.median(times) * 1e3,
                    }
                )
    return out
