"""Device-side measurements for ``scripts/accelerator_check.sh`` (runs on the CPU too, for a dry run).

``syncs``: one round of 16 rows (greedy, sampled, mixed) of a tiny pair under
``torch.cuda.set_sync_debug_mode("warn")``, counting the syncs CUDA reports, and the attention kernels a
profiled round runs.
``verify-cost``: a random-weight target of Qwen3-8B's shapes (36 layers, hidden 4096, 32 / 8 heads, head_dim
128, vocabulary 151936) in bf16: milliseconds of the verify forward against tokens verified per row
(1, 17, 65, 257) at batch 1 and 16, timed with CUDA events (median of 10) -- the cost curve that decides
which budget pays on that chip. ``--layers`` / ``--hidden`` shrink the model for a dry run.
``memory``: the same target with the default memory flags (``gpu_memory_utilization`` 0.9, a 40,960-token
context, 16 rows, budget 64): the profiled peak of the largest step against the estimate, the pool it
leaves, then a 40,000-token prompt prefilled in 2,048-token chunks beside 15 decoding rows -- the step the
estimate alone would have run out of memory in (peak allocated, against the device's memory).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

from ddtree import Engine, SamplingParams


def count_syncs(device: str) -> dict:
    from tests.conftest import tiny_drafter, tiny_target

    target = tiny_target()
    drafter = tiny_drafter(target)
    engine = Engine(target.to(device), drafter.to(device), max_num_seqs=16, budget=16)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=64, seed=1)
    greedy = SamplingParams(max_new_tokens=64)
    out = {}
    for kind, params in {
        "greedy": [greedy] * 16,
        "sampled": [sampled] * 16,
        "mixed": [greedy if i % 2 else sampled for i in range(16)],
    }.items():
        ids = [engine.add_request([5 + i, 9, 3], p) for i, p in enumerate(params)]
        while engine.scheduler.waiting or any(r.prefilling for r in engine.running):
            engine.step()
        engine.step()
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.step()
        if device == "cuda":
            torch.cuda.set_sync_debug_mode("default")
        out[kind] = sum("synchroniz" in str(w.message) for w in caught)
        if kind == "mixed":  # which attention kernels a round runs
            with torch.profiler.profile() as prof:
                engine.step()
            out["attention_kernels"] = sorted(
                {e.key for e in prof.key_averages() if "attention" in e.key.lower() or "fmha" in e.key}
            )
        for request_id in ids:
            engine.abort(request_id)
        engine.step()
    return out


def qwen3_8b_shaped(device: str, layers: int, hidden: int, context: int = 4096):
    """A random-weight target of Qwen3-8B's shapes (bf16 on CUDA, float32 on a CPU dry run)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=max(1, hidden // 512),
        head_dim=128,
        max_position_embeddings=context,
        tie_word_embeddings=False,
    )
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device(device):
        return Qwen3ForCausalLM(config).to(dtype).eval()


def memory(device: str, layers: int, hidden: int, context: int) -> dict:
    import logging

    logging.basicConfig(level=logging.INFO)
    target = qwen3_8b_shaped(device, layers, hidden, context)
    t = time.perf_counter()
    engine = Engine(target, None, method="ar", max_num_seqs=16, budget=64)
    runner = engine.runner
    out = {
        "start_s": time.perf_counter() - t,
        "profiled_gib": (runner.profiled_activation_bytes or 0) / 2**30,
        "kv_blocks": runner.num_blocks,
        "kv_gib": runner.kv_cache_bytes / 2**30,
        "max_model_len": engine.max_model_len,
    }
    print(json.dumps(out), flush=True)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for i in range(15):
        engine.add_request([5 + i] * 100, SamplingParams(max_new_tokens=64))
    prompt = min(40_000, engine.max_model_len - 64)
    engine.add_request([7] * prompt, SamplingParams(max_new_tokens=8))
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    out |= {"long_prompt_tokens": prompt, "run_s": time.perf_counter() - t}
    if device == "cuda":
        _, total = torch.cuda.mem_get_info()
        out |= {"peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30, "device_gib": total / 2**30}
    print(json.dumps(out), flush=True)
    return out


def verify_cost(device: str, layers: int, hidden: int, repeats: int) -> list[dict]:
    target = qwen3_8b_shaped(device, layers, hidden)
    engine = Engine(target, None, method="ar", max_num_seqs=16, max_model_len=2048, kv_cache_memory="8GiB")
    runner, rows = engine.runner, []
    for b in (1, 16):
        for n in (1, 17, 65, 257):
            batch = engine.verifier.inputs([], None, shape=(b, n, 1024))  # dummy rows, 1,024 columns read
            times = []
            with torch.inference_mode():
                for i in range(repeats + 2):
                    if device == "cuda":
                        start = torch.cuda.Event(enable_timing=True)
                        end = torch.cuda.Event(enable_timing=True)
                        start.record()
                        runner.verify(*batch.forward_args(False))
                        end.record()
                        end.synchronize()
                        seconds = start.elapsed_time(end) / 1e3
                    else:
                        t = time.perf_counter()
                        runner.verify(*batch.forward_args(False))
                        seconds = time.perf_counter() - t
                    if i >= 2:  # two warm-ups
                        times.append(seconds)
            ms = statistics.median(times) * 1e3
            rows.append({"batch": b, "tokens_per_row": n, "ms": ms, "ms_per_token": ms / (b * n)})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["syncs", "verify-cost", "memory"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--hidden", type=int, default=4096, help="a multiple of 512 (a dry run: 512)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--context", type=int, default=40960, help="memory: the model's context")
    args = parser.parse_args()
    if args.what == "syncs":
        print(json.dumps({"syncs_per_round": count_syncs(args.device)}))
    elif args.what == "memory":
        memory(args.device, args.layers, args.hidden, args.context)
    else:
        verify_cost(args.device, args.layers, args.hidden, args.repeats)


if __name__ == "__main__":
    main()
