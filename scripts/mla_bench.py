"""MLA at Kimi K2's attention shapes: KV bytes per token, and the verify forward, absorbed against expanded.

A random-weight DeepSeek-V3 target with Kimi K2's attention (hidden 7168, 64 heads, q_lora 1536, kv_lora
512, rope 64, nope 128, v 128, YaRN factor 64) and 2 layers (layer 0 dense, layer 1 MoE with 4 experts).
The vocabulary only sizes the embedding and LM head, which the verify forward does not run: the timed model
has a small one; bytes per token and request counts are the layout's arithmetic (``KVLayout``) at V=163,840.

    OMP_NUM_THREADS=1 python scripts/mla_bench.py            # 16 rows x 17 nodes over 2k and 8k columns
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from ddtree.model.capture import tree_mask
from ddtree.model.forward import TargetForward
from ddtree.model.kv_cache import KVLayout, PagedKVCache

KIMI_K2 = dict(
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.827,
    rope_parameters=dict(
        rope_type="yarn",
        rope_theta=50000.0,
        factor=64.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    max_position_embeddings=262144,
    rope_interleave=True,
)
GIB = 1 << 30


def kv_bytes(layers: int, bf16: int = 2) -> dict:
    """Bytes per token of the latent pool and of expanded per-head K/V, and 8k-token requests a 16 GiB
    budget holds with each."""
    heads, nope, rope, v, rank = 64, 128, 64, 128, 512
    latent = layers * KVLayout.mla(rank + rope).elements_per_token() * bf16
    expanded = layers * heads * (nope + rope + v) * bf16
    return {
        "layers": layers,
        "latent_bytes_per_token": latent,
        "expanded_bytes_per_token": expanded,
        "ratio": expanded / latent,
        "8k_requests_in_16GiB_latent": 16 * GIB // (latent * 8192),
        "8k_requests_in_16GiB_expanded": 16 * GIB // (expanded * 8192),
    }


def tree_round(rows: int, nodes: int, context: int, block: int, gen: torch.Generator):
    """Inputs of one verify forward: every row has ``context`` committed columns and a random tree."""
    anc = torch.zeros(rows, nodes, nodes, dtype=torch.bool)
    depth = torch.zeros(rows, nodes, dtype=torch.int64)
    for r in range(rows):
        parents = [-1] + [int(torch.randint(max(0, j - 3), j, (1,), generator=gen)) for j in range(1, nodes)]
        for j in range(nodes):
            k = j
            while k >= 0:
                anc[r, j, k] = True
                k = parents[k]
            depth[r, j] = anc[r, j].sum() - 1
    width = -(-(context + nodes) // block)
    tables = torch.zeros(rows, width + 1, dtype=torch.int64)
    tables[:, :width] = torch.arange(1, 1 + rows * width).view(rows, width)
    starts = torch.full((rows,), context)
    return anc, depth, tables, starts, width


def time_forward(forward, cache, rows, nodes, context, absorbed: bool, row_chunk: int, gen) -> float:
    """Seconds of one verify forward over ``rows`` rows (``row_chunk`` at a time: the expanded form's keys
    and values at 8k columns do not fit this machine's memory for 16 rows at once)."""
    anc, depth, tables, starts, width = tree_round(rows, nodes, context, cache.block_size, gen)
    span = width * cache.block_size
    ids = torch.randint(0, 1000, (rows, nodes), generator=gen)
    positions = starts[:, None] + depth
    cols = starts[:, None] + torch.arange(nodes)
    t = time.perf_counter()
    with torch.inference_mode():
        for lo in range(0, rows, row_chunk):
            sl = slice(lo, lo + row_chunk)
            write = cache.at(tables[sl], cols[sl], span)
            forward(ids[sl], positions[sl], write, tree_mask(starts[sl], anc[sl], span), None, absorbed)
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--nodes", type=int, default=17)
    p.add_argument("--contexts", default="2048,8192")
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--expanded-row-chunk", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    config = DeepseekV3Config(
        **KIMI_K2, vocab_size=1024, num_hidden_layers=2, n_routed_experts=args.experts, initializer_range=0.02
    )
    target = DeepseekV3ForCausalLM(config).eval()
    forward = TargetForward(target)
    gen = torch.Generator().manual_seed(0)
    results = {
        "kv": {"2 layers": kv_bytes(2), "61 layers (Kimi K2)": kv_bytes(61)},
        "threads": torch.get_num_threads(),
        "forward": [],
    }
    for context in map(int, args.contexts.split(",")):
        width = -(-(context + args.nodes) // 16)
        cache = PagedKVCache(2, 1 + args.rows * width, 16, width, forward.layout, torch.float32, "cpu")
        for buf in cache.keys:
            buf.normal_(generator=gen)
        for absorbed, chunk in ((True, args.rows), (False, args.expanded_row_chunk)):
            times = [
                time_forward(forward, cache, args.rows, args.nodes, context, absorbed, chunk, gen)
                for _ in range(args.repeats)
            ]
            row = {
                "context": context,
                "form": "absorbed" if absorbed else "expanded",
                "row_chunk": chunk,
                "seconds": min(times),
            }
            results["forward"].append(row)
            print(json.dumps(row), flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
