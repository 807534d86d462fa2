"""Tensor parallelism, TP 1 against TP N in one run: output tokens/s and what rank 0 sends per round.

Every configuration decodes the same prompts (``ddtree/bench/prompts.jsonl``) greedily at each
concurrency; TP 1 and TP N runs alternate ``--repeats`` times (this machine is noisy: compare ratios).
Per round it counts, on rank 0, the step channel's calls, collectives and bytes (measured by the
channel) and the forwards' all-reduces and their bytes (counted by wrapping ``torch.distributed
.all_reduce``). Tokens are checked equal across configurations. One torch thread per rank by default.

    python scripts/tp_bench.py --tp 2 --methods ar ddtree --concurrency 1 8 --out docs/tp_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ddtree.engine import Engine
from ddtree.request.params import SamplingParams

PROMPTS = Path(__file__).resolve().parents[1] / "ddtree" / "bench" / "prompts.jsonl"


class ReduceCounter:
    """Counts ``dist.all_reduce`` calls and bytes in this process (rank 0), eager forwards only."""

    def __init__(self) -> None:
        self.calls = self.bytes = 0
        self.original = dist.all_reduce

    def __call__(self, tensor, *args, **kwargs):
        self.calls += 1
        self.bytes += tensor.numel() * tensor.element_size()
        return self.original(tensor, *args, **kwargs)


def run(engine: Engine, prompts: list[str], method: str, concurrency: int, tokens: int, counter) -> dict:
    """Decode ``prompts`` ``concurrency`` at a time; tokens/s over the whole run and per-round traffic."""
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    channel = engine.runner.channel
    before = (0, 0, 0) if channel is None else (channel.stats.calls, channel.stats.collectives,
                                                channel.stats.bytes)  # fmt: skip
    reduces = (counter.calls, counter.bytes)
    outputs, rounds = [], 0
    start = time.perf_counter()
    for i in range(0, len(prompts), concurrency):
        for result in engine.generate(prompts[i : i + concurrency], params, method=method):
            outputs.append(result.token_ids)
            rounds += result.stats.rounds
    seconds = time.perf_counter() - start
    steps = max(rounds // concurrency, 1)  # rounds of the batch (each request counts its own)
    out = {"tok_s": sum(map(len, outputs)) / seconds, "seconds": seconds, "outputs": outputs}
    if channel is not None:
        out["channel_calls_per_round"] = (channel.stats.calls - before[0]) / steps
        out["channel_collectives_per_round"] = (channel.stats.collectives - before[1]) / steps
        out["channel_bytes_per_round"] = (channel.stats.bytes - before[2]) / steps
        out["all_reduces_per_round"] = (counter.calls - reduces[0]) / steps
        out["all_reduce_bytes_per_round"] = (counter.bytes - reduces[1]) / steps
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--methods", nargs="+", default=["ar", "ddtree"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 8])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--target", type=Path, default=None, help="a target dir (default: the built-in pair)")
    p.add_argument("--drafter", type=Path, default=None, help="its drafter dir")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()[: args.prompts]]
    counter = ReduceCounter()
    dist.all_reduce = counter  # TargetForward calls dist.all_reduce through the module
    options = dict(
        dtype=args.dtype, max_model_len=1024, kv_cache_memory="256MiB", max_num_seqs=max(args.concurrency)
    )
    dirs = (args.target, args.drafter)
    engines = {
        1: Engine.from_pretrained(*dirs, **options),
        args.tp: Engine.from_pretrained(*dirs, tensor_parallel_size=args.tp, **options),
    }
    rows = []
    try:
        for method in args.methods:
            for c in args.concurrency:
                runs = {tp: [] for tp in engines}
                for _ in range(args.repeats):
                    for tp, engine in engines.items():  # interleaved
                        runs[tp].append(run(engine, prompts, method, c, args.tokens, counter))
                same = runs[1][0]["outputs"] == runs[args.tp][0]["outputs"]
                row = {"method": method, "concurrency": c, "same_tokens": same}
                for tp, results in runs.items():
                    row[f"tp{tp}_tok_s"] = statistics.mean(r["tok_s"] for r in results)
                last = runs[args.tp][-1]
                row |= {k: v for k, v in last.items() if k.endswith("_per_round")}
                row["ratio"] = row[f"tp{args.tp}_tok_s"] / row["tp1_tok_s"]
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        engines[args.tp].close()
    if args.out is not None:
        options = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        args.out.write_text(json.dumps({"args": options, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
