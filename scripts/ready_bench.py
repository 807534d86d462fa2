"""Time to ready at real size: ``ddtree serve`` with default flags, from launch to ``/ready`` 200, then 16
concurrent requests; the server's peak resident set (``VmHWM``) and the phases ``/ready`` named meanwhile.

Pairs (random weights, written to a temporary directory and deleted afterwards):
- ``builtin``: the built-in pair;
- ``qwen3-0.6b``: Qwen3-0.6B's shapes (28 layers, V = 151,936, bf16, 40,960-token context) and a one-layer
  DFlash drafter (``tests.conftest.real_size_models``);
- ``kimi-mla``: a DeepSeek-V3 target at Kimi K2's attention and hidden widths (MLA: kv_lora 512, rope 64,
  64 heads, hidden 7168; ``scripts/mla_bench.py``'s shapes) with 2 layers (a dense one, a 4-expert MoE
  one) and a 32k vocabulary, served without a drafter (plain decoding: the pool and profile are the
  target's).

    OMP_NUM_THREADS=2 python scripts/ready_bench.py --pair qwen3-0.6b
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def write_pair(name: str, root: Path) -> list[str]:
    """``serve`` arguments naming the pair's directories (none for the built-in pair)."""
    if name == "builtin":
        return []
    if name == "qwen3-0.6b":
        from tests.conftest import real_size_models

        target, drafter = real_size_models(root, layers=28)
        return ["--target", str(target), "--drafter", str(drafter)]
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from scripts.mla_bench import KIMI_K2
    from tests.conftest import real_size_models

    real_size_models(root / "tok", layers=1)  # a word-level tokenizer over 151,936 words, cut below
    fields = KIMI_K2 | dict(
        vocab_size=32000,
        num_hidden_layers=2,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        max_position_embeddings=262144,  # Kimi K2.5 / K2.6's context
        eos_token_id=0,
    )
    torch.manual_seed(0)
    DeepseekV3ForCausalLM(DeepseekV3Config(**fields)).to(torch.bfloat16).save_pretrained(root / "kimi")
    words = json.loads((root / "tok" / "target" / "tokenizer.json").read_text())
    words["model"]["vocab"] = {w: i for w, i in words["model"]["vocab"].items() if i < 32000}
    (root / "kimi" / "tokenizer.json").write_text(json.dumps(words))
    for extra in ("tokenizer_config.json", "special_tokens_map.json"):
        if (root / "tok" / "target" / extra).exists():
            (root / "kimi" / extra).write_text((root / "tok" / "target" / extra).read_text())
    return ["--target", str(root / "kimi"), "--method", "ar"]


def ready_or_exit(url: str, proc: subprocess.Popen, log: Path) -> httpx.Response:
    """``/ready``'s answer; the server's log if it exited instead."""
    try:
        return httpx.get(f"{url}/ready", timeout=10)
    except httpx.TransportError:
        proc.wait(10)
        raise SystemExit(f"the server exited with {proc.returncode}:\n{log.read_text()}") from None


def peak_rss_gib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status).group(1)) / 2**20


async def requests(url: str, n: int) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        body = {"prompt": "w5 w6 w7 w8 w9", "max_tokens": 16, "ignore_eos": True}
        answers = await asyncio.gather(*[http.post("/v1/completions", json=body) for _ in range(n)])
    return [a.status_code for a in answers]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pair", choices=["builtin", "qwen3-0.6b", "kimi-mla"], default="qwen3-0.6b")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        flags = write_pair(args.pair, Path(tmp))
        log = Path(tmp) / "serve.log"
        with open(log, "w") as out:
            t0 = time.monotonic()
            proc = subprocess.Popen(
                [sys.executable, "-m", "ddtree.cli", "serve", "--port", "0", *flags], stdout=out, stderr=out
            )
        try:
            while not (match := re.search(r"listening on (http://[\d.:]+)", log.read_text())):
                assert proc.poll() is None, log.read_text()
                time.sleep(0.05)
            url, phases = match.group(1), []
            while (ready := ready_or_exit(url, proc, log)).status_code != 200:
                assert time.monotonic() - t0 < args.timeout, log.read_text()
                phase = ready.json().get("phase")
                if phase and (not phases or phases[-1] != phase):
                    phases.append(phase)
                time.sleep(0.2)
            ready_s = time.monotonic() - t0
            statuses = asyncio.run(requests(url, args.concurrency))
            profiled = [
                line for line in log.read_text().splitlines() if "profiled" in line or "KV cache:" in line
            ]
            print(
                json.dumps(
                    {
                        "pair": args.pair,
                        "ready_seconds": round(ready_s, 1),
                        "phases": phases,
                        "answers": {str(s): statuses.count(s) for s in set(statuses)},
                        "peak_rss_gib": round(peak_rss_gib(proc.pid), 2),
                        "log": profiled,
                    },
                    indent=1,
                )
            )
        finally:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
