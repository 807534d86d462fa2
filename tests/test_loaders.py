"""Loaders: every supported target type runs exactly (the engine's greedy output is HF's), and what the
engine's full-attention forward cannot reproduce is refused in one line before any weight is loaded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from ddtree.cli import main
from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.model.loader import (
    DTYPE_CHOICES,
    SUPPORTED_MODEL_TYPES,
    load_drafter,
    load_target,
    resolve_dtype,
)
from ddtree.request.params import SamplingParams
from tests.conftest import tiny_config_fields, tiny_drafter, tiny_target, tiny_tokenizer

ARCHS = ("qwen3_moe", "qwen2", "mistral", "llama")
CLASSES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "llama": (LlamaConfig, LlamaForCausalLM),
}
CONTEXT = 256
PROMPT = "def fibonacci(n):"
NEW_TOKENS = 24
TOKENIZER = tiny_tokenizer()


def small_config(arch: str, **overrides):
    """A 4-layer config like conftest's tiny_target (init 0.3: greedy output varies); MoE with 4 experts,
    top-2, so routing matters."""
    fields = tiny_config_fields(len(TOKENIZER)) | {"max_position_embeddings": CONTEXT}
    if arch == "qwen3_moe":
        fields |= dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    if arch == "mistral":
        fields["sliding_window"] = None  # Mistral v0.2 and later: full attention
    return CLASSES[arch][0](**(fields | overrides))


def save_target(directory: Path, arch: str, **overrides):
    torch.manual_seed(0)
    target = CLASSES[arch][1](small_config(arch, **overrides)).eval()
    target.save_pretrained(directory)
    TOKENIZER.save_pretrained(directory)
    return target


def write_config(directory: Path, config: dict) -> Path:
    """A directory with a config.json and no weights: a refusal must come before any weight is read."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def hf_greedy(target, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = target.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=TOKENIZER.eos_token_id,
            pad_token_id=TOKENIZER.eos_token_id,
        )
    return out[0, len(prompt_ids) :].tolist()


def refusal(call, *args, **kwargs) -> str:
    """The one-line DDTreeError message ``call`` raises."""
    with pytest.raises(DDTreeError) as exc:
        call(*args, **kwargs)
    message = str(exc.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="module", params=ARCHS)
def saved(request, tmp_path_factory):
    """(arch, HF target, target dir, drafter dir, prompt ids, HF's greedy continuation)."""
    root = tmp_path_factory.mktemp(request.param)
    target = save_target(root / "target", request.param)
    drafter = tiny_drafter(target)
    drafter.mask_token_id = TOKENIZER.convert_tokens_to_ids("<|mask|>")
    drafter.save_pretrained(root / "drafter")
    prompt_ids = TOKENIZER.encode(PROMPT, add_special_tokens=False)
    expected = hf_greedy(target, prompt_ids, NEW_TOKENS)
    assert len(expected) == NEW_TOKENS and len(set(expected)) > 4  # no early EOS, not one repeated token
    return request.param, target, root / "target", root / "drafter", prompt_ids, expected


def test_the_qwen3_moe_block_returns_only_hidden_states():
    """The engine's forward adds ``layer.mlp(x)`` to the residual: a (hidden, router_logits) tuple would
    break it (transformers 4.x returned one)."""
    torch.manual_seed(0)
    block = Qwen3MoeForCausalLM(small_config("qwen3_moe")).model.layers[0].mlp
    out = block(torch.randn(1, 5, 64))
    assert isinstance(out, torch.Tensor) and out.shape == (1, 5, 64)


@pytest.mark.parametrize("method", ["ar", "dflash", "ddtree"])
def test_every_supported_type_decodes_exactly_hf_greedy(saved, method):
    arch, _, target_dir, drafter_dir, prompt_ids, expected = saved
    engine = Engine.from_pretrained(target_dir, drafter_dir, method=method, max_model_len=CONTEXT)
    out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=NEW_TOKENS))
    assert out.token_ids == expected, (arch, method)


def test_the_cli_generates_hf_greedy_text(saved, capsys):
    _, _, target_dir, drafter_dir, _, expected = saved
    flags = ["--target", str(target_dir), "--drafter", str(drafter_dir), "--threads", "1"]
    main(["generate", PROMPT, *flags, "--max-new-tokens", "16"])
    text = TOKENIZER.decode(expected[:16], skip_special_tokens=True)
    assert capsys.readouterr().out == PROMPT + text + "\n"


# -- targets the full-attention forward cannot run --------------------------------------------------------


def test_a_sliding_window_shorter_than_the_context_is_refused_before_loading(tmp_path):
    config = small_config("mistral", sliding_window=16).to_dict()
    message = refusal(load_target, write_config(tmp_path / "m", config))
    assert "sliding-window attention (window 16 < context 256)" in message
    assert "pass --max-model-len 16 or less" in message
    message = refusal(load_target, tmp_path / "m", max_model_len=17)
    assert "(window 16 < context 17)" in message


def test_a_window_that_covers_max_model_len_is_full_attention(tmp_path):
    target = save_target(tmp_path / "m", "mistral", sliding_window=16)
    loaded, tokenizer = load_target(tmp_path / "m", max_model_len=16)
    assert loaded.config.sliding_window == 16 and tokenizer is not None
    # Within 16 tokens HF's own sliding-window forward is full attention: the engine matches it.
    prompt_ids = TOKENIZER.encode(PROMPT, add_special_tokens=False)
    new = 16 - len(prompt_ids)
    engine = Engine(loaded, None, tokenizer, method="ar", max_model_len=16)
    out = engine.generate(prompt_ids, SamplingParams(max_new_tokens=new))
    assert out.token_ids == hf_greedy(target, prompt_ids, new)


def test_a_window_as_long_as_the_models_context_is_accepted(tmp_path):
    save_target(tmp_path / "m", "mistral", sliding_window=CONTEXT)
    assert load_target(tmp_path / "m")[0].config.sliding_window == CONTEXT


def test_qwen2_use_sliding_window_is_refused_unless_it_is_off_or_covers_the_context(tmp_path):
    on = small_config("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0).to_dict()
    message = refusal(load_target, write_config(tmp_path / "on", on))
    assert "sliding-window attention (window 16 < context 256)" in message and "--max-model-len" in message
    # Qwen2.5's config.json: a window, switched off.
    off = small_config("qwen2").to_dict() | {"use_sliding_window": False, "sliding_window": 16}
    save_target(tmp_path / "off", "qwen2")
    (tmp_path / "off" / "config.json").write_text(json.dumps(off))
    assert load_target(tmp_path / "off")[0].config.model_type == "qwen2"
    save_target(tmp_path / "on", "qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert load_target(tmp_path / "on", max_model_len=16)[0].config.layer_types[0] == "sliding_attention"


@pytest.mark.parametrize(
    ("layer_types", "fragment"),
    [
        (["full_attention", "sliding_attention"] * 2, "sliding-window attention (window 16 < context 256)"),
        (["full_attention", "linear_attention"] * 2, "layer types linear_attention; ddtree runs full"),
    ],
)
def test_layer_types_other_than_full_attention_are_refused(tmp_path, layer_types, fragment):
    config = small_config("qwen2").to_dict()
    config |= {"layer_types": layer_types, "use_sliding_window": True, "sliding_window": 16}
    assert fragment in refusal(load_target, write_config(tmp_path / "t", config))


def test_an_unsupported_model_type_lists_the_supported_ones(tmp_path):
    message = refusal(load_target, write_config(tmp_path / "phi", {"model_type": "phi3"}))
    assert "model_type 'phi3'" in message
    assert f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}" in message
    assert {"qwen3_moe", "mistral", "qwen2", "llama", "qwen3"} <= set(SUPPORTED_MODEL_TYPES)


# -- drafter configs ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory) -> Path:
    """A saved tiny DFlash drafter (2 layers, block 8, context 256) whose config the tests rewrite."""
    directory = tmp_path_factory.mktemp("drafter") / "d"
    tiny_drafter(tiny_target()).save_pretrained(directory)
    return directory


def drafter_with(tmp_path: Path, source: Path, **changes) -> Path:
    """A copy of ``source`` with config.json keys set (None: removed)."""
    config = json.loads((source / "config.json").read_text()) | changes
    directory = write_config(tmp_path / "d", {k: v for k, v in config.items() if v is not None})
    (directory / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    return directory


def test_a_full_attention_drafter_config_with_newer_keys_loads(tmp_path, drafter_dir):
    reference = load_drafter(drafter_dir)
    newer = {
        "layer_types": ["full_attention"] * 2,
        "sliding_window": 2048,
        "use_sliding_window": True,
        "is_causal": False,
        "dtype": "bfloat16",
        "auto_map": {"AutoModel": "m.M"},
        "transformers_version": "5.15.0",
        "some_future_key": [1, 2],
        "block_size": None,  # only in dflash_config, as newer DFlash configs have it
        "dflash_config": {**reference.config.dflash_config, "block_size": 8},
    }
    drafter = load_drafter(drafter_with(tmp_path, drafter_dir, **newer))
    assert drafter.block_size == 8 and drafter.config.some_future_key == [1, 2]
    weights, expected = drafter.state_dict(), reference.state_dict()
    assert weights.keys() == expected.keys() and all(torch.equal(weights[k], expected[k]) for k in weights)


def test_sliding_drafter_layers_are_refused_unless_the_window_covers_context_and_block(tmp_path, drafter_dir):
    sliding = {"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 64}
    directory = drafter_with(tmp_path, drafter_dir, **sliding, use_sliding_window=True, is_causal=False)
    message = refusal(load_drafter, directory)
    assert "layer types full_attention, sliding_attention (sliding window 64)" in message
    assert "window 64 < context 264 (max_model_len + block size 8)" in message
    assert "pass --max-model-len 56 or less" in message
    assert "context 65" in refusal(load_drafter, directory, max_model_len=57)
    assert load_drafter(directory, max_model_len=56).block_size == 8


def test_causal_drafter_attention_is_refused(tmp_path, drafter_dir):
    """DFlash's reference makes sliding layers causal unless the config says ``is_causal: false``."""
    sliding = dict(layer_types=["sliding_attention"] * 2, sliding_window=4096, use_sliding_window=True)
    message = refusal(load_drafter, drafter_with(tmp_path / "a", drafter_dir, **sliding))
    assert "sliding_attention (sliding window 4096), causal" in message
    message = refusal(load_drafter, drafter_with(tmp_path / "b", drafter_dir, is_causal=True))
    assert "causal attention (is_causal: true)" in message


def test_an_invalid_drafter_config_is_one_line(tmp_path, drafter_dir):
    directory = drafter_with(tmp_path, drafter_dir, layer_types=["full_attention"] * 3)
    assert "must be equal to the number of `layer_types`" in refusal(load_drafter, directory)


# -- dtype -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16), ("float16", torch.float16),
     ("fp16", torch.float16), ("half", torch.float16), ("float32", torch.float32), ("fp32", torch.float32),
     ("float", torch.float32), (torch.float16, torch.float16)],
)  # fmt: skip
def test_explicit_dtypes_map_whatever_the_checkpoint_says(name, expected):
    assert resolve_dtype(name, {"dtype": "bfloat16"}, torch.device("cpu")) == expected


QWEN3_0_6B = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28}
SMALL = {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 6}


@pytest.mark.parametrize("native_bf16", [False, True])
def test_auto_is_the_checkpoints_dtype_but_float32_for_small_models_on_a_cpu(monkeypatch, native_bf16):
    """Native bf16 matmuls or not: a small model decodes faster in float32 on a CPU (docs/benchmarks.md)."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", SMALL | {"dtype": "bfloat16"}, cpu) == torch.float32
    assert resolve_dtype(None, SMALL | {"torch_dtype": "float16"}, cpu) == torch.float32
    # A real-size model keeps bf16 either way: halving its weights' bytes wins even when bf16 is emulated.
    assert resolve_dtype("auto", QWEN3_0_6B | {"dtype": "bfloat16"}, cpu) == torch.bfloat16
    assert (
        resolve_dtype("auto", SMALL | {"torch_dtype": "bfloat16"}, cuda) == torch.bfloat16
    )  # a GPU keeps it
    assert resolve_dtype("auto", {"dtype": None}, cuda) == torch.float32  # no dtype recorded: float32


def test_unknown_dtypes_are_refused_with_the_choices():
    message = refusal(resolve_dtype, "int8", {}, torch.device("cpu"))
    assert "unknown dtype 'int8'" in message and ", ".join(DTYPE_CHOICES) in message
    assert "float8" in refusal(resolve_dtype, "auto", {"dtype": "float8_e4m3fn"}, torch.device("cuda"))


@pytest.mark.parametrize("native_bf16", [False, True])
def test_load_target_resolves_auto_from_the_checkpoint(tmp_path, monkeypatch, native_bf16):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: native_bf16)
    target = tiny_target(vocab=len(TOKENIZER)).to(torch.bfloat16)
    target.save_pretrained(tmp_path / "bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded, tokenizer = load_target(tmp_path / "bf16", dtype="auto")
    assert loaded.dtype == torch.float32 and tokenizer is None
    assert load_target(tmp_path / "bf16", dtype=torch.float16)[0].dtype == torch.float16


def test_text_prompts_get_the_tokenizers_special_tokens_as_hf_adds_them():
    """A Llama-style tokenizer adds a BOS: the engine's text prompts get it (HF and vLLM add it); a
    rendered chat template, which carries its own, asks for none."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = tiny_tokenizer()
    bos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    target = tiny_target(vocab=len(tokenizer))
    engine = Engine(target, tiny_drafter(target), tokenizer, max_model_len=64)
    ids = engine.encode("def fib(n):")
    assert ids == tokenizer("def fib(n):").input_ids and ids[0] == bos
    assert engine.encode("def fib(n):", add_special_tokens=False) == ids[1:]
