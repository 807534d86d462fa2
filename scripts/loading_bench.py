"""Bytes read and peak host memory per tensor-parallel rank: slice-wise loading against the whole checkpoint.

Writes a random DeepSeek-V3-shaped checkpoint (MLA, 64 routed experts (top-8) plus a shared expert, a
dense first layer; about 1.4 GB in float32) to a temporary directory, deleted afterwards. Then each rank
of ``--world`` loads it both ways, each in a fresh process so its peak RSS is its own:

- ``slice-wise``: ``load_target(shard=(rank, world))``, reading only the rank's ``tp_slice`` of each
  tensor (the bytes counted by the loader, ``target.load_stats``);
- ``whole``: ``from_pretrained`` then ``shard_target`` (how a rank loaded before issue 31), which reads
  every tensor of the checkpoint.

Peak RSS is the process's high-water mark (``VmHWM``), after imports ("at start") and after the load;
pages of the memory-mapped safetensors files a load touched count in it too.

    OMP_NUM_THREADS=1 python scripts/loading_bench.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import shutil
import tempfile
import time
from pathlib import Path

MIB = 2**20
FIELDS = dict(  # DeepSeek-V3's structure at about 1/100 of its width
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    moe_intermediate_size=256,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_shared_experts=1,
    n_routed_experts=64,
    num_experts_per_tok=8,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    q_lora_rank=384,
    kv_lora_rank=256,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    max_position_embeddings=4096,
)


def write_checkpoint(directory: Path) -> int:
    """A random float32 checkpoint of ``FIELDS`` in ``directory`` -> its bytes on disk."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    DeepseekV3ForCausalLM(DeepseekV3Config(**FIELDS)).save_pretrained(directory)
    return sum(p.stat().st_size for p in directory.glob("*.safetensors"))


def peak_rss() -> float:
    """This process's peak resident set so far, MiB: Linux's ``VmHWM`` (KiB), which, unlike
    ``ru_maxrss``, starts afresh at exec and so does not carry the parent's peak into a spawned child."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status: this bench measures memory on Linux only")


def measure(way: str, rank: int, world: int, directory: Path, out) -> None:
    """Load rank ``rank``'s shard ``way`` and send (bytes read, bytes kept, RSS at start, peak RSS,
    seconds) through ``out``."""
    import torch

    from ddtree.model.checkpoint import Checkpoint
    from ddtree.model.loader import load_target
    from ddtree.model.tensor_parallel import shard_target

    torch.set_num_threads(1)
    start_rss, start = peak_rss(), time.perf_counter()
    if way == "slice-wise":
        target, _ = load_target(directory, tokenizer=False, shard=(rank, world))
        read = target.load_stats.bytes_read
    else:
        target, _ = load_target(directory, tokenizer=False)
        read = Checkpoint(directory, None).stats.checkpoint_bytes  # every tensor
        shard_target(target, rank, world)
    seconds = time.perf_counter() - start
    kept = sum(p.numel() * p.element_size() for p in target.parameters())
    out.send((read, kept, start_rss, peak_rss(), seconds))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    spawn = multiprocessing.get_context("spawn")
    root = Path(tempfile.mkdtemp(prefix="ddtree-loading-bench-"))
    try:
        size = write_checkpoint(root)
        print(f"checkpoint: {size / MIB:,.0f} MiB float32, {FIELDS['n_routed_experts']} routed experts")
        print("| load | rank | read (MiB) | kept (MiB) | RSS at start (MiB) | peak RSS (MiB) | load (s) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for way in ("whole", "slice-wise"):
            for rank in range(args.world):
                receive, send = spawn.Pipe(duplex=False)
                process = spawn.Process(target=measure, args=(way, rank, args.world, root, send))
                process.start()
                read, kept, start_rss, peak, seconds = receive.recv()
                process.join()
                cells = (read / MIB, kept / MIB, start_rss, peak)
                print(f"| {way} | {rank} | " + " | ".join(f"{c:,.0f}" for c in cells) + f" | {seconds:.1f} |")
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
