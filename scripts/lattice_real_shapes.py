"""What sampled rows' whole-vocabulary lattice edges cost at real shapes (issue 46).

A random DFlash2 drafter at Qwen3-0.6B's shapes (V = 151,936, hidden 1024, 16 candidates a position) builds
the lattice of one block's 15 drafted positions for B rows: greedy rows (edges over the candidates) against
sampled rows (edges over the vocabulary, which adds a logsumexp over V per position), and a batch of both
(only its sampled rows pay the sums). Float32, one thread.

Usage: python scripts/lattice_real_shapes.py [--rows 1,16] [--repeats 10]
"""

from __future__ import annotations

import argparse

import torch
from torch.utils import benchmark
from transformers import Qwen3Config

from ddtree.speculative.dflash2 import DFlash2Drafter
from ddtree.speculative.drafter import dflash_config

VOCAB, HIDDEN, DRAFTED = 151936, 1024, 15
SELECTOR = {"conv_kernel_size": 4, "conv_group_size": 32, "selector_rank": 32, "selector_top_k": 16}


def milliseconds(call, repeats: int) -> float:
    """Mean milliseconds of ``call()`` over ``repeats`` runs, after torch's timer's own warm-up."""
    return 1e3 * benchmark.Timer("call()", globals={"call": call}).timeit(repeats).mean


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,16")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)
    target = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
    )
    config = dflash_config(target, num_layers=1, block_size=DRAFTED + 1, mask_token_id=VOCAB - 1)
    config.dflash_config = dict(config.dflash_config or {}) | SELECTOR
    drafter = DFlash2Drafter(config).eval()
    with torch.no_grad():
        for b in (int(x) for x in args.rows.split(",")):
            hidden = torch.randn(b, DRAFTED, HIDDEN)  # [B, L, H]
            logits = 3 * torch.randn(b, DRAFTED, VOCAB)  # [B, L, V]
            anchors = torch.randint(0, VOCAB, (b,))  # [B]
            whole = list(range(b))  # every row sampled
            greedy = milliseconds(lambda: drafter.lattice(hidden, logits, anchors), args.repeats)  # noqa: B023
            sampled = milliseconds(lambda: drafter.lattice(hidden, logits, anchors, whole), args.repeats)  # noqa: B023
            half = list(range(0, b, 2))  # every other row sampled: a mixed batch
            mixed = milliseconds(lambda: drafter.lattice(hidden, logits, anchors, half), args.repeats)  # noqa: B023
            extra, some = sampled - greedy, mixed - greedy
            print(f"B = {b}: greedy rows {greedy:.1f} ms, sampled rows {sampled:.1f} ms (+{extra:.1f})")
            print(f"B = {b}: half of them sampled {mixed:.1f} ms (+{some:.1f})")


if __name__ == "__main__":
    main()
