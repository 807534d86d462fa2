"""Prefix caching on against off, side by side in one run.

1. Serving: two ``ddtree serve`` processes on the same models, one with ``--no-enable-prefix-caching``,
   loaded together and driven in turn (on, off, then off, on, ...): ``--concurrency`` clients send
   ``--num-requests`` streamed completions, each a shared prefix of about ``--shared-prefix-tokens``
   tokens (a system prompt) and then its own question (tagged with the repetition, so questions are never
   cached across repetitions; the prefix is, after each server's one warm-up request). TTFT p50 / p99,
   output tokens/s and the prefix cache's hit rate per repetition.
2. One long prompt: ``--repeat-prompt-tokens`` tokens prefilled cold, then sent again (a hit: only its last
   block is prefilled), in one engine per setting on the same weights.

    python scripts/prefix_cache_bench.py                                   # the built-in pair
    python scripts/prefix_cache_bench.py --target T --drafter D --prompts ids.jsonl \\
        --shared-prefix-tokens 2000 --repeat-prompt-tokens 8192
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from types import SimpleNamespace

from ddtree import Engine, SamplingParams
from ddtree.bench.prompts import load_prompts
from ddtree.bench.serve import StartedServer, run_level, server_model, shared_prefixes
from ddtree.bench.serve_report import level_summary


class NoProgress:
    def update(self, n: int) -> None:
        pass


def bodies(prompts: list, prefix: tuple[str, list[int]], rep: int, count: int, model: str, max_tokens: int):
    """``count`` streamed greedy completions: the shared prefix, a tag unique to (rep, i), a question."""
    out = []
    for i in range(count):
        p = prompts[i % len(prompts)]
        if p.text is not None:
            prompt = f"{prefix[0]}# question {rep}-{i}\n{p.text}"
        else:
            prompt = prefix[1] + [3 + rep, 3 + i % 1000] + list(p.token_ids)
        out.append(
            {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}, "ignore_eos": True}
        )  # fmt: skip
    return out


def serving(args: argparse.Namespace, model_args: list[str]) -> list[dict]:
    common = [*model_args, "--max-batch-size", str(args.concurrency), "--threads", str(args.threads)]
    servers = {
        "on": StartedServer(common),
        "off": StartedServer([*common, "--no-enable-prefix-caching"]),
    }
    client = SimpleNamespace(api_key=None, timeout=3600.0, seed=0)
    prompts = load_prompts(args.prompts)
    prefix = shared_prefixes(prompts, args.shared_prefix_tokens)
    rows = []
    try:
        for server in servers.values():
            server.wait_ready()
        model = server_model(servers["on"].url, None)
        for server in servers.values():  # one untimed request each (the "on" one caches the prefix)
            warm = bodies(prompts, prefix, -1, 1, model, args.max_tokens)
            asyncio.run(run_level(server.url, warm, 1, None, client, NoProgress()))
        for rep in range(args.reps):
            for name in ("on", "off") if rep % 2 == 0 else ("off", "on"):
                work = bodies(prompts, prefix, rep, args.num_requests, model, args.max_tokens)
                records, seconds = asyncio.run(
                    run_level(servers[name].url, work, args.concurrency, None, client, NoProgress())
                )
                summary = level_summary(records, seconds)
                row = {
                    "prefix_caching": name,
                    "rep": rep,
                    "completed": summary["completed"],
                    "prompt_tokens_mean": summary["prompt_tokens"] / max(summary["completed"], 1),
                    "hit_rate": summary["prefix_cache_hit_rate"],
                    "ttft_p50_ms": summary["ttft_ms"]["p50"],
                    "ttft_p99_ms": summary["ttft_ms"]["p99"],
                    "output_tokens_per_s": summary["output_tokens_per_s"],
                    "seconds": seconds,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for server in servers.values():
            server.stop()
    return rows


def long_prompt(args: argparse.Namespace) -> list[dict]:
    """Prefill seconds of one ``--repeat-prompt-tokens`` prompt: cold, then again, caching on and off."""
    options = dict(max_model_len=args.repeat_prompt_tokens + 64, kv_cache_memory=args.kv_cache_memory)
    on = Engine.from_pretrained(args.target, args.drafter, **options)
    off = Engine(on.target, on.runner.drafter, on.tokenizer, enable_prefix_caching=False, **options)
    vocab = on.runner.embed.num_embeddings
    prompt = [3 + (7 * j + j * j) % (vocab - 8) for j in range(args.repeat_prompt_tokens)]
    rows = []
    for name, engine in (("off", off), ("on", on)):
        for attempt in ("first", "again"):
            t0 = time.perf_counter()
            r = engine.generate(prompt, SamplingParams(max_new_tokens=1))
            row = {
                "prefix_caching": name,
                "attempt": attempt,
                "prompt_tokens": len(prompt),
                "cached_tokens": r.stats.cached_tokens,
                "prefill_seconds": r.stats.prefill_seconds,
                "wall_seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target directory (default: the built-in pair)")
    p.add_argument("--drafter", default=None)
    p.add_argument("--prompts", default="builtin", help="'builtin' or a .jsonl of questions")
    p.add_argument("--shared-prefix-tokens", type=int, default=1500)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat-prompt-tokens", type=int, default=1900)
    p.add_argument("--kv-cache-memory", default="4GiB")
    p.add_argument("--out", type=Path, default=Path("runs/prefix-cache"))
    args = p.parse_args()
    model_args = [] if args.target is None else ["--target", args.target, "--drafter", args.drafter]
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"argv": vars(args) | {"out": str(args.out)}, "long_prompt": long_prompt(args)}
    report["serving"] = serving(args, model_args)
    (args.out / "results.json").write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
