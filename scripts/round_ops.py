"""Eager torch ops a decode step runs outside its graphs (issue 34 item 4): on an accelerator each is a kernel
launch. Counted with ``ddtree.bench.step_ops`` (aten calls, views left out; the forwards, and with
``compile=True`` the round's graphs, count as one call each), per step, by budget, greedy, sampled and a
batch mixing both, on the built-in pair: the eager engine beside a compiled one (one batch bucket, a node
bucket per budget).

``python scripts/round_ops.py``
"""

from __future__ import annotations

import argparse
import time

import torch

from ddtree import Engine, SamplingParams
from ddtree.bench.step_ops import count_steps
from ddtree.model import capture

BUDGETS = (1, 16, 64, 256)


def count(engine: Engine, params: list[SamplingParams], budget: int, steps: int) -> tuple[float, float]:
    """Eager ops and graph calls per decode step over ``steps`` steps after the prefills and a round, one
    row per ``params``."""
    ids = [
        engine.add_request(f"def f{i}(n):", p, method="ddtree", budget=budget) for i, p in enumerate(params)
    ]
    for _ in range(3):
        engine.step()
    ops, calls, _ = count_steps(engine, steps)
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished_requests():
        engine.step()
    return ops, calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(2)
    eager = Engine.from_pretrained(max_num_seqs=args.rows)
    t = time.perf_counter()
    capture.COMPILE_ROUND_ON_CPU = True  # what an accelerator compiles
    compiled = Engine(
        eager.target, eager.runner.drafter, eager.tokenizer, max_num_seqs=args.rows, compile=True,
        batch_buckets=[args.rows], node_buckets=[b + 1 for b in BUDGETS],
    )  # fmt: skip
    print(f"compiled and warmed up in {time.perf_counter() - t:.0f} s\n")
    print(
        "| budget | greedy: eager ops / step | compiled: ops + graph calls | sampled: eager | compiled "
        "| mixed: eager | compiled |"
    )
    print("|---|---|---|---|---|---|---|")
    greedy = SamplingParams(max_new_tokens=200, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=0, max_new_tokens=200, ignore_eos=True)
    batches = ([greedy] * args.rows, [sampled] * args.rows, [greedy, sampled] * (args.rows // 2))
    for budget in BUDGETS:
        cells = []
        for params in batches:
            plain, _ = count(eager, params, budget, args.steps)
            ops, calls = count(compiled, params, budget, args.steps)
            cells += [f"{plain:.0f}", f"{ops:.0f} + {calls:.0f}"]
        print(f"| {budget} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
