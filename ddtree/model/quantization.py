"""Quantized checkpoint formats, dequantized slice by slice at load.

Two published formats load: FP8 with 128 x 128 block scales (DeepSeek-V3, Kimi K2: ``quant_method: fp8``,
a float8_e4m3fn ``weight`` and a float32 ``weight_scale_inv`` per block, dequantized as
``fp8 * scale_inv`` in float32, as DeepSeek's ``fp8_cast_bf16.py`` does) and compressed-tensors'
``pack-quantized`` INT4 (Kimi K2.5 / K2.6 routed experts: symmetric, a scale per group of input columns;
``weight_packed`` int32 holds eight 4-bit values, value j of a row in bits 4 * (j % 8) of word j // 8,
each stored as q + 8; ``weight_scale`` and ``weight_shape`` beside it, as compressed-tensors'
``pack_to_int32`` writes them). Which tensors are quantized is read from the files, not the config's
``ignore`` list: a weight stored with a scale beside it is quantized, any other is float.

A reader dequantizes only the part a rank keeps: the rows and columns it asked for, with the scale blocks
(or groups) that cover them, so a shard never holds a whole quantized tensor in float.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddtree.errors import DDTreeError

FP8_SCALE = "weight_scale_inv"
INT4_PARTS = ("weight_packed", "weight_scale", "weight_shape")
PACK = 8  # 4-bit values per int32 word


@dataclass(frozen=True)
class Scheme:
    """A checkpoint's quantization as ddtree reads it: the method and its block (FP8) or group (INT4)."""

    method: str
    block: tuple[int, int] = (128, 128)  # FP8: rows x columns per scale
    group: int = 32  # INT4: input columns per scale


def scheme(config: dict) -> Scheme | None:
    """The checkpoint's ``quantization_config`` (a wrapper's own, else its text config's) as a Scheme;
    None for a float checkpoint. A method or variant ddtree cannot dequantize is a one-line DDTreeError."""
    quant = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not quant:
        return None
    method = quant.get("quant_method")
    if method == "fp8":
        block = quant.get("weight_block_size")
        if not block or len(block) != 2:
            raise DDTreeError(
                f"fp8 checkpoint without 2-D block scales (weight_block_size {block!r}); ddtree loads "
                "block-scaled FP8 (DeepSeek-V3 / Kimi K2 format) only"
            )
        return Scheme("fp8", block=(int(block[0]), int(block[1])))
    if method == "compressed-tensors":
        return Scheme("compressed-tensors", group=_int4_group(quant))
    raise DDTreeError(
        f"checkpoint quant_method {method!r} is not supported; ddtree loads float, fp8 (block-scaled) and "
        "compressed-tensors (pack-quantized int4) checkpoints"
    )


def _int4_group(quant: dict) -> int:
    """The group size of a compressed-tensors config whose every group is symmetric pack-quantized INT4."""
    groups = list((quant.get("config_groups") or {}).values())
    fmt = quant.get("format")
    sizes = set()
    for group in groups:
        weights = group.get("weights") or {}
        kind = (group.get("format") or fmt, weights.get("num_bits"), weights.get("type"))
        activations = bool(group.get("input_activations"))
        if kind != ("pack-quantized", 4, "int") or not weights.get("symmetric") or activations:
            raise DDTreeError(
                f"compressed-tensors scheme {kind[0]} {kind[2]}{kind[1]} (symmetric "
                f"{weights.get('symmetric')}, activations {activations}) is not "
                "supported; ddtree loads symmetric pack-quantized int4 weights only"
            )
        sizes.add(int(weights.get("group_size") or 0))
    if len(sizes) != 1 or min(sizes) <= 0:
        raise DDTreeError(
            f"compressed-tensors needs one positive group_size; the checkpoint has {sorted(sizes)}"
        )
    return sizes.pop()


def _span(index: slice, size: int) -> tuple[int, int]:
    start, stop, step = index.indices(size)
    if step != 1:
        raise DDTreeError(f"a checkpoint slice must be contiguous, got step {step}")
    return start, max(start, stop)


def _expand(scales: torch.Tensor, block: tuple[int, int], rows: tuple[int, int], cols: tuple[int, int]):
    """Per-element scales for rows x cols from the per-block ``scales`` that cover them (first block at
    rows[0] // block[0], cols[0] // block[1])."""
    full = scales.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    r0, c0 = rows[0] % block[0], cols[0] % block[1]
    return full[r0 : r0 + rows[1] - rows[0], c0 : c0 + cols[1] - cols[0]]


def dequantize_fp8(weight, scale, shape: tuple[int, int], index, block: tuple[int, int], dtype):
    """``weight[index]`` of an FP8 block-scaled tensor in ``dtype``: ``weight`` and ``scale`` are
    safetensors slices (read here, only the rows, columns and blocks ``index`` covers)."""
    rows, cols = (_span(i, n) for i, n in zip(index, shape, strict=True))
    values = weight[rows[0] : rows[1], cols[0] : cols[1]].to(torch.float32)
    if 0 in values.shape:
        return values.to(dtype)
    covered = [slice(lo // b, (hi - 1) // b + 1) for (lo, hi), b in zip((rows, cols), block, strict=True)]
    blocks = scale[covered[0], covered[1]]
    return (values * _expand(blocks.to(torch.float32), block, rows, cols)).to(dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit values from int32 words (eight a word, the lowest bits first, each stored as q + 8)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [rows, words, 8]
    return nibbles.flatten(-2).to(torch.int8) - 8


def dequantize_int4(packed, scale, shape: tuple[int, int], index, group: int, dtype) -> torch.Tensor:
    """``weight[index]`` of a pack-quantized INT4 tensor in ``dtype``: reads only the rows, the int32
    words and the scale groups that ``index`` covers."""
    rows, cols = (_span(i, n) for i, n in zip(index, shape, strict=True))
    if rows[0] == rows[1] or cols[0] == cols[1]:
        return torch.empty(rows[1] - rows[0], cols[1] - cols[0], dtype=dtype)
    w0, g0 = cols[0] // PACK, cols[0] // group
    words = packed[rows[0] : rows[1], w0 : -(-cols[1] // PACK)]
    values = unpack_int4(words)[:, cols[0] - w0 * PACK : cols[1] - w0 * PACK]
    scales = scale[rows[0] : rows[1], g0 : (cols[1] - 1) // group + 1].to(torch.float32)
    per_column = scales.repeat_interleave(group, 1)[:, cols[0] - g0 * group : cols[1] - g0 * group]
    return (values.to(torch.float32) * per_column).to(dtype)
