"""Attention at real head shapes on a device: does flex compile with ddtree's tiles, which SDPA kernel runs.

    python scripts/cuda_attention_check.py flex [--device cuda]   # one JSON line per (shape, queries)
    python scripts/cuda_attention_check.py sdpa [--device cuda]   # one JSON line per shape: kernel names

``flex``: for each GQA group / head width of ``tests/test_cuda_attention_rules.REAL`` and tree sizes 1-257,
``ddtree.model.attention.flex`` compiled (fullgraph, static shapes) over a block mask of ddtree's tiles (128
queries x 16-token pool blocks, each row reading its own blocks), checked against dense SDPA.
``sdpa``: ``ddtree.model.attention.attend`` with a boolean mask under ``torch.profiler``, and, for contrast,
the call it replaced (``enable_gqa`` with the mask): the device kernels each ran, by time.
Lines are flushed as they come, so a step cut by its timeout keeps what it finished.
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from ddtree.model.attention import FLEX_Q_BLOCK, attend, flex, flex_kernel_options
from tests.test_cuda_attention_rules import REAL

BLOCK = 16  # the pool's block size (the default)
CONTEXT = 512  # columns each row has committed before its tree
TREES = (1, 17, 65, 257)  # node buckets on each side of the rule's edges (decode kernel below 128 queries)


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def block_mask(rows: int, queries: int, blocks: int, device: torch.device) -> BlockMask:
    """Row b owns pool blocks b * blocks ... and sees its ``CONTEXT`` columns and its tree causally."""
    per_row = blocks * BLOCK

    def mask_mod(b, h, q, k):
        rel = k - b * per_row
        return (rel >= 0) & (rel < CONTEXT + q + 1)

    q_tiles = -(-queries // FLEX_Q_BLOCK)
    num = torch.full((rows, 1, q_tiles), blocks, dtype=torch.int32, device=device)
    indices = torch.zeros(rows, 1, q_tiles, rows * blocks, dtype=torch.int32, device=device)  # as ddtree's
    own = torch.arange(rows * blocks, dtype=torch.int32, device=device).view(rows, 1, 1, blocks)
    indices[..., :blocks] = own
    return BlockMask.from_kv_blocks(
        num,
        indices,
        BLOCK_SIZE=(FLEX_Q_BLOCK, BLOCK),
        mask_mod=mask_mod,
        seq_lengths=(queries, rows * per_row),
        compute_q_blocks=False,
    )


def dense(mask: BlockMask, rows: int, queries: int, columns: int, device: torch.device) -> torch.Tensor:
    b, q, k = (torch.arange(n, device=device) for n in (rows, queries, columns))
    return mask.mask_mod(b[:, None, None, None], 0, q[None, None, :, None], k[None, None, None, :])


def check_flex(device: torch.device) -> None:
    rows = 2
    blocks = -(-(CONTEXT + max(TREES)) // BLOCK)
    shapes = {(heads // kv, d, v): name for name, heads, kv, d, v in REAL}  # one case per group and width
    for (group, d, v), name in shapes.items():
        for queries in TREES:
            torch.manual_seed(0)
            torch._dynamo.reset()  # every case compiles afresh: no recompile limit, no eager fallback
            q = torch.randn(rows, group, queries, d, device=device, dtype=torch.bfloat16)
            keys = torch.randn(1, 1, rows * blocks * BLOCK, d, device=device, dtype=torch.bfloat16)
            values = torch.randn(1, 1, rows * blocks * BLOCK, v, device=device, dtype=torch.bfloat16)
            mask = block_mask(rows, queries, blocks, device)
            record = {"shape": name, "group": group, "head_dim": d, "v_dim": v, "queries": queries}
            record["options"] = (
                flex_kernel_options(queries, group, 1, BLOCK) if device.type == "cuda" else None
            )
            start = time.perf_counter()
            try:
                out = torch.compile(flex, fullgraph=True, dynamic=False)(q, keys, values, mask, d**-0.5)
                k, val = (x.float().expand(rows, -1, -1, -1) for x in (keys, values))  # [B, 1, S, *]
                seen = dense(mask, rows, queries, keys.shape[2], device)  # [B, 1, T, S]
                ref = F.scaled_dot_product_attention(
                    q.float(), k, val, attn_mask=seen, scale=d**-0.5, enable_gqa=True
                )
                record |= {"ok": True, "max_abs_err": float((out.float() - ref).abs().max())}
            except Exception as exc:  # the record says why; the next case still runs
                record |= {"ok": False, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            record["seconds"] = round(time.perf_counter() - start, 2)
            emit(record)


def kernels(call, device: torch.device) -> dict:
    """What ``call`` ran: the SDPA ops torch dispatched to (``aten::_scaled_dot_product_*``: which backend)
    and the device kernels, [name, microseconds], longest first."""
    call()  # warm-up: no first-call kernels in the profile
    activity = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[activity.CPU, activity.CUDA]) as prof:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize()
    ops, times = set(), {}
    for event in prof.events():
        if event.name.startswith(("aten::_scaled_dot_product", "aten::_efficient_attention", "aten::_flash")):
            ops.add(event.name)
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.device_time_total
    top = sorted(([n, round(t, 1)] for n, t in times.items()), key=lambda x: -x[1])[:6]
    return {"ops": sorted(ops), "kernels": top}


def check_sdpa(device: torch.device) -> None:
    cases = [  # (name, heads, kv_heads, d, v, queries): a 2,048-token prefill chunk and a 65-node tree
        ("Qwen3-8B prefill chunk", 32, 8, 128, 128, 2048),
        ("Qwen3-8B tree of 65", 32, 8, 128, 128, 65),
        ("Qwen2.5-7B tree of 65", 28, 4, 128, 128, 65),
        ("MLA prefill (expanded heads)", 16, 16, 192, 128, 2048),
        ("MLA verify (absorbed, folded)", 1, 1, 576, 512, 64 * 65),
    ]
    span = 8192
    for name, heads, kv, d, v, queries in cases:
        torch.manual_seed(0)
        q = torch.randn(1, heads, queries, d, device=device, dtype=torch.bfloat16)
        keys = torch.randn(1, kv, span, d, device=device, dtype=torch.bfloat16)
        values = torch.randn(1, kv, span, v, device=device, dtype=torch.bfloat16)
        mask = (
            torch.arange(span, device=device)
            < span - queries + torch.arange(queries, device=device)[:, None] + 1
        )
        mask = mask[None, None]  # [1, 1, T, S]: causal after the context
        record = {"shape": name, "heads": heads, "kv_heads": kv, "queries": queries, "span": span}
        ours = functools.partial(attend, q, keys, values, mask)
        sdpa, gqa = F.scaled_dot_product_attention, heads != kv
        before = functools.partial(sdpa, q, keys, values, attn_mask=mask, enable_gqa=gqa)  # main's call
        for label, call in [("attend", ours), ("gqa_with_mask", before)]:
            try:
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                record[label] = kernels(call, device)
                if device.type == "cuda":
                    record[label + "_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            except Exception as exc:
                record[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        emit(record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("check", choices=["flex", "sdpa"])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    with torch.inference_mode():
        (check_flex if args.check == "flex" else check_sdpa)(device)


if __name__ == "__main__":
    main()
