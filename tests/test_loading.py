"""Slice-wise loading (ddtree.checkpoint) and quantized checkpoints (ddtree.quantization).

A rank's shard read slice by slice equals ``from_pretrained`` + ``shard_target`` exactly, reading about
1 / world of the sliced tensors plus the replicated ones; MoE and MLA targets (Kimi's multimodal wrapper
included) load exactly as ``from_pretrained`` does, and an expert range reads only those experts. FP8
block-scaled (DeepSeek-V3 / Kimi K2) and pack-quantized INT4 (Kimi K2.5 / K2.6 routed experts)
checkpoints, written here with the published tensor names and configs, dequantize within the format's
error, exactly as a whole-tensor dequantization would, and decode HF's greedy tokens of the dequantized
model."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import ddtree.models as models_module
from ddtree.engine import Engine
from ddtree.models import load_target
from ddtree.params import SamplingParams
from ddtree.quantization import dequantize_fp8, dequantize_int4, pack_int4, unpack_int4
from ddtree.tensor_parallel import keep, shard_target
from tests.conftest import moe_drafter, tiny_moe_target, tiny_target
from tests.test_engine_greedy import hf_greedy
from tests.test_loaders import refusal
from tests.test_tensor_parallel import small_target

WORLD = 2
PROMPTS = [[1, 5, 9, 22, 3, 7, 7, 2], [30, 2, 2, 14, 8, 19, 25, 11, 4, 0, 6]]
NEW = 16
FP8_CONFIG = {  # DeepSeek-V3 / Kimi K2's
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
INT4_CONFIG = {  # Kimi K2.5 / K2.6's: routed experts int4, everything in ``ignore`` bf16
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}


def state(model) -> dict[str, torch.Tensor]:
    return {**model.state_dict(), **dict(model.named_buffers())}


def assert_same(a, b) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for name, tensor in sa.items():
        assert tensor.dtype == sb[name].dtype and torch.equal(tensor, sb[name]), name


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def dense(request, tmp_path_factory) -> Path:
    """A saved dense target: Llama with random biases (split and kept on rank 0), Qwen3 with tied
    embeddings."""
    path = tmp_path_factory.mktemp(request.param)
    (small_target("llama") if request.param == "llama" else tiny_target("qwen3")).save_pretrained(path)
    return path


def test_a_slice_wise_shard_equals_from_pretrained_then_shard_target(dense):
    for rank in range(WORLD):
        whole, _ = load_target(dense)
        shard_target(whole, rank, WORLD)
        shard, _ = load_target(dense, shard=(rank, WORLD))
        assert_same(whole, shard)
        for name, param in whole.named_parameters():
            assert getattr(shard.get_parameter(name), "tp_slice", None) == getattr(param, "tp_slice", None)
        if whole.config.tie_word_embeddings:
            assert shard.lm_head.weight is shard.model.embed_tokens.weight


def kept_bytes(directory: Path, rank: int) -> tuple[int, int, int]:
    """(bytes rank ``rank`` keeps, bytes of the tensors it slices, bytes of those it holds whole), from
    the ``tp_slice`` of each parameter of a meta shard and the full model's shapes: the loader's bound,
    whichever parameters ``shard_target`` slices."""
    full, _ = load_target(directory)
    itemsize = 4  # the checkpoints here are float32
    with torch.device("meta"):
        meta = type(full)(full.config)
    shard_target(meta, rank, WORLD)
    kept = sliced = whole = 0
    for name, param in meta.named_parameters():  # a tied parameter once
        size = full.get_parameter(name).numel() * itemsize
        if hasattr(param, "tp_slice"):
            sliced += size
            kept += param.numel() * itemsize
        else:
            whole += size
            kept += size
    return kept, sliced, whole


def test_each_rank_reads_its_slices_and_the_replicated_tensors_only(dense, caplog):
    reads = []
    for rank in range(WORLD):
        with caplog.at_level(logging.INFO, logger="ddtree.models"):
            shard, _ = load_target(dense, shard=(rank, WORLD))
        stats = shard.load_stats
        kept, sliced, whole = kept_bytes(dense, rank)
        buffers = sum(b.numel() * 4 for n, b in shard.named_buffers() if n in shard.state_dict())
        assert stats.bytes_read == kept + buffers  # exactly its slices, nothing read twice
        assert stats.bytes_read <= sliced / WORLD + whole + buffers
        assert stats.bytes_read < stats.checkpoint_bytes
        assert f"tensor-parallel rank {rank} of {WORLD}: read" in caplog.text
        reads.append(stats.bytes_read)
    print(f"{dense.name}: checkpoint {stats.checkpoint_bytes} bytes, ranks read {reads}")


def save_moe(kind: str, root: Path) -> Path:
    """A tiny ``kind`` target saved in shards of 200 kB (``model.safetensors.index.json``)."""
    target = tiny_moe_target(kind, image_token_id=32)
    target.save_pretrained(root / kind, max_shard_size="200kB")
    return root / kind


@pytest.mark.parametrize("kind", ["deepseek_v3", "kimi_k25", "glm4_moe"])
def test_moe_and_mla_targets_load_slice_wise_exactly_as_from_pretrained(kind, tmp_path):
    directory = save_moe(kind, tmp_path)
    assert (directory / "model.safetensors.index.json").is_file()
    whole, _ = load_target(directory)
    sliced, _ = load_target(directory, shard=(0, 1))
    assert_same(whole, sliced)
    if kind == "kimi_k25":  # the vision tower is never read
        assert sliced.load_stats.bytes_read < 0.9 * sliced.load_stats.checkpoint_bytes


def split_experts(target, rank: int, world_size: int) -> None:
    """Expert parallelism's slices, as a stand-in for shard_target's: each MoE layer keeps experts
    [rank * E / N, (rank + 1) * E / N) of the fused ``gate_up_proj`` / ``down_proj``, and rank 0 also
    cuts gate_up_proj's rows across the gate / up boundary (a slice through a concatenation)."""
    for layer in target.model.layers:
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        n = experts.gate_up_proj.shape[0] // world_size
        rows = slice(20, 40) if rank == 0 else slice(None)  # gate is rows [0, 32), up [32, 64)
        experts.gate_up_proj = keep(experts.gate_up_proj, (slice(rank * n, (rank + 1) * n), rows))
        experts.down_proj = keep(experts.down_proj, (slice(rank * n, (rank + 1) * n),))


def test_an_expert_range_reads_only_its_experts(tmp_path, monkeypatch):
    directory = save_moe("deepseek_v3", tmp_path)
    whole, _ = load_target(directory)
    monkeypatch.setattr(models_module, "shard_target", split_experts)
    reads = []
    for rank in range(WORLD):
        shard, _ = load_target(directory, shard=(rank, WORLD))
        for name, param in whole.named_parameters():
            kept = shard.get_parameter(name)
            part = param[kept.tp_slice] if hasattr(kept, "tp_slice") else param
            assert torch.equal(kept, part), name
        reads.append(shard.load_stats.bytes_read)
    gate_up = sum(p.numel() * 4 for n, p in whole.named_parameters() if n.endswith("experts.gate_up_proj"))
    down = sum(p.numel() * 4 for n, p in whole.named_parameters() if n.endswith("experts.down_proj"))
    everything = load_target(directory, shard=(0, 1))[0].load_stats.bytes_read
    assert reads[1] == everything - (gate_up + down) / 2  # half the experts, nothing else less
    assert reads[1] - reads[0] == gate_up / 2 * (1 - 20 / 64)  # rank 0: 20 of each expert's 64 rows
    expert_bytes = gate_up + down
    print(f"deepseek_v3 expert split: experts {expert_bytes} bytes, ranks read {reads}")


# Writing quantized checkpoints with the published names


def fp8_quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 ``weight_scale_inv`` per block): each block's max at 448."""
    rows, cols = weight.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    padded = torch.zeros(nr * block[0], nc * block[1])
    padded[:rows, :cols] = weight
    blocks = padded.view(nr, block[0], nc, block[1])
    scale = (blocks.abs().amax((1, 3)) / 448).clamp(min=1e-12)
    q = (blocks / scale[:, None, :, None]).view_as(padded)[:rows, :cols].to(torch.float8_e4m3fn)
    return q, scale


def fp8_reference(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """DeepSeek's ``weight_dequant``, whole tensor: fp8 * its block's scale, in float32."""
    per = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return q.to(torch.float32) * per[: q.shape[0], : q.shape[1]]


def int4_quantize(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 values in [-8, 7], bf16 scale per group of ``group`` input columns): symmetric, max at 7."""
    groups = weight.unflatten(1, (-1, group))
    scale = (groups.abs().amax(-1) / 7).clamp(min=1e-8).to(torch.bfloat16)
    q = (groups / scale.float()[..., None]).round().clamp(-8, 7).flatten(1).to(torch.int8)
    return q, scale


def write_quantized(directory: Path, quantize, config: dict, root_config: bool = True) -> Path:
    """Rewrite a saved float checkpoint as a quantized one (``quantize(key, tensor)`` -> the tensors to
    store for that key, or None to keep it float), and a float checkpoint of the dequantized weights
    beside it (``<name>-dequantized``): the model HF runs for the reference."""
    path = directory / "model.safetensors"
    with safe_open(path, "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    quantized, dequantized = {}, {}
    for key, tensor in tensors.items():
        stored = quantize(key, tensor)
        if stored is None:
            quantized[key] = dequantized[key] = tensor
        else:
            parts, float_value = stored
            quantized.update(parts)
            dequantized[key] = float_value
    reference = directory.with_name(directory.name + "-dequantized")
    reference.mkdir()
    for name in ("config.json", "generation_config.json"):
        (reference / name).write_text((directory / name).read_text())
    save_file(dequantized, reference / "model.safetensors", metadata={"format": "pt"})
    save_file(quantized, path, metadata={"format": "pt"})
    fields = json.loads((directory / "config.json").read_text())
    fields["quantization_config"] = config
    (directory / "config.json").write_text(json.dumps(fields))
    return reference


def fp8_linear(key: str, tensor: torch.Tensor):
    """DeepSeek-V3's FP8 layout: every linear weight of a decoder layer but the router's."""
    if ".layers." not in key or not key.endswith(("_proj.weight", "_mqa.weight")):
        return None
    q, scale = fp8_quantize(tensor, (128, 128))
    base = key.removesuffix(".weight")
    return {key: q, f"{base}.weight_scale_inv": scale}, fp8_reference(q, scale, (128, 128))


def int4_experts(key: str, tensor: torch.Tensor):
    """Kimi K2.5's INT4 layout: routed experts only, compressed-tensors' names."""
    if ".mlp.experts." not in key:
        return None
    q, scale = int4_quantize(tensor, 32)
    base = key.removesuffix(".weight")
    parts = {
        f"{base}.weight_packed": pack_int4(q),
        f"{base}.weight_scale": scale,
        f"{base}.weight_shape": torch.tensor(tensor.shape),
    }
    per_column = scale.float().repeat_interleave(32, 1)
    return parts, q.float() * per_column


def decode(directory: Path, drafter: Path) -> dict[str, list[list[int]]]:
    engine = Engine.from_pretrained(directory, drafter, max_model_len=64, max_num_seqs=2)
    params = SamplingParams(max_new_tokens=NEW)
    return {m: [r.token_ids for r in engine.generate(PROMPTS, params, method=m)] for m in ("ar", "ddtree")}


@pytest.mark.parametrize(
    ("kind", "quantize", "config", "path"),
    [
        ("deepseek_v3", fp8_linear, FP8_CONFIG, "fp8 block-scaled: dequantized to float32 at load"),
        ("kimi_k25", int4_experts, INT4_CONFIG, "int4 pack-quantized: dequantized to float32 at load"),
    ],
)
def test_a_quantized_checkpoint_dequantizes_at_load_and_decodes_hf_greedy(
    kind, quantize, config, path, tmp_path, caplog
):
    target = tiny_moe_target(kind, image_token_id=32)
    directory = tmp_path / kind
    target.save_pretrained(directory)
    if kind == "kimi_k25":  # Kimi's published key names (transformers 5.24 saves "blocks")
        _rename(directory, ".model.blocks.", ".model.layers.")
    moe_drafter(target).save_pretrained(tmp_path / "drafter")
    reference = write_quantized(directory, quantize, config)
    with caplog.at_level(logging.INFO, logger="ddtree.models"):
        loaded, _ = load_target(directory)
    assert path in caplog.text
    dequantized, _ = load_target(reference)  # from_pretrained of the whole-tensor dequantization
    assert_same(loaded, dequantized)
    original, _ = load_target(_float_copy(target, tmp_path / "original"))
    for name, param in original.named_parameters():
        error = (loaded.get_parameter(name) - param).abs().max()
        # FP8 e4m3: 3 mantissa bits, relative error <= 2^-4; INT4: half a step of max / 7
        assert error <= param.abs().max() * (2**-4 if kind == "deepseek_v3" else 1 / 14 + 1e-2), name
    expected = [hf_greedy(dequantized, p, NEW) for p in PROMPTS]
    assert decode(directory, tmp_path / "drafter") == {"ar": expected, "ddtree": expected}


def _float_copy(target, directory: Path) -> Path:
    target.save_pretrained(directory)
    return directory


def _rename(directory: Path, old: str, new: str) -> None:
    path = directory / "model.safetensors"
    with safe_open(path, "pt") as f:
        tensors = {k.replace(old, new): f.get_tensor(k) for k in f.keys()}
    save_file(tensors, path, metadata={"format": "pt"})


def test_tensor_parallel_shards_of_an_fp8_checkpoint_equal_the_dequantized_models(tmp_path):
    """Llama at TP 2 in FP8 with 128 x 128 blocks: the 64-column slices cut blocks in half."""
    directory = tmp_path / "llama"
    small_target("llama").save_pretrained(directory)
    reference = write_quantized(directory, fp8_linear, FP8_CONFIG)
    for rank in range(WORLD):
        expected, _ = load_target(reference)
        shard_target(expected, rank, WORLD)
        shard, _ = load_target(directory, shard=(rank, WORLD))
        assert_same(expected, shard)


def test_an_fp8_checkpoint_decodes_the_same_tokens_under_tensor_parallelism(tmp_path):
    """The whole path: rank 1 spawned, each rank dequantizing its own slices; greedy ``ddtree`` at TP 2
    emits ``ar``'s tokens of one process on the same checkpoint."""
    target = small_target("llama")
    target.save_pretrained(tmp_path / "target")
    moe_drafter(target).save_pretrained(tmp_path / "drafter")
    write_quantized(tmp_path / "target", fp8_linear, FP8_CONFIG)
    options = dict(dtype=torch.float32, max_model_len=64, max_num_seqs=2, kv_cache_memory="16MiB")
    params = SamplingParams(max_new_tokens=NEW)
    single = Engine.from_pretrained(tmp_path / "target", tmp_path / "drafter", **options)
    expected = [r.token_ids for r in single.generate(PROMPTS, params, method="ar")]
    assert all(len(set(e)) > 3 for e in expected)  # not one repeated token
    with Engine.from_pretrained(
        tmp_path / "target", tmp_path / "drafter", tensor_parallel_size=WORLD, **options
    ) as sharded:
        assert [r.token_ids for r in sharded.generate(PROMPTS, params, method="ddtree")] == expected


def test_fp8_and_int4_slices_dequantize_as_the_whole_tensor_does():
    torch.manual_seed(0)
    weight = torch.randn(300, 200)
    q, scale = fp8_quantize(weight, (128, 128))
    whole = fp8_reference(q, scale, (128, 128))
    q4, scale4 = int4_quantize(weight, 40)
    whole4 = q4.float() * scale4.float().repeat_interleave(40, 1)
    for index in [
        (slice(None), slice(None)),
        (slice(100, 250), slice(5, 133)),
        (slice(129, 130), slice(199, 200)),
    ]:
        assert torch.equal(
            dequantize_fp8(q, scale, (300, 200), index, (128, 128), torch.float32), whole[index]
        )
        packed = pack_int4(q4)
        assert torch.equal(
            dequantize_int4(packed, scale4, (300, 200), index, 40, torch.float32), whole4[index]
        )


def test_int4_words_hold_eight_values_lowest_bits_first_offset_by_eight():
    """compressed-tensors' pack_to_int32: value j of a row in bits 4 * (j % 8) of word j // 8, as q + 8."""
    values = torch.tensor([[-8, -1, 0, 1, 2, 3, 4, 7]], dtype=torch.int8)
    word = sum((int(v) + 8) << (4 * j) for j, v in enumerate(values[0]))
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and int(packed[0, 0]) % 2**32 == word
    assert torch.equal(unpack_int4(packed), values)


def test_an_unknown_quant_method_is_refused_in_one_line(tmp_path):
    directory = tmp_path / "awq"
    tiny_target().save_pretrained(directory)
    fields = json.loads((directory / "config.json").read_text())
    fields["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (directory / "config.json").write_text(json.dumps(fields))
    message = refusal(load_target, directory)
    assert "quant_method 'awq' is not supported" in message
