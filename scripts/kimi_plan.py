"""The plan on paper for Kimi K2.6 over tensor-parallel GPUs (default 8 x B300, 288 GB each).

From a real config (default ``tests/assets/kimi_k26_config.json``, K2.6's shapes and quantization): the
weights each rank holds, by kind, as the checkpoint stores them and as ddtree holds them today
(dequantized to bf16 at load); MLA's KV bytes per token (``TargetForward.layout``: the latent, the same
on every rank) and the drafter's; the KV pool per rank at ``--gpu-memory-utilization`` after weights and
the largest step's activations (``ddtree.engine.memory.activation_bytes``, rank 0's heads); how many
requests of ``--context`` tokens that pool holds; and the all-reduce bytes of one verify round.
Parameters come from transformers' own DeepSeek-V3 class built on the meta device, so the numbers
follow the code.

Each rank keeps what ``ddtree.model.tensor_parallel.shard_target`` leaves it, run on the meta model: 1 / N of
the routed experts (whole experts), of the attention heads (``q_b_proj``, ``kv_b_proj``, ``o_proj``) and
of the dense and shared-expert MLPs; the rest (embedding, LM head, norms, router, the ``q_a`` / ``kv_a``
down-projections) whole. The drafter, its KV pool and the LM head's sampling are on rank 0, the binding
rank, whose numbers these are.

    python scripts/kimi_plan.py                    # the table in docs/design.md
    python scripts/kimi_plan.py --gpus 16 --gpu-gb 192
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ddtree.engine.memory import activation_bytes
from ddtree.model.forward import TargetForward
from ddtree.model.kv_cache import KVLayout
from ddtree.model.tensor_parallel import TPGroup, shard_target
from ddtree.speculative.drafter import DFlashDrafter, dflash_config

CONFIG = Path(__file__).resolve().parents[1] / "tests" / "assets" / "kimi_k26_config.json"
BF16 = 2
INT4 = 0.5 + BF16 / 32  # a 4-bit value plus a bf16 scale per group of 32 (K2.5 / K2.6 routed experts)
FP8 = 1 + 4 / (128 * 128)  # a byte plus a float32 scale per 128 x 128 block (K2)


def text_model(config: dict):
    """The DeepSeek-V3 text backbone of a Kimi config, on the meta device (nothing allocated)."""
    text = config.get("text_config") or config
    fields = {k: v for k, v in text.items() if k not in ("model_type", "quantization_config")}
    with torch.device("meta"):
        config = AutoConfig.for_model("deepseek_v3", **fields)
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def stored_bytes(name: str, numel: int, method: str | None, dtype: torch.dtype) -> tuple[str, float]:
    """(kind, bytes) of a parameter as the checkpoint stores it: K2.6 packs the routed experts in INT4,
    K2 every decoder linear weight but the router in FP8; the rest is bf16 (the router float32, as
    transformers keeps it)."""
    expert = ".experts." in name and not name.endswith("bias")
    ends = ("_proj.weight", "_mqa.weight", "gate_up_proj", "down_proj")
    linear = ".layers." in name and name.endswith(ends)
    if method == "compressed-tensors" and expert:
        return "int4", numel * INT4
    if method == "fp8" and linear:
        return "fp8", numel * FP8
    return ("fp32" if dtype == torch.float32 else "bf16"), numel * dtype.itemsize


def plan(
    config: dict,
    gpus: int = 8,
    gpu_bytes: float = 288e9,
    utilization: float = 0.9,
    context: int = 32768,
    rows: int = 16,
    nodes: int = 17,
    block_size: int = 16,
    max_num_batched_tokens: int = 2048,
    drafter_layers: int = 6,
) -> dict:
    """Rank 0's numbers (bytes unless named otherwise) for ``gpus`` GPUs of ``gpu_bytes`` each."""
    model = text_model(config)
    method = (config.get("quantization_config") or {}).get("quant_method")
    total_parameters = sum(p.numel() for p in model.parameters())
    shard_target(model, 0, gpus)  # rank 0's parameters, as the slice-wise loader reads them
    stored: dict[str, float] = {}
    for name, param in model.named_parameters():
        kind, size = stored_bytes(name, param.numel(), method, param.dtype)
        stored[kind] = stored.get(kind, 0.0) + size
    # ddtree today: every weight in bf16 (the router in float32)
    dequantized = sum(p.numel() * p.dtype.itemsize for p in model.parameters())
    drafter_config = dflash_config(model.config, num_layers=drafter_layers, block_size=block_size)
    with torch.device("meta"):
        drafter = DFlashDrafter(drafter_config)
    drafter_weights = sum(p.numel() for p in drafter.parameters()) * BF16
    forward = TargetForward(model, TPGroup(0, gpus))
    target_per_token = model.config.num_hidden_layers * forward.layout.elements_per_token() * BF16
    draft_layout = KVLayout.gqa(drafter_config.num_key_value_heads, drafter_config.head_dim)
    draft_per_token = drafter_layers * draft_layout.elements_per_token() * BF16
    width = -(-(context + block_size) // block_size)  # ModelRunner's: context, then a block of drafts
    activations = activation_bytes(
        model.config,
        max_num_batched_tokens,
        rows,
        nodes,
        width * block_size,
        BF16,
        forward.gathered_bytes_per_column(BF16),
        forward.gathered_bytes_per_column(BF16, absorbed=True),
    )
    block_bytes = (target_per_token + draft_per_token) * block_size
    out = {
        "gpus": gpus,
        "parameters": total_parameters,
        "stored": stored,
        "stored_total": sum(stored.values()),
        "dequantized_total": dequantized,
        "drafter_weights": drafter_weights,
        "kv_per_token": target_per_token,
        "draft_kv_per_token": draft_per_token,
        "activations": activations,
        # two all-reduces a layer (attention's o_proj, the MLP's down_proj / experts' sum) of rows x nodes
        # hidden states in bf16: TargetForward.reduce
        "all_reduce_per_round": 2
        * model.config.num_hidden_layers
        * rows
        * nodes
        * model.config.hidden_size
        * 2,
    }
    for case, weights in (("stored", out["stored_total"]), ("dequantized", dequantized)):
        pool = utilization * gpu_bytes - weights - drafter_weights - activations
        blocks = max(0, int(pool // block_bytes))
        out[f"pool_{case}"] = pool
        out[f"requests_{case}"] = blocks // width
    return out


def gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def table(numbers: dict, context: int = 32768, rows: int = 16, nodes: int = 17) -> str:
    """The markdown table of docs/design.md, and a line of what does not depend on the weights' form."""
    kinds = ", ".join(f"{k} {gb(v)}" for k, v in sorted(numbers["stored"].items()))
    drafter, activations = gb(numbers["drafter_weights"]), gb(numbers["activations"])
    cells = [
        (
            f"Kimi K2.6 on {numbers['gpus']} GPUs, per rank (rank 0)",
            "as stored (quantized kernels)",
            "dequantized to bf16 at load (ddtree today)",
        ),
        ("---", "---", "---"),
        (
            f"target weights ({numbers['parameters'] / 1e12:.3f} T parameters)",
            f"{gb(numbers['stored_total'])} ({kinds})",
            gb(numbers["dequantized_total"]),
        ),
        ("DFlash drafter weights (rank 0)", drafter, drafter),
        ("largest step's activations", activations, activations),
        ("KV pool at 0.9 of 288 GB", gb(numbers["pool_stored"]), gb(numbers["pool_dequantized"])),
        (
            f"{context // 1024}k-token requests it holds",
            numbers["requests_stored"],
            numbers["requests_dequantized"],
        ),
    ]
    lines = ["| " + " | ".join(str(c) for c in row) + " |" for row in cells]
    reduce = numbers["all_reduce_per_round"] / 2**20
    lines += [
        "",
        f"MLA KV per token: {numbers['kv_per_token']:,} bytes (every layer's latent in bf16, the same on "
        f"every rank) + the drafter's {numbers['draft_kv_per_token']:,} (rank 0). All-reduce per verify "
        f"round at {rows} rows x {nodes} nodes: {reduce:,.1f} MiB (2 a layer).",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-gb", type=float, default=288.0)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--context", type=int, default=32768)
    args = parser.parse_args(argv)
    config = json.loads(args.config.read_text())
    numbers = plan(config, args.gpus, args.gpu_gb * 1e9, args.gpu_memory_utilization, args.context)
    print(table(numbers, args.context))


if __name__ == "__main__":
    main()
