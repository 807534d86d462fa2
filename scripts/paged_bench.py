"""Plain decoding at 16 rows: this checkout's paged pool against another revision (by default the last
commit with the contiguous cache), one engine per run, runs alternating, as issue 34 item 7 measures it.

    python scripts/paged_bench.py [--against 624fee4] [--runs 3] [--rows 16] [--prompt-tokens 250]
                                  [--threads 2]

Each run builds the built-in pair's engine (``ar``, float32 on a CPU without native bf16), admits
``rows`` requests of ``prompt-tokens`` random tokens, decodes 20 rounds untimed, then times 3 x 25
rounds: output tokens/s. ``--against`` is checked out with ``git worktree`` into a temporary directory
and imported from there.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ONE_RUN = """
import random, sys, time, torch
from ddtree import Engine, SamplingParams
torch.set_num_threads({threads})
engine = Engine.from_pretrained(method="ar", max_num_seqs={rows})
rng = random.Random(0)
params = SamplingParams(max_new_tokens=400, ignore_eos=True)
for _ in range({rows}):
    engine.add_request([rng.randrange(3, 4000) for _ in range({prompt})], params)
for _ in range(20):
    engine.step()
rates = []
for _ in range(3):
    start = time.perf_counter()
    for _ in range(25):
        engine.step()
    rates.append({rows} * 25 / (time.perf_counter() - start))
print(" ".join(f"{{r:.1f}}" for r in rates))
"""


def run(source: Path, rows: int, prompt: int, threads: int) -> list[float]:
    """One engine's three timed stretches (output tokens/s), importing ddtree from ``source``."""
    env = {**os.environ, "PYTHONPATH": str(source)}
    code = ONE_RUN.format(rows=rows, prompt=prompt, threads=threads)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return [float(x) for x in out.stdout.split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", default="624fee4", help="the revision to compare with")
    parser.add_argument("--runs", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=250, help="each row's prompt (at most 1,600)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "other"
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(other), args.against],
            check=True,
        )
        try:
            rates: dict[str, list[float]] = {args.against: [], "this checkout": []}
            for i in range(args.runs):
                for name, source in ((args.against, other), ("this checkout", ROOT)):
                    got = run(source, args.rows, args.prompt_tokens, args.threads)
                    rates[name] += got
                    print(f"run {i + 1} {name}: {' '.join(f'{r:.0f}' for r in got)} tokens/s", flush=True)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=True)
    base, this = (statistics.mean(v) for v in rates.values())
    print(f"means: {args.against} {base:.0f}, this checkout {this:.0f} tokens/s: {this / base:.2f}x")


if __name__ == "__main__":
    main()
