"""Slice-wise loading (ddtree.model.checkpoint) and quantized checkpoints (ddtree.model.quantization).

A rank's shard read slice by slice equals ``from_pretrained`` + ``shard_target`` exactly, for dense, MoE
and MLA targets (Kimi's multimodal wrapper included); under TP 2 a rank reads exactly what it keeps: half
of the routed experts (its own range, whole experts), of the attention heads' and of the MLPs' weights,
plus the replicated tensors. FP8 block-scaled (DeepSeek-V3 / Kimi K2) and pack-quantized INT4 (Kimi K2.5 /
K2.6 routed experts) checkpoints, written here with the published tensor names and configs, dequantize
within the format's error, exactly as a whole-tensor dequantization would (a rank's slices too), and
decode HF's greedy tokens of the dequantized model. (TP 2 engines over quantized checkpoints:
``tests/test_tensor_parallel_moe.py``.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ddtree.engine import Engine
from ddtree.model.checkpoint import Checkpoint, plan_sources, read_source
from ddtree.model.loader import load_target
from ddtree.model.quantization import PACK, dequantize_fp8, dequantize_int4, unpack_int4
from ddtree.model.tensor_parallel import shard_target
from ddtree.request.params import SamplingParams
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


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Signed 4-bit values [rows, cols] (cols a multiple of 8) into int32 words: unpack_int4's inverse."""
    nibbles = (values.to(torch.int32) + 8).unflatten(-1, (-1, PACK))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (nibbles << shifts).sum(-1, dtype=torch.int32)


def state(model) -> dict[str, torch.Tensor]:
    return {**model.state_dict(), **dict(model.named_buffers())}


def assert_same(a, b) -> None:
    sa, sb = state(a), state(b)
    assert sa.keys() == sb.keys()
    for name, tensor in sa.items():
        assert tensor.dtype == sb[name].dtype and torch.equal(tensor, sb[name]), name


KINDS = ["llama", "qwen3", "deepseek_v3", "deepseek_v3_no_q_lora", "qwen3_moe", "glm4_moe", "kimi_k25"]
HEADS = ("q_proj", "q_b_proj", "k_proj", "v_proj", "kv_b_proj", "o_proj")  # split by attention heads
MLP = ("gate_proj", "up_proj", "down_proj")  # dense MLPs and shared experts: split by intermediate units


@pytest.fixture(scope="module", params=KINDS)
def saved(request, tmp_path_factory) -> Path:
    """A saved target: Llama with random biases (split and kept on rank 0), Qwen3 with tied embeddings,
    and the MoE / MLA targets (8 routed experts; Kimi K2.5's multimodal wrapper) in shards of 200 kB
    listed in ``model.safetensors.index.json``."""
    path = tmp_path_factory.mktemp(request.param)
    if request.param == "llama":
        small_target("llama").save_pretrained(path)
    elif request.param == "qwen3":
        tiny_target("qwen3").save_pretrained(path)
    else:
        tiny_moe_target(request.param, image_token_id=32).save_pretrained(path, max_shard_size="200kB")
        assert (path / "model.safetensors.index.json").is_file()
    return path


def test_a_slice_wise_shard_equals_from_pretrained_then_shard_target(saved):
    """Weights, buffers and ``tp_slice``s equal, and so does the shard's forward (a rank's partial sums):
    what ``shard_target`` set on the meta experts (their range, the routing hook) survives the load."""
    ids = torch.tensor([PROMPTS[0]])
    for rank in range(WORLD):
        whole, _ = load_target(saved)
        shard_target(whole, rank, WORLD)
        shard, _ = load_target(saved, shard=(rank, WORLD))
        assert_same(whole, shard)
        assert torch.equal(whole(ids).logits, shard(ids).logits)
        for name, param in whole.named_parameters():
            assert getattr(shard.get_parameter(name), "tp_slice", None) == getattr(param, "tp_slice", None)
        if whole.config.tie_word_embeddings:
            assert shard.lm_head.weight is shard.model.embed_tokens.weight


def kept_bytes(directory: Path, rank: int) -> int:
    """The bytes rank ``rank`` keeps, from the ``tp_slice`` of each parameter of a meta shard and the full
    model's shapes (the checkpoints here are float32)."""
    full, _ = load_target(directory)
    with torch.device("meta"):
        meta = type(full)(full.config)
    shard_target(meta, rank, WORLD)
    return sum(
        (param if hasattr(param, "tp_slice") else full.get_parameter(name)).numel() * 4
        for name, param in meta.named_parameters()  # a tied parameter once
    )


def stored_sizes(directory: Path) -> dict[str, int]:
    """Each stored tensor's bytes."""
    sizes = {}
    for path in directory.glob("*.safetensors"):
        with safe_open(path, "pt") as f:
            for key in f.keys():
                tensor = f.get_tensor(key)
                sizes[key] = tensor.numel() * tensor.element_size()
    return sizes


def part(key: str) -> str:
    """The part of the model a stored tensor belongs to, by its name: the routed experts, attention's
    per-head projections, the dense / shared-expert MLPs, or the rest (replicated)."""
    if ".mlp.experts." in key:
        return "experts"
    module = key.split(".")[-2]
    return "heads" if module in HEADS else "mlp" if module in MLP else "replicated"


def test_each_rank_reads_its_slices_and_the_replicated_tensors_only(saved, caplog):
    """Under TP 2, counted by the loader per stored tensor: exactly the bytes the rank keeps; half of the
    routed experts' (whole experts, its own range), the attention heads' and the MLPs' weights; every
    other tensor at most whole; never the vision tower."""
    sizes = stored_sizes(saved)
    split = {k for k in sizes if part(k) != "replicated" and k.endswith(".weight")}
    reads = []
    for rank in range(WORLD):
        with caplog.at_level(logging.INFO, logger="ddtree.model.loader"):
            shard, _ = load_target(saved, shard=(rank, WORLD))
        stats = shard.load_stats
        buffers = sum(b.numel() * 4 for n, b in shard.named_buffers() if n in shard.state_dict())
        assert stats.bytes_read == kept_bytes(saved, rank) + buffers  # exactly its slices, nothing twice
        halves = {}
        for kind in ("experts", "heads", "mlp"):
            keys = [k for k in split if part(k) == kind]
            halves[kind] = sum(stats.read[k] for k in keys)
            assert halves[kind] == sum(sizes[k] for k in keys) / WORLD, kind
        rest = sum(n for k, n in sizes.items() if k not in split)
        assert stats.bytes_read <= sum(sizes[k] for k in split) / WORLD + rest
        experts = {int(k.split(".mlp.experts.")[1].split(".")[0]) for k in stats.read if part(k) == "experts"}
        assert experts in (set(), set(range(rank * 4, rank * 4 + 4)))  # of 8: its 4, each read whole
        assert not any("vision" in k for k in stats.read)
        assert f"tensor-parallel rank {rank} of {WORLD}: read" in caplog.text
        reads.append(f"rank {rank}: {stats.bytes_read} ({halves})")
    print(f"{saved.name}: checkpoint {stats.checkpoint_bytes} bytes; {'; '.join(reads)}")


def test_a_slice_across_the_gate_up_concatenation_reads_only_its_rows(tmp_path):
    """transformers fuses each expert's ``gate_proj`` and ``up_proj`` into ``gate_up_proj [E, 2I, H]``
    (stacked, then concatenated); experts 2..3, rows 20..40 (gate is rows [0, 32), up [32, 64)) read rows
    20..32 of those experts' gate_proj and 0..8 of their up_proj, nothing else."""
    tiny_moe_target("deepseek_v3").save_pretrained(tmp_path)
    whole, _ = load_target(tmp_path)
    with torch.device("meta"):
        naming = type(whole)(whole.config)
    checkpoint = Checkpoint(tmp_path, None)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    index = (slice(2, 4), slice(20, 40), slice(None))
    source = plan_sources(naming, checkpoint, {name})[name]
    assert torch.equal(
        read_source(checkpoint, source, index, torch.float32), whole.get_parameter(name)[index]
    )
    rows = {"gate_proj": 12, "up_proj": 8}
    expected = {
        f"model.layers.1.mlp.experts.{e}.{p}.weight": n * 64 * 4 for e in (2, 3) for p, n in rows.items()
    }
    assert checkpoint.stats.read == expected


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


def write_quantized(directory: Path, quantize, config: dict) -> Path:
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


QUANTIZED = {  # kind -> how its checkpoint is quantized (the published layouts; Llama's FP8 for TP 2)
    "llama": (fp8_linear, FP8_CONFIG),
    "deepseek_v3": (fp8_linear, FP8_CONFIG),
    "kimi_k25": (int4_experts, INT4_CONFIG),
}


def save_quantized(target, kind: str, directory: Path) -> Path:
    """``target`` saved in ``directory`` as ``kind``'s checkpoints are quantized (``QUANTIZED``) -> the
    float checkpoint of its dequantized weights beside it (``write_quantized``)."""
    target.save_pretrained(directory)
    if kind == "kimi_k25":  # Kimi's published key names (transformers 5.24 saves "blocks")
        _rename(directory, ".model.blocks.", ".model.layers.")
    return write_quantized(directory, *QUANTIZED[kind])


@pytest.mark.parametrize(
    ("kind", "path"),
    [
        ("deepseek_v3", "fp8 block-scaled: dequantized to float32 at load"),
        ("kimi_k25", "int4 pack-quantized: dequantized to float32 at load"),
    ],
)
def test_a_quantized_checkpoint_dequantizes_at_load_and_decodes_hf_greedy(kind, path, tmp_path, caplog):
    target = tiny_moe_target(kind, image_token_id=32)
    directory = tmp_path / kind
    reference = save_quantized(target, kind, directory)
    moe_drafter(target).save_pretrained(tmp_path / "drafter")
    with caplog.at_level(logging.INFO, logger="ddtree.model.loader"):
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


@pytest.mark.parametrize("kind", list(QUANTIZED))
def test_tensor_parallel_shards_of_a_quantized_checkpoint_equal_the_dequantized_models(kind, tmp_path):
    """TP 2 of Llama and DeepSeek-V3 in FP8 with 128 x 128 blocks (the 64-column slices cut blocks in
    half; DeepSeek's experts too) and of Kimi K2.5's INT4 experts (each rank unpacks its 4 of 8)."""
    target = small_target("llama") if kind == "llama" else tiny_moe_target(kind, image_token_id=32)
    reference = save_quantized(target, kind, tmp_path / kind)
    for rank in range(WORLD):
        expected, _ = load_target(reference)
        shard_target(expected, rank, WORLD)
        shard, _ = load_target(tmp_path / kind, shard=(rank, WORLD))
        assert_same(expected, shard)


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
