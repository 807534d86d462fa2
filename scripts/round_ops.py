"""Eager torch ops a decode step runs outside the target's and the drafter's forwards (issue 34 item 4's
starting point): on an accelerator each is a kernel launch, so this is what capturing the tree build, the
walk and the acceptance would remove. Counted with a ``TorchDispatchMode`` (aten calls; views, which
launch nothing, left out), the forwards themselves paused; per step, by budget, greedy and sampled, on the
built-in pair.

``python scripts/round_ops.py``
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ddtree import Engine, SamplingParams


class OpCounter(TorchDispatchMode):
    """Counts aten calls while ``active``, views (no kernel: ``func.is_view``) apart."""

    def __init__(self) -> None:
        super().__init__()
        self.active = True
        self.ops: Counter[str] = Counter()
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active:
            if func.is_view:
                self.views += 1
            else:
                self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def paused(counter: OpCounter, fn):
    def run(*args, **kwargs):
        counter.active = False
        try:
            return fn(*args, **kwargs)
        finally:
            counter.active = True

    return run


def count(
    engine: Engine, rows: int, params: SamplingParams, budget: int, steps: int
) -> tuple[float, Counter]:
    """Mean non-view ops per decode step over ``steps`` steps after a warm-up, and their counts."""
    for i in range(rows):
        engine.add_request(f"def f{i}(n):", params, method="ddtree", budget=budget)
    for _ in range(3):  # prefill and a first round
        engine.step()
    counter = OpCounter()
    runner = engine.runner
    forwards = runner.verify_forward, runner.draft_forward
    runner.verify_forward, runner.draft_forward = (paused(counter, f) for f in forwards)
    try:
        with counter:
            for _ in range(steps):
                engine.step()
    finally:
        runner.verify_forward, runner.draft_forward = forwards
    while engine.has_unfinished_requests():
        engine.step()
    return sum(counter.ops.values()) / steps, counter.ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(2)
    engine = Engine.from_pretrained(max_num_seqs=16)
    print("| budget | greedy ops / step | sampled ops / step | most frequent (greedy, per step) |")
    print("|---|---|---|---|")
    greedy_params = SamplingParams(max_new_tokens=200, ignore_eos=True)
    sampled_params = SamplingParams(temperature=1.0, top_p=0.9, seed=0, max_new_tokens=200, ignore_eos=True)
    for budget in (1, 16, 64, 256):
        greedy, ops = count(engine, args.rows, greedy_params, budget, args.steps)
        sampled, _ = count(engine, args.rows, sampled_params, budget, args.steps)
        top = ", ".join(f"{name} {n / args.steps:.0f}" for name, n in ops.most_common(4))
        print(f"| {budget} | {greedy:.0f} | {sampled:.0f} | {top} |")


if __name__ == "__main__":
    main()
