"""Budget auto against plain decoding under steady load, interleaved pass by pass (issue 46's c = 16 goal).

One engine (the built-in pair, ``--dtype auto``), ``ddtree bench --concurrency``'s own loop
(``bench.concurrency.run_level``: ``max(2c, prompts)`` requests, c in flight, a finished one replaced at the
next step) for ``ar`` and ``ddtree@auto`` in turn, ``--passes`` times each after one warm-up pass; on this
2-core VM one pass's tokens/s moves by up to ~35% run to run, so the ratio is the pooled one (all tokens over
all seconds) with the per-pass ratios beside it. The bench seeds every sampled request (each method then
emits the same text); in bf16 a seeded row is computed batch-invariantly, a per-round cost that weighs on
plain decoding's one-token rounds most, so ``--unseeded`` drops the seeds (each run samples its own text).
Usage:
python scripts/auto_interleaved.py [--concurrency 16] [--temperature 1] [--top-p 1] [--passes 4] [--unseeded]
    [--mixed]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from ddtree import Engine
from ddtree.bench.concurrency import run_level
from ddtree.bench.prompts import BUILTIN_PROMPTS
from ddtree.bench.runner import BenchConfig, Spec
from ddtree.request.params import SamplingParams


class UnseededConfig(BenchConfig):
    def sampling(self, temperature: float, seed: int) -> SamplingParams:
        return replace(super().sampling(temperature, seed), seed=None)


def mixed(config: type[BenchConfig]) -> type[BenchConfig]:
    """The same requests, those with an even seed greedy (about half: a server's greedy agents beside
    sampled chat)."""

    class Mixed(config):
        def sampling(self, temperature: float, seed: int) -> SamplingParams:
            return super().sampling(0.0 if seed % 2 == 0 else temperature, seed)

    return Mixed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--unseeded", action="store_true")
    p.add_argument("--mixed", action="store_true", help="half the requests greedy, half at --temperature")
    args = p.parse_args()
    torch.set_num_threads(1)
    lines = BUILTIN_PROMPTS.read_text().splitlines()[: args.prompts]
    engine = Engine.from_pretrained(budget="auto", profile=True, max_num_seqs=args.concurrency)
    ids = [engine.encode(json.loads(line)["prompt"]) for line in lines]
    config = UnseededConfig if args.unseeded else BenchConfig
    cfg = (mixed(config) if args.mixed else config)(
        methods=("ar", "ddtree"),
        budgets=("auto",),
        temperatures=(args.temperature,),
        max_new_tokens=args.max_new_tokens,
        top_p=args.top_p,
    )
    specs = [Spec("ar"), Spec("ddtree", "auto")]
    engines = {False: engine}
    for spec in specs:  # warm-up
        run_level(engines, spec, ids, cfg, args.temperature, args.concurrency)
    totals = {s.label: [0, 0.0] for s in specs}
    for i in range(args.passes):
        rates = {}
        for spec in specs:
            r = run_level(engines, spec, ids, cfg, args.temperature, args.concurrency)
            totals[spec.label][0] += r["output_tokens"]
            totals[spec.label][1] += r["wall_seconds"]
            rates[spec.label] = r["tokens_per_second"]
        print(f"pass {i}: " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in rates.items()), end="")
        print(f" (auto / ar {rates['ddtree@auto'] / rates['ar']:.2f})")
    pooled = {k: tokens / seconds for k, (tokens, seconds) in totals.items()}
    print(
        f"c = {args.concurrency}, T = {args.temperature}, top-p {args.top_p}"
        f"{', unseeded' if args.unseeded else ''}{', half greedy' if args.mixed else ''}: "
        f"ar {pooled['ar']:.1f} tok/s, "
        f"auto {pooled['ddtree@auto']:.1f} tok/s, auto / ar {pooled['ddtree@auto'] / pooled['ar']:.3f}"
    )


if __name__ == "__main__":
    main()
