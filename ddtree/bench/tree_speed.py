"""Tree-build micro-benchmark: ``build_ddtree_tree`` alone, at budgets and vocabularies beyond the model's.

The engine's own ``tree`` stage is timed on the built-in drafter (V = 4096). Large targets have 32k-152k
tokens and are run at budgets of hundreds of nodes, so the bench also times the builder on synthetic draft
logits of that size: ``scale * N(0, 1)`` per entry, where the scale sets how peaked the per-position
distributions are (scale 1: flat, top-1 probability ~0.001; scale 6: top-1 probability ~0.5, like a
confident drafter). The time covers everything the engine's ``tree`` stage does: log-softmax, top-k
candidates per position, the best-first heap and the output tensors.
"""

from __future__ import annotations

import statistics
import time

import torch

from ddtree.tree import build_ddtree_tree

SCALES = (1.0, 3.0, 6.0)


def measure_tree_build(
    vocab: int = 32768,
    positions: int = 15,
    budgets: tuple[int, ...] = (32, 256),
    scales: tuple[float, ...] = SCALES,
    repeats: int = 50,
    seed: int = 0,
) -> list[dict]:
    """Median milliseconds of one tree build per (scale, budget), with the logits' mean top-1 probability."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for scale in scales:
        logits = torch.randn(positions, vocab, generator=gen) * scale  # [L, V]
        top1 = torch.softmax(logits, dim=-1).amax(dim=-1).mean().item()
        for budget in budgets:
            build_ddtree_tree(logits, budget)  # warm-up: allocations, lazy initialisation
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                build_ddtree_tree(logits, budget)
                times.append(time.perf_counter() - t)
            rows.append(
                {
                    "vocab": vocab,
                    "positions": positions,
                    "budget": budget,
                    "scale": scale,
                    "top1_probability": top1,
                    "median_ms": statistics.median(times) * 1e3,
                }
            )
    return rows
