"""The dtypes matmuls run in where rounding cannot change what is emitted: the drafter's (it only proposes
tokens) and a CPU prefill's linear layers (float32 where bf16 / fp16 run only emulated); and the layout a
head's matmul over a slice of positions takes (``rows_linear``)."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:  # hints only: the verify path imports this module without transformers
    from ddtree.speculative.drafter import DFlashDrafter

HALF_PRECISION = (torch.bfloat16, torch.float16)  # the dtypes whose rounding the rules here are about
FLOAT32_PREFILL_TOKENS = 16  # a prefill forward this large computes its linear layers in float32 ...


def rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` of x [..., H] as one 2-D matmul over its rows -> [..., O]. A strided 3-D input (a slice of
    a block's positions, a bucket's real rows and nodes) otherwise runs as a bmm over a copy of the weight
    per leading row: bf16 on this CPU 62 ms against 0.9 ms for 16 x 17 x 256 -> 4,096 (float32 9.2
    against 4.2 ms; with the backward of a training step, 40 against 23 ms)."""
    return F.linear(x.reshape(-1, x.shape[-1]), weight, bias).view(*x.shape[:-1], weight.shape[0])


def fast_low_precision(device: torch.device) -> torch.dtype:
    """bfloat16 where matmuls run it natively (CUDA with bf16, CPUs with AVX512-BF16), else float32."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    native = device.type == "cpu" and torch.cpu._is_avx512_bf16_supported()
    return torch.bfloat16 if native else torch.float32


def emulated_half(device: torch.device, dtype: torch.dtype) -> bool:
    """... on a CPU whose matmuls run bf16 / fp16 only emulated (``Float32Linear``: measured, 4-6x faster
    prefill there)."""
    return device.type == "cpu" and dtype in HALF_PRECISION and (fast_low_precision(device) == torch.float32)


def head_floor_rows(device: torch.device, weight: torch.Tensor) -> int:
    """Rows below which an LM-head call costs no less: the head is one [rows, H] x [H, V] matmul.

    On a GPU a small call is bound by reading the [V, H] weight; at an H200's ~200 flops per byte of HBM a
    bf16 weight's read costs as much as ~200 rows' multiply-adds (a roofline estimate, to be measured by
    ``scripts/device_round.py``). On a CPU the matmul is compute-bound, and what a call costs on top is
    its dispatch (~10 ops, ~0.1 ms, about 2^23 multiply-adds here).
    """
    if device.type == "cuda":
        return 256
    return max(1, -(-(1 << 23) // weight.numel()))


def with_mlp_dtype(drafter: DFlashDrafter, dtype: torch.dtype) -> DFlashDrafter:
    """``drafter``, or a copy of it whose MLP weights are ``dtype`` (the caller's module is left alone)."""
    if all(p.dtype == dtype for layer in drafter.layers for p in layer.mlp.parameters()):
        return drafter
    drafter = copy.deepcopy(drafter)
    for layer in drafter.layers:
        layer.mlp.to(dtype)
    return drafter


def draft_parts(
    drafter: DFlashDrafter | None, lm_head: torch.nn.Module, dtype: torch.dtype | None
) -> tuple[DFlashDrafter | None, torch.Tensor | None, torch.Tensor | None]:
    """The drafter and its LM head (a copy of the target's [V, H], and its bias) for drafting.

    The drafter only proposes tokens, so rounding in its matmuls cannot change what is emitted. Its LM head
    and its MLPs, the largest matmuls of a draft pass, run in ``dtype`` (by default
    ``fast_low_precision``): bf16 reads half the bytes and runs natively where supported (attention and
    norms stay in the model's dtype: bf16 is slower there on CPUs)."""
    if drafter is None:
        return None, None, None
    dtype = dtype or fast_low_precision(lm_head.weight.device)
    bias = None if lm_head.bias is None else lm_head.bias.detach().to(dtype)
    return with_mlp_dtype(drafter.eval(), dtype), lm_head.weight.detach().to(dtype), bias
