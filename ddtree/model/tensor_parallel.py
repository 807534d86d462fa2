"""Tensor parallelism for the target, as Megatron-LM splits a transformer (Shoeybi et al., 2019), with
the routed experts of a mixture-of-experts layer split by expert (expert parallelism inside the group).

Each rank holds a slice of every layer: the query/key/value projections of its own attention heads and
KV heads (column-parallel, by whole heads), the input columns of ``o_proj`` that read those heads
(row-parallel), and a slice of the MLP's intermediate units (``gate_proj``/``up_proj`` column-parallel,
``down_proj`` row-parallel). A rank then computes attention for its heads alone, with a KV cache of its
KV heads alone, and its share of the MLP; ``o_proj`` and ``down_proj`` each leave a partial sum of the
full output, so ``ddtree.model.forward.TargetForward`` all-reduces after each: two all-reduces per layer, and
the residual stream (embedding, norms, LM head: replicated) is the same on every rank.

MLA (DeepSeek-V2/V3, Kimi K2) splits the same way by whole heads: ``q_b_proj`` (or ``q_proj``) and
``kv_b_proj`` column-parallel, ``o_proj`` row-parallel. What every head shares stays whole on every rank:
``q_a_proj``/``q_a_layernorm``, ``kv_a_proj_with_mqa``/``kv_a_layernorm`` and so the latent KV cache
(vLLM's split). A MoE layer (Qwen3-MoE, DeepSeek-V3, GLM-4 MoE) keeps its router whole, so every rank
routes every token alike; rank r keeps routed experts [r * e, (r + 1) * e) with e = experts / world_size
and runs only those, on the tokens routed to them (HF's own expert-parallel sentinel: the other ranks'
experts map to the local index ``num_experts``, which the experts' forward skips). Shared experts split
as a dense MLP. The routed and shared partial sums add up in the all-reduce that ends the MLP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ddtree.errors import DDTreeError


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group: the ranks that hold slices of one target."""

    rank: int
    world_size: int
    group: dist.ProcessGroup | None = None  # None: torch.distributed's default (world) group


def keep(param: nn.Parameter, index: tuple[slice, ...]) -> nn.Parameter:
    """The part ``index`` of ``param`` as a new parameter that remembers where it came from.

    ``tp_slice`` indexes the full (unsharded) tensor of the model's own parameter shape; a loader that
    reads only a rank's bytes reads exactly that part of the checkpoint. Cloned, so the full tensor is
    freed once the caller drops it; a meta tensor stays meta (sharding before any weight is read)."""
    kept = nn.Parameter(param.data[index].clone(), param.requires_grad)
    kept.tp_slice = index + (slice(None),) * (param.dim() - len(index))
    return kept


def split_columns(linear: nn.Linear, start: int, stop: int) -> None:
    """Keep output features [start, stop) (weight rows, bias entries): a column-parallel slice."""
    linear.weight = keep(linear.weight, (slice(start, stop),))
    if linear.bias is not None:
        linear.bias = keep(linear.bias, (slice(start, stop),))
    linear.out_features = stop - start


def split_rows(linear: nn.Linear, start: int, stop: int, rank: int) -> None:
    """Keep input features [start, stop): a row-parallel slice, whose output is a partial sum.

    The bias stays on rank 0 only: the all-reduce then adds it once."""
    linear.weight = keep(linear.weight, (slice(None), slice(start, stop)))
    if linear.bias is not None and rank != 0:
        linear.bias = None
    linear.in_features = stop - start


def is_mla(attn: nn.Module) -> bool:
    """Whether an HF attention module is multi-head latent attention (DeepSeek-V2/V3, Kimi K2)."""
    return hasattr(attn, "kv_a_proj_with_mqa")


def is_moe(mlp: nn.Module) -> bool:
    """Whether an HF MLP is a mixture of experts: a router (``gate``) over fused ``experts``."""
    return hasattr(mlp, "experts")


DENSE = ("gate_proj", "up_proj", "down_proj")
GQA = ("q_proj", "k_proj", "v_proj", "o_proj")
MOE_PARTS = {"gate", "experts", "shared_experts"}  # the router, the routed experts, the shared ones


def check_attention(attn: nn.Module, config, world_size: int) -> None:
    """Refuse, in one line, attention that ``world_size`` ranks cannot split by whole heads."""
    heads = config.num_attention_heads
    if is_mla(attn):
        if heads % world_size:
            raise DDTreeError(
                f"tensor parallelism over {world_size} ranks needs num_attention_heads ({heads}) "
                f"divisible by {world_size}"
            )
        return
    if not all(hasattr(attn, name) for name in GQA):
        raise DDTreeError(
            f"tensor parallelism shards GQA (q/k/v/o_proj) and MLA attention; this target's is a "
            f"{type(attn).__name__}: run it with --tensor-parallel-size 1"
        )
    kv_heads = config.num_key_value_heads
    if heads % world_size or kv_heads % world_size:
        raise DDTreeError(
            f"tensor parallelism over {world_size} ranks needs num_attention_heads ({heads}) and "
            f"num_key_value_heads ({kv_heads}) divisible by {world_size}"
        )


def check_dense(mlp: nn.Module, what: str, world_size: int) -> None:
    """Refuse a dense MLP (gate/up/down_proj) whose intermediate size ``world_size`` does not divide."""
    if not all(hasattr(mlp, name) for name in DENSE):
        raise DDTreeError(
            f"tensor parallelism shards dense MLPs (gate/up/down_proj) and MoE layers; {what} is a "
            f"{type(mlp).__name__}"
        )
    if mlp.gate_proj.out_features % world_size:
        raise DDTreeError(
            f"tensor parallelism over {world_size} ranks needs the intermediate size of {what} "
            f"({mlp.gate_proj.out_features}) divisible by {world_size}"
        )


def check_mlp(mlp: nn.Module, i: int, world_size: int) -> None:
    """Refuse layer ``i``'s MLP unless it is dense or a MoE of fused experts that ``world_size`` splits."""
    if not is_moe(mlp):
        check_dense(mlp, f"layer {i}'s MLP", world_size)
        return
    parts = {name for name, _ in mlp.named_children()}
    experts = mlp.experts
    num = getattr(experts, "num_experts", None)
    own = list(experts.parameters(recurse=False))  # [E, ...] each: what shard_moe slices by expert
    fused = num is not None and len(own) == len(list(experts.parameters()))
    fused = fused and all(p.dim() >= 2 and p.shape[0] == num for p in own)
    if not parts <= MOE_PARTS or not fused:
        raise DDTreeError(
            f"tensor parallelism shards MoE layers of a router, fused experts and shared experts; "
            f"layer {i}'s is a {type(mlp).__name__} ({', '.join(sorted(parts))})"
        )
    if num % world_size:
        raise DDTreeError(
            f"tensor parallelism over {world_size} ranks needs the routed experts ({num}) divisible by "
            f"{world_size}"
        )
    if hasattr(mlp, "shared_experts"):
        check_dense(mlp.shared_experts, f"layer {i}'s shared experts", world_size)


def shard_attention(attn: nn.Module, config, rank: int, world_size: int) -> None:
    """GQA: this rank's query and KV heads (q/k/v column-parallel), ``o_proj`` row-parallel."""
    q = config.num_attention_heads // world_size * attn.head_dim  # this rank's query features
    kv = config.num_key_value_heads // world_size * attn.head_dim  # its key (and value) features
    split_columns(attn.q_proj, rank * q, (rank + 1) * q)
    split_columns(attn.k_proj, rank * kv, (rank + 1) * kv)
    split_columns(attn.v_proj, rank * kv, (rank + 1) * kv)
    split_rows(attn.o_proj, rank * q, (rank + 1) * q, rank)


def shard_latent_attention(attn: nn.Module, heads: int, rank: int, world_size: int) -> None:
    """MLA: this rank's heads of the query up-projection and of ``kv_b_proj`` (column-parallel), the
    ``o_proj`` columns that read their values (row-parallel). The down-projections and their norms, which
    every head reads, stay whole: so does the latent each rank caches."""
    h = heads // world_size
    q = h * (attn.qk_nope_head_dim + attn.qk_rope_head_dim)  # this rank's query features
    kv = h * (attn.qk_nope_head_dim + attn.v_head_dim)  # its rows of kv_b_proj: W_UK then W_UV per head
    v = h * attn.v_head_dim  # its value features, o_proj's input
    split_columns(attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj, rank * q, (rank + 1) * q)
    split_columns(attn.kv_b_proj, rank * kv, (rank + 1) * kv)
    split_rows(attn.o_proj, rank * v, (rank + 1) * v, rank)


def shard_mlp(mlp: nn.Module, rank: int, world_size: int) -> None:
    """A dense MLP: its intermediate units split, ``gate``/``up`` column- and ``down`` row-parallel."""
    m = mlp.gate_proj.out_features // world_size  # this rank's intermediate units
    split_columns(mlp.gate_proj, rank * m, (rank + 1) * m)
    split_columns(mlp.up_proj, rank * m, (rank + 1) * m)
    split_rows(mlp.down_proj, rank * m, (rank + 1) * m, rank)


def shard_moe(moe: nn.Module, rank: int, world_size: int) -> None:
    """A MoE layer: this rank's contiguous range of routed experts, the shared experts as a dense MLP, the
    router whole. Its output is this rank's partial sum (its experts' weighted outputs, its slice of the
    shared experts'): every expert's output is counted on exactly one rank, and only the shared experts'
    ``down_proj`` bias (rank 0's) can be a replicated term."""
    experts = moe.experts
    e = experts.num_experts // world_size
    start = rank * e
    for name, param in list(experts.named_parameters(recurse=False)):  # [E, ...] each, biases too
        setattr(experts, name, keep(param, (slice(start, start + e),)))
    experts.num_experts = e  # local ids 0..e-1; e is the sentinel the experts' forward skips
    experts.tp_first_expert = start
    experts._is_expert_parallel = True  # HF's grouped/batched forwards then mask the sentinel's rows
    experts.register_forward_pre_hook(route_to_local_experts)
    if hasattr(moe, "shared_experts"):
        shard_mlp(moe.shared_experts, rank, world_size)


def route_to_local_experts(
    experts: nn.Module, args: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The experts' inputs with the router's global expert ids [T, k] made local to this rank: another
    rank's expert becomes the sentinel ``num_experts`` with weight 0 (HF's ``AllReduceEP``)."""
    hidden, index, weights = args  # [T, H], [T, k] global ids, [T, k]
    local = index - experts.tp_first_expert
    elsewhere = (local < 0) | (local >= experts.num_experts)  # [T, k]
    local = torch.where(elsewhere, experts.num_experts, local)
    return hidden, local, weights.masked_fill(elsewhere, 0.0)


def shard_target(target, rank: int, world_size: int) -> None:
    """Shard a loaded HF causal LM in place for ``rank`` of ``world_size``: each layer keeps its slice as
    the module docstring describes. Works on a meta model too (nothing here reads a weight).

    Heads split evenly and contiguously: rank r takes query heads [r * h, (r + 1) * h) and KV heads
    [r * kv, (r + 1) * kv) with h = heads / world_size, kv = kv_heads / world_size. Under GQA query head
    i reads KV head i // (heads / kv_heads), so a rank's query heads read exactly its KV heads. The
    per-head ``q_norm``/``k_norm`` (Qwen3) weigh the head dimension, the same for every head: replicated.
    Every rule is checked before any parameter changes. ``target.config`` keeps the full model's numbers.
    """
    if not 0 <= rank < world_size:
        raise DDTreeError(f"tensor-parallel rank {rank} is outside a world of size {world_size}")
    if any(hasattr(p, "tp_slice") for p in target.parameters()):  # its tp_slice would index a slice
        raise DDTreeError("this target is already sharded: shard_target slices a whole model once")
    config = target.config
    layers = target.get_decoder().layers
    for i, layer in enumerate(layers):  # every check before any layer changes: no half-sharded target
        check_attention(layer.self_attn, config, world_size)
        check_mlp(layer.mlp, i, world_size)
    for layer in layers:
        if is_mla(layer.self_attn):
            shard_latent_attention(layer.self_attn, config.num_attention_heads, rank, world_size)
        else:
            shard_attention(layer.self_attn, config, rank, world_size)
        if is_moe(layer.mlp):
            shard_moe(layer.mlp, rank, world_size)
        else:
            shard_mlp(layer.mlp, rank, world_size)
