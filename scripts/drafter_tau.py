"""Acceptance of several drafters for the built-in target, side by side (issue 46's training comparison).

Every drafter decodes the same held-out prompts (the bench's built-in prompts, from files never trained on)
with the same seeds at each setting, interleaved prompt by prompt. In float32 the position-keyed coins make
every drafter's output the same text (speculation is lossless and seeded output equals plain decoding), so
the tau columns compare drafters on identical continuations.

Usage: python scripts/drafter_tau.py NAME=DIR [NAME=DIR ...] [--prompts 24] [--tokens 64] [--budget 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from ddtree import Engine, SamplingParams
from ddtree.bench.prompts import load_prompts
from ddtree.model.loader import DEFAULT_TARGET, load_drafter, load_target

SETTINGS = {
    "T=0": SamplingParams(temperature=0.0),
    "T=0.7 top-p 0.95": SamplingParams(temperature=0.7, top_p=0.95),
    "T=1": SamplingParams(temperature=1.0),
}


def sampling_aware_trees() -> None:
    """Issue 46 item 4, as an experiment: sampled rows' trees scored with the draft distribution under the
    row's own sampling transform (filtered tokens -inf); verification unchanged."""
    from ddtree.engine import proposer
    from ddtree.speculative.sampling import SamplingTensors, filtered_probs

    penalised = proposer.penalised_drafts

    def aware(drafting, logits):
        logits = penalised(drafting, logits)
        sampled = [i for i, r in enumerate(drafting) if not r.params.greedy]
        if sampled:
            sampling = SamplingTensors.from_params([drafting[i].params for i in sampled], logits.device)
            logits[sampled] = filtered_probs(logits[sampled], sampling).log()  # [S, depth, V]
        return logits

    proposer.penalised_drafts = aware


def sem(values: list[float]) -> float:
    """The standard error of the mean, rounded as the table prints it."""
    return round(statistics.stdev(values) / len(values) ** 0.5, 3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("drafters", nargs="+", help="NAME=DIR")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--budget", type=int, default=16)
    p.add_argument("--method", default="ddtree")
    p.add_argument("--json", default=None, help="write the table here too")
    p.add_argument(
        "--sampling-aware",
        action="store_true",
        help="sampled rows build trees from the draft logits under their own temperature / top-k / top-p",
    )
    args = p.parse_args()
    if args.sampling_aware:
        sampling_aware_trees()
    torch.set_num_threads(2)
    target, tokenizer = load_target(DEFAULT_TARGET)
    engines = {}
    for item in args.drafters:
        name, directory = item.split("=", 1)
        drafter = load_drafter(directory).float()
        engines[name] = Engine(target, drafter, tokenizer, method=args.method, budget=args.budget)
    prompts = [p.text for p in load_prompts("builtin", args.prompts)]
    table: dict[str, dict[str, dict]] = {}
    for setting, base in SETTINGS.items():
        taus = {name: [] for name in engines}
        texts = {name: [] for name in engines}
        seconds = dict.fromkeys(engines, 0.0)
        for i, prompt in enumerate(prompts):
            sp = replace(base, seed=i, max_new_tokens=args.tokens, ignore_eos=True)
            for name, engine in engines.items():
                t = time.perf_counter()
                result = engine.generate(prompt, sp)
                seconds[name] += time.perf_counter() - t
                taus[name].append(result.stats.tau)
                texts[name].append(result.token_ids)
        first = next(iter(engines))
        table[setting] = {}
        for name, v in taus.items():
            # paired per prompt against the first drafter: the prompts' own spread cancels
            diffs = [a - b for a, b in zip(v, taus[first], strict=True)]
            table[setting][name] = {
                "tau": round(statistics.mean(v), 3),
                "sem": sem(v),
                "paired_diff": round(statistics.mean(diffs), 3),
                "paired_sem": sem(diffs),
                "seconds": round(seconds[name], 1),
                "same_text_as_" + first: sum(a == b for a, b in zip(texts[name], texts[first], strict=True)),
            }
        row = "  ".join(
            f"{n} {r['tau']:.3f}+-{r['sem']:.3f} (paired {r['paired_diff']:+.3f}+-{r['paired_sem']:.3f})"
            for n, r in table[setting].items()
        )
        print(f"{setting}: {row}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"prompts": len(prompts), "tokens": args.tokens, "budget": args.budget, **table}, f, indent=2
            )


if __name__ == "__main__":
    main()
