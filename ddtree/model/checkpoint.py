"""Slice-wise loading: a rank reads from the safetensors files only the tensors and slices it keeps.

The model is built on the meta device (no weight allocated), sharded there by
``ddtree.model.tensor_parallel.shard_target`` (each sliced parameter records ``tp_slice``, the part of the
full tensor it keeps), and then every parameter is read: its ``tp_slice`` (or the whole tensor) straight from
the files into ``dtype``, through safetensors' ``get_slice``, so a rank's peak host memory is about its
shard plus one tensor. Quantized weights (``ddtree.model.quantization``) are dequantized on the way, only the
blocks or groups the slice covers.

Checkpoint names become the model's parameter names through transformers' own conversion mapping (the
renames and the expert fusions ``from_pretrained`` applies: per-expert ``experts.N.gate_proj.weight`` and
``up_proj`` stacked and concatenated into ``experts.gate_up_proj``), turned into a tree of stack and
concatenate nodes a slice can be pushed through: an expert range reads only those experts' tensors.
"""

from __future__ import annotations

import json
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    Concatenate,
    MergeModulelist,
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
)

from ddtree.errors import DDTreeError
from ddtree.model import quantization

log = logging.getLogger(__name__)

Index = tuple[slice, ...]


@dataclass
class LoadStats:
    """What a load read: bytes from the files (per stored tensor, so a test or a bench can tell the
    experts' from the attention's), and how many tensors took each path."""

    dtype: torch.dtype = torch.float32  # the load's
    read: Counter = field(default_factory=Counter)  # stored key -> bytes read from it
    checkpoint_bytes: int = 0  # the files' tensors, all of them: what a whole-model load reads
    paths: Counter = field(default_factory=Counter)  # float / fp8 / int4 -> tensors read that way

    @property
    def bytes_read(self) -> int:
        return sum(self.read.values())

    def summary(self) -> str:
        """The start-up log line: bytes read against the checkpoint's, and each kind of weight's path."""
        dtype = str(self.dtype).removeprefix("torch.")
        kinds = {
            "float": f"float: read in {dtype}",
            "fp8": f"fp8 block-scaled: dequantized to {dtype} at load",
            "int4": f"int4 pack-quantized: dequantized to {dtype} at load",
        }
        paths = "; ".join(f"{kinds[k]} ({n} tensors)" for k, n in sorted(self.paths.items()))
        share = self.bytes_read / max(1, self.checkpoint_bytes)
        read, whole = self.bytes_read / 2**20, self.checkpoint_bytes / 2**20
        return f"read {read:.1f} MiB of the checkpoint's {whole:.1f} MiB ({share:.0%}); {paths}"


class Checkpoint:
    """A directory's safetensors files as logical float tensors: ``shape(key)`` and ``read(key, index)``.

    A quantized weight appears under its float name (``...weight``), its scales hidden; every read
    counts the bytes it takes from the files."""

    def __init__(self, directory: Path, scheme: quantization.Scheme | None) -> None:
        self.scheme = scheme
        self.stats = LoadStats()
        self.files: dict[str, object] = {}
        self.location: dict[str, str] = {}  # stored key -> file
        for path in self._paths(directory):
            handle = safe_open(path, "pt")
            self.files[str(path)] = handle
            for key in handle.keys():
                self.location[key] = str(path)
        self.kinds: dict[str, str] = {}  # logical key -> float / fp8 / int4
        for key in self.location:
            base, _, leaf = key.rpartition(".")
            if leaf == quantization.FP8_SCALE:
                self.kinds[f"{base}.weight"] = "fp8"
            elif leaf == quantization.INT4_PARTS[0]:
                self.kinds[f"{base}.weight"] = "int4"
        for key in self.location:
            base, _, leaf = key.rpartition(".")
            hidden = leaf == quantization.FP8_SCALE or leaf in quantization.INT4_PARTS
            if not hidden and key not in self.kinds:
                self.kinds[key] = "float"
        self._check_scheme()
        for key in self.location:
            sliced = self._slice(key)
            self.stats.checkpoint_bytes += _numel(sliced.get_shape()) * _itemsize(sliced.get_dtype())

    @staticmethod
    def _paths(directory: Path) -> list[Path]:
        index = directory / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [directory / name for name in files]
        paths = sorted(directory.glob("*.safetensors"))
        if not paths:
            raise DDTreeError(f"target {directory} has no .safetensors files; ddtree loads safetensors only")
        return paths

    def _check_scheme(self) -> None:
        quantized = sorted({k for k in self.kinds.values() if k != "float"})
        expected = {None: [], "fp8": ["fp8"], "compressed-tensors": ["int4"]}
        method = self.scheme.method if self.scheme else None
        if quantized and quantized != expected[method]:
            raise DDTreeError(
                f"checkpoint tensors are {', '.join(quantized)}-quantized but its config says "
                f"quant_method {method!r}"
            )

    def _slice(self, key: str):
        return self.files[self.location[key]].get_slice(key)

    def _take(self, key: str):
        """The stored tensor's lazy slice, whose reads this counts (``_Counted``)."""
        return _Counted(self._slice(key), key, self.stats)

    def keys(self) -> list[str]:
        return list(self.kinds)

    def shape(self, key: str) -> tuple[int, ...]:
        kind = self.kinds[key]
        base = key.removesuffix(".weight")
        if kind == "int4":
            return tuple(int(n) for n in self._slice(f"{base}.weight_shape")[:].tolist())
        return tuple(self._slice(key).get_shape())

    def read(self, key: str, index: Index, dtype: torch.dtype) -> torch.Tensor:
        """``tensor[index]`` in ``dtype``, reading only what ``index`` covers."""
        kind = self.kinds[key]
        self.stats.paths[kind] += 1
        base, shape = key.removesuffix(".weight"), self.shape(key)
        if kind == "fp8":
            weight, scale = self._take(key), self._take(f"{base}.{quantization.FP8_SCALE}")
            return quantization.dequantize_fp8(weight, scale, shape, index, self.scheme.block, dtype)
        if kind == "int4":
            packed, scale = self._take(f"{base}.weight_packed"), self._take(f"{base}.weight_scale")
            return quantization.dequantize_int4(packed, scale, shape, index, self.scheme.group, dtype)
        return self._take(key)[index].to(dtype)


class _Counted:
    """A safetensors slice whose reads add their bytes to ``stats.read[key]``."""

    def __init__(self, sliced, key: str, stats: LoadStats) -> None:
        self.sliced, self.key, self.stats = sliced, key, stats

    def __getitem__(self, index) -> torch.Tensor:
        tensor = self.sliced[index]
        self.stats.read[self.key] += tensor.numel() * tensor.element_size()
        return tensor


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _itemsize(name: str) -> int:
    sizes = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "BF16": 2, "F16": 2, "I16": 2}
    return sizes.get(name, 1)  # F8_E4M3, I8, U8, BOOL


# A parameter's source in the checkpoint: a stored tensor's key, or a stack / concatenation of sources
# (transformers' MergeModulelist and Concatenate), through which a slice is pushed down to the files.
@dataclass(frozen=True)
class Stack:
    parts: tuple  # of sources, stacked on a new leading dimension


@dataclass(frozen=True)
class Concat:
    parts: tuple
    dim: int


def source_shape(checkpoint: Checkpoint, source) -> tuple[int, ...]:
    if isinstance(source, str):
        return checkpoint.shape(source)
    shapes = [source_shape(checkpoint, p) for p in source.parts]
    if isinstance(source, Stack):
        return (len(shapes), *shapes[0])
    shape = list(shapes[0])
    shape[source.dim] = sum(s[source.dim] for s in shapes)
    return tuple(shape)


def read_source(checkpoint: Checkpoint, source, index: Index, dtype: torch.dtype) -> torch.Tensor:
    """``source[index]`` (contiguous slices, one per dimension), reading only the parts it covers, each
    written into the result as it is read (peak memory: the result plus one stored tensor's slice)."""
    shape = source_shape(checkpoint, source)
    index = tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))
    if isinstance(source, str):
        return checkpoint.read(source, index, dtype)
    out = torch.empty(_lengths(index), dtype=dtype)
    if isinstance(source, Stack):
        for i, part in enumerate(source.parts[index[0]]):
            out[i] = read_source(checkpoint, part, index[1:], dtype)
        return out
    offset, lo, hi = 0, index[source.dim].start, index[source.dim].stop
    for part in source.parts:
        n = source_shape(checkpoint, part)[source.dim]
        start, stop = max(lo, offset) - offset, min(hi, offset + n) - offset
        if start < stop:
            sub = list(index)
            sub[source.dim] = slice(start, stop)
            piece = read_source(checkpoint, part, tuple(sub), dtype)
            out.narrow(source.dim, offset + start - lo, stop - start).copy_(piece)
        offset += n
    return out


def _lengths(index: Index) -> list[int]:
    return [s.stop - s.start for s in index]


def plan_sources(naming_model: nn.Module, checkpoint: Checkpoint, wanted: set[str]) -> dict[str, object]:
    """Each name in ``wanted`` (of ``naming_model``'s state dict) that the checkpoint holds -> its source,
    renamed and fused as ``from_pretrained`` does (transformers' conversion mapping for the model).
    Checkpoint keys for anything else (a vision tower ddtree drops, DeepSeek's multi-token-prediction
    layer) are skipped."""
    mapping = get_model_conversion_mapping(naming_model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)]
    names = dict.fromkeys(naming_model.state_dict(), True)
    prefix = naming_model.base_model_prefix
    sources: dict[str, object] = {}
    fused: dict[str, tuple[WeightConverter, dict[str, list[str]]]] = {}
    owner = {p: c for c in converters for p in c.source_patterns}
    for key in sorted(checkpoint.keys(), key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, names)
        if target not in names and key in names:  # as from_pretrained: a key already right stays
            target, pattern = key, None
        if target not in wanted:
            continue
        if pattern is None:
            sources[target] = key
        else:
            converter = owner[pattern]
            fused.setdefault(target, (converter, defaultdict(list)))[1][pattern].append(key)
    for target, (converter, keys) in fused.items():
        sources[target] = _fuse(converter, keys, target)
    return sources


def _fuse(converter: WeightConverter, keys: dict[str, list[str]], target: str):
    """The source tree of a converter's operations, which must be stacks and concatenations."""
    parts: dict[str, object] = {p: tuple(ks) for p, ks in keys.items()}
    for op in converter.operations:
        if isinstance(op, MergeModulelist) and op.dim == 0:
            parts = {p: Stack(ks) for p, ks in parts.items()}
        elif isinstance(op, Concatenate):
            ordered = [parts[p] for p in converter.source_patterns if p in parts]
            parts = {"": Concat(tuple(ordered), op.dim)}
        else:
            raise DDTreeError(
                f"cannot load {target} slice by slice: its checkpoint conversion {type(op).__name__} "
                "is not a stack or concatenation"
            )
    (source,) = parts.values()
    return source


@torch.no_grad()
def materialize(
    model: nn.Module,
    naming_model: nn.Module,
    directory: Path,
    scheme: quantization.Scheme | None,
    dtype: torch.dtype,
    device: torch.device | str,
) -> LoadStats:
    """Read every meta parameter of ``model`` (its ``tp_slice``, or all of it) and every persistent
    buffer the checkpoint holds, in ``dtype``, from ``directory``; compute the non-persistent buffers
    (rotary ``inv_freq``) as ``from_pretrained`` does. ``naming_model`` is the model ``from_pretrained``
    would build (a multimodal wrapper of ``model``), whose names the checkpoint's keys map to."""
    checkpoint = Checkpoint(directory, scheme)
    checkpoint.stats.dtype = dtype
    names = {id(m): n for n, m in naming_model.named_modules()}
    wanted = {
        f"{names[id(m)]}.{n}".lstrip(".") for m in model.modules() for n in (*m._parameters, *m._buffers)
    }
    sources = plan_sources(naming_model, checkpoint, wanted)
    loaded: dict[int, nn.Parameter] = {}  # old parameter id -> its loaded parameter (kept tied ones tied)
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in loaded:
                full = f"{names[id(module)]}.{name}".lstrip(".")
                loaded[id(param)] = _load_parameter(checkpoint, sources, full, param, device)
            module._parameters[name] = loaded[id(param)]
        computed = []
        for name, buffer in list(module._buffers.items()):
            full = f"{names[id(module)]}.{name}".lstrip(".")
            if full in sources:
                value = read_source(checkpoint, sources[full], (slice(None),) * buffer.dim(), buffer.dtype)
                module._buffers[name] = value.to(device)
            elif buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty_like(buffer, device=device)
                computed.append(name)
        if computed:
            naming_model._init_weights(module)  # transformers' own values (rotary inv_freq), as it loads
    return checkpoint.stats


def _load_parameter(
    checkpoint: Checkpoint, sources: dict, full: str, param: nn.Parameter, device
) -> nn.Parameter:
    """The meta ``param`` read from the checkpoint, in the dtype the model was built with for it (the
    load's dtype, or float32 where transformers keeps a module in float32: DeepSeek's router)."""
    if full not in sources:
        raise DDTreeError(f"the checkpoint has no tensor for the model's {full}")
    index = getattr(param, "tp_slice", None) or (slice(None),) * param.dim()
    value = read_source(checkpoint, sources[full], index, param.dtype)
    if value.shape != param.shape:
        raise DDTreeError(
            f"checkpoint tensor {full} gives shape {list(value.shape)}; the model's is {list(param.shape)}"
        )
    kept = nn.Parameter(value.to(device), param.requires_grad)
    if hasattr(param, "tp_slice"):
        kept.tp_slice = param.tp_slice
    return kept
