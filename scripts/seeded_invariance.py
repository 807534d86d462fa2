"""Seeded sampling in bfloat16, the default dtype on a native-bf16 CPU (issue 44): how often seeded
speculation emits seeded plain decoding's tokens, and what the exact rows' batch-invariant path costs.

Equality: each prompt's seeded ``ddtree`` (budget 16) output against seeded ``ar``, alone, and the same
request among others in one ``generate`` call. Cost: the same requests with and without a seed (only the
seed differs; an unseeded row takes the fast path, ``Request.exact``), interleaved pass by pass, at
concurrency 1 and ``--batch``; tokens/s as a ratio. Then greedy decoding with and without
``batch_invariant`` (every row exact): equality with each prompt decoded alone, and tokens/s. Usage:
python scripts/seeded_invariance.py [--prompts 12] [--batch 8] [--tokens 48] [--passes 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from ddtree import Engine, SamplingParams
from ddtree.bench.prompts import BUILTIN_PROMPTS


def timed(engine: Engine, prompts: list[str], params: list[SamplingParams]) -> tuple[float, float, int]:
    """Seconds, mean tau and tokens of one ``generate`` over the prompts (one batch)."""
    t = time.perf_counter()
    results = engine.generate(prompts, params)
    seconds = time.perf_counter() - t
    return seconds, statistics.mean(r.stats.tau for r in results), sum(len(r.token_ids) for r in results)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--temperature", type=float, default=1.0)
    args = p.parse_args()
    lines = BUILTIN_PROMPTS.read_text().splitlines()[: args.prompts]
    prompts = [json.loads(line)["prompt"] for line in lines]
    engine = Engine.from_pretrained(dtype=torch.bfloat16, budget=16)
    base = SamplingParams(temperature=args.temperature, max_new_tokens=args.tokens, ignore_eos=True)
    seeded = [replace(base, seed=i) for i in range(len(prompts))]

    ar = [engine.generate(q, sp, method="ar").token_ids for q, sp in zip(prompts, seeded, strict=True)]
    alone = [engine.generate(q, sp).token_ids for q, sp in zip(prompts, seeded, strict=True)]
    batched = [r.token_ids for r in engine.generate(prompts, seeded)]
    print(f"ddtree@16 alone == ar: {sum(a == b for a, b in zip(alone, ar, strict=True))} / {len(prompts)}")
    print(f"ddtree@16 in a batch == alone: {sum(a == b for a, b in zip(batched, alone, strict=True))}")
    greedy = replace(base, temperature=0.0)
    plain = [r.token_ids for r in engine.generate(prompts, greedy, method="ar")]
    tree = [r.token_ids for r in engine.generate(prompts, greedy)]
    print(f"greedy ddtree@16 batched == ar batched: {sum(a == b for a, b in zip(tree, plain, strict=True))}")

    for c in (1, args.batch):
        totals = {"seeded": [0.0, 0], "unseeded": [0.0, 0]}
        taus: dict[str, list[float]] = {"seeded": [], "unseeded": []}
        for _ in range(args.passes):
            for lo in range(0, len(prompts), c):
                group = prompts[lo : lo + c]
                for name in totals:
                    params = seeded[lo : lo + c] if name == "seeded" else [base] * len(group)
                    seconds, tau, tokens = timed(engine, group, params)
                    totals[name][0] += seconds
                    totals[name][1] += tokens
                    taus[name].append(tau)
        rate = {name: tokens / seconds for name, (seconds, tokens) in totals.items()}
        print(
            f"c = {c}: seeded {rate['seeded']:.1f} tok/s (tau {statistics.mean(taus['seeded']):.2f}), "
            f"unseeded {rate['unseeded']:.1f} tok/s (tau {statistics.mean(taus['unseeded']):.2f}), "
            f"ratio {rate['seeded'] / rate['unseeded']:.2f}"
        )

    invariant = Engine.from_pretrained(dtype=torch.bfloat16, budget=16, batch_invariant=True)
    alone = [invariant.generate(q, greedy, method="ar").token_ids for q in prompts]
    engines = {"batch_invariant": invariant, "default": engine}
    totals = {name: [0.0, 0] for name in engines}
    for _ in range(args.passes):
        for lo in range(0, len(prompts), args.batch):
            group = prompts[lo : lo + args.batch]
            for name, e in engines.items():
                t = time.perf_counter()
                results = e.generate(group, greedy)
                totals[name][0] += time.perf_counter() - t
                totals[name][1] += sum(len(r.token_ids) for r in results)
                same = sum(r.token_ids == alone[lo + i] for i, r in enumerate(results))
                print(f"greedy ddtree@16, {name}: batch at {lo} == alone: {same} / {len(group)}")
    rate = {name: tokens / seconds for name, (seconds, tokens) in totals.items()}
    print(
        f"greedy c = {args.batch}: batch_invariant {rate['batch_invariant']:.1f} tok/s, default "
        f"{rate['default']:.1f} tok/s, ratio {rate['batch_invariant'] / rate['default']:.2f}"
    )


if __name__ == "__main__":
    main()
