"""Acceptance of the position-keyed rule against SGLang's sibling-order sampler, side by side (issue 44).

Both rules are lossless, and for a given tree both accept a node's child with the target's probability of
that child, so tau should agree within noise. Same prompts, seeds and budget; the two engines interleave
prompt by prompt. Usage: python scripts/keyed_tau.py [--prompts 40] [--temperature 1.0] [--budget 16]
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    lines = BUILTIN_PROMPTS.read_text().splitlines()[: args.prompts]
    prompts = [json.loads(line)["prompt"] for line in lines]
    keyed = Engine.from_pretrained(dtype=torch.float32, budget=args.budget)
    sibling = Engine.from_pretrained(dtype=torch.float32, budget=args.budget)
    sibling.verifier.keyed = False  # SGLang's rule at the lossless thresholds (1, 1)
    base = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.tokens, ignore_eos=True
    )
    taus: dict[str, list[float]] = {"keyed": [], "sibling": []}
    seconds = dict.fromkeys(taus, 0.0)
    for i, prompt in enumerate(prompts):
        sp = replace(base, seed=i)
        for name, engine in (("keyed", keyed), ("sibling", sibling)):
            t = time.perf_counter()
            result = engine.generate(prompt, sp)
            seconds[name] += time.perf_counter() - t
            taus[name].append(result.stats.tau)
    for name, values in taus.items():
        sem = statistics.stdev(values) / len(values) ** 0.5
        print(f"{name}: tau {statistics.mean(values):.3f} +- {sem:.3f} (sem), {seconds[name]:.1f} s")
    ratio = statistics.mean(taus["keyed"]) / statistics.mean(taus["sibling"])
    print(f"keyed / sibling tau: {ratio:.3f}; time {seconds['keyed'] / seconds['sibling']:.3f}")


if __name__ == "__main__":
    main()
