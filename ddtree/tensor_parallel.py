"""Tensor parallelism for the target, as Megatron-LM splits a transformer (Shoeybi et al., 2019).

Each rank holds a slice of every layer: the query/key/value projections of its own attention heads and
KV heads (column-parallel, by whole heads), the input columns of ``o_proj`` that read those heads
(row-parallel), and a slice of the MLP's intermediate units (``gate_proj``/``up_proj`` column-parallel,
``down_proj`` row-parallel). A rank then computes attention for its heads alone, with a KV cache of its
KV heads alone, and its share of the MLP; ``o_proj`` and ``down_proj`` each leave a partial sum of the
full output, so ``ddtree.forward.TargetForward`` all-reduces after each: two all-reduces per layer, and
the residual stream (embedding, norms, LM head: replicated) is the same on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def shard_target(target, rank: int, world_size: int) -> None:
    """Shard a loaded HF causal LM (Qwen3, Qwen2, Llama, Mistral layout) in place for ``rank`` of
    ``world_size``: each layer keeps its slice as the module docstring describes.

    Heads split evenly and contiguously: rank r takes query heads [r * h, (r + 1) * h) and KV heads
    [r * kv, (r + 1) * kv) with h = heads / world_size, kv = kv_heads / world_size. Under GQA query head
    i reads KV head i // (heads / kv_heads), so a rank's query heads read exactly its KV heads. The
    per-head ``q_norm``/``k_norm`` (Qwen3) weigh the head dimension, the same for every head: replicated.
    ``target.config`` keeps the full model's numbers.
    """
    config = target.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if not 0 <= rank < world_size:
        raise DDTreeError(f"tensor-parallel rank {rank} is outside a world of size {world_size}")
    attn = target.get_decoder().layers[0].self_attn
    if not all(hasattr(attn, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
        raise DDTreeError(
            f"tensor parallelism shards GQA attention (q/k/v/o_proj); this target's is a "
            f"{type(attn).__name__} (MLA): run it with --tensor-parallel-size 1"
        )
    if heads % world_size or kv_heads % world_size:
        raise DDTreeError(
            f"tensor parallelism over {world_size} ranks needs num_attention_heads ({heads}) and "
            f"num_key_value_heads ({kv_heads}) divisible by {world_size}"
        )
    layers = target.get_decoder().layers
    for i, layer in enumerate(layers):  # every check before any layer changes: no half-sharded target
        mlp = layer.mlp
        if not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
            raise DDTreeError(
                f"tensor parallelism shards dense MLPs (gate/up/down_proj); layer {i}'s is a "
                f"{type(mlp).__name__}"
            )
        if mlp.gate_proj.out_features % world_size:
            raise DDTreeError(
                f"tensor parallelism over {world_size} ranks needs the MLP's intermediate size "
                f"({mlp.gate_proj.out_features}) divisible by {world_size}"
            )
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        q = heads // world_size * attn.head_dim  # this rank's query features
        kv = kv_heads // world_size * attn.head_dim  # its key (and value) features
        m = mlp.gate_proj.out_features // world_size  # its intermediate units
        split_columns(attn.q_proj, rank * q, (rank + 1) * q)
        split_columns(attn.k_proj, rank * kv, (rank + 1) * kv)
        split_columns(attn.v_proj, rank * kv, (rank + 1) * kv)
        split_rows(attn.o_proj, rank * q, (rank + 1) * q, rank)
        split_columns(mlp.gate_proj, rank * m, (rank + 1) * m)
        split_columns(mlp.up_proj, rank * m, (rank + 1) * m)
        split_rows(mlp.down_proj, rank * m, (rank + 1) * m, rank)
