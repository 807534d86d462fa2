"""Tiny randomly initialised models, built in-process: the real HF classes, small enough for CI.

Also hand-made draft trees for the verification and sampling tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    Kimi_K25Config,
    Kimi_K25ForConditionalGeneration,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from ddtree.model.loader import DEFAULT_DRAFTER
from ddtree.sglang import DraftTree
from ddtree.speculative.drafter import DFlashDrafter, dflash_config

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine they lose a lot to them.
torch.set_num_threads(1)

VOCAB = 32
MASK = VOCAB - 1
TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 4
)


def tree_from_parents(parents: list[int], tokens: list[int]) -> DraftTree:
    """A DraftTree given each node's parent (root -1, parents before children) and token; logw all 0."""
    depths = [0] * len(parents)
    for i in range(1, len(parents)):
        depths[i] = depths[parents[i]] + 1
    return DraftTree(
        tokens=torch.tensor(tokens),
        depths=torch.tensor(depths),
        parents=torch.tensor(parents),
        logw=torch.zeros(len(parents)),
    )


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A real byte-level BPE (about 300 tokens) with the special tokens ddtree's models use."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|mask|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator([TEXT], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


def tiny_config_fields(vocab: int = VOCAB, init: float = 0.3) -> dict:
    """A 4-layer config's fields whose greedy continuations vary (a large init avoids one repeated token)."""
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def tiny_target(arch: str = "qwen3", vocab: int = VOCAB, seed: int = 0, init: float = 0.3):
    """A 4-layer target whose greedy continuations vary."""
    torch.manual_seed(seed)
    common = tiny_config_fields(vocab, init)
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common)).eval()
    return LlamaForCausalLM(LlamaConfig(**common)).eval()


def tiny_drafter(target, block_size: int = 8, num_layers: int = 2, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    config = dflash_config(target.config, num_layers=num_layers, block_size=block_size, mask_token_id=MASK)
    return DFlashDrafter(config).eval()


# The MLA / GLM-4 MoE families at toy sizes, each with the features the engine must reproduce exactly.
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
MOE_KINDS = ("deepseek_v3", "deepseek_v3_no_q_lora", "kimi_k25", "glm4_moe", "deepseek_v2")


def deepseek_v3_fields(vocab: int = VOCAB, init: float = 0.3, layers: int = 3) -> dict:
    """DeepSeek-V3 / Kimi K2 in miniature: MLA with q_lora, YaRN (mscale in the softmax scale), interleaved
    rope, sigmoid routing over 2 groups of 4 experts (top-1 group, top-2 experts) plus a shared expert,
    layer 0 dense."""
    return dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_parameters=dict(YARN),
        rope_interleave=True,
        max_position_embeddings=256,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )


def tiny_moe_target(
    kind: str, vocab: int = VOCAB, seed: int = 0, init: float = 0.3, layers: int = 3, image_token_id: int = -2
):
    """A target of ``kind`` (MOE_KINDS, or "qwen3_moe") whose greedy continuations vary; routers get a
    random selection bias (DeepSeek's noaux_tc ``e_score_correction_bias``), so routing differs from the
    scores' top-k. Kimi's image placeholder is ``image_token_id`` (negative: from the vocabulary's end;
    ``vocab``: none the model can emit, where HF's wrapper would embed an emitted one as token 0)."""
    torch.manual_seed(seed)
    fields = deepseek_v3_fields(vocab, init, layers)
    # GLM-4 MoE's and Qwen3-MoE's: tiny_target's GQA attention, DeepSeek's MoE sizes
    moe = dict(num_hidden_layers=layers, moe_intermediate_size=32, num_experts_per_tok=2)
    gqa = tiny_config_fields(vocab, init) | moe
    if kind == "deepseek_v3":
        target = DeepseekV3ForCausalLM(DeepseekV3Config(**fields))
    elif kind == "deepseek_v3_no_q_lora":
        fields |= dict(q_lora_rank=None, rope_interleave=False)
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        target = DeepseekV3ForCausalLM(DeepseekV3Config(**fields))
    elif kind == "kimi_k25":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
        config = Kimi_K25Config(
            text_config=fields | {"model_type": "kimi_k2"},
            vision_config=vision,
            projection_hidden_size=32,
            image_token_id=image_token_id % (vocab + 1),
            video_token_id=vocab,
            tie_word_embeddings=False,
        )
        target = Kimi_K25ForConditionalGeneration(config)
    elif kind == "glm4_moe":
        config = Glm4MoeConfig(
            **gqa,
            partial_rotary_factor=0.5,
            use_qk_norm=True,
            attention_bias=True,
            n_routed_experts=8,
            n_shared_experts=1,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
        )
        target = Glm4MoeForCausalLM(config)
    elif kind == "qwen3_moe":  # no shared experts, softmax routing; layer 0 dense too
        target = Qwen3MoeForCausalLM(Qwen3MoeConfig(**gqa, num_experts=8, mlp_only_layers=[0]))
    elif kind == "deepseek_v2":
        fields |= dict(q_lora_rank=None, n_group=1, topk_group=1, topk_method="greedy")
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        for key in ("rope_interleave",):
            fields.pop(key)
        target = DeepseekV2ForCausalLM(DeepseekV2Config(**fields))
    else:
        raise ValueError(kind)
    for name, buffer in target.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.normal_(std=0.1)
    return target.eval()


def text_config(target):
    """The config of the causal LM the engine runs: a multimodal wrapper's text config."""
    return getattr(target.config, "text_config", None) or target.config


def moe_drafter(target, block_size: int = 8, num_layers: int = 1, seed: int = 1) -> DFlashDrafter:
    """A DFlash drafter for any target (hidden size equal to the target's, its GQA heads chosen by
    ``dflash_config``), MASK the vocabulary's last id."""
    torch.manual_seed(seed)
    config = text_config(target)
    drafter_config = dflash_config(
        config, num_layers=num_layers, block_size=block_size, mask_token_id=config.vocab_size - 1
    )
    return DFlashDrafter(drafter_config).eval()


CONTEXT = 64  # max_position_embeddings of the saved tiny target: room for short prompts only


def tiny_models(chat_template: str | None = None):
    """Tokenizer, target (context ``CONTEXT``) and drafter that fit together, as the CLI and server load."""
    tokenizer = tiny_tokenizer()
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    target = tiny_target(vocab=len(tokenizer))
    target.config.max_position_embeddings = CONTEXT
    drafter = tiny_drafter(target)
    drafter.mask_token_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    return tokenizer, target, drafter


def save_models(root: Path, chat_template: str | None = None) -> tuple[Path, Path]:
    """A saved target + tokenizer directory and a saved drafter directory."""
    tokenizer, target, drafter = tiny_models(chat_template)
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    drafter.save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


@pytest.fixture(scope="session", params=["qwen3", "llama"])
def pair(request):
    target = tiny_target(request.param)
    return target, tiny_drafter(target)


REAL_VOCAB = 151936  # Qwen3's


def real_size_models(root: Path, layers: int = 2) -> tuple[Path, Path]:
    """Random weights at Qwen3-0.6B's shapes (vocab 151936, hidden 1024, GQA 16/8, head_dim 128, tied
    embeddings, a 40960-token context, bf16 safetensors) but ``layers`` layers, a word-level tokenizer of
    the whole vocabulary, and a one-layer public-format DFlash drafter."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=REAL_VOCAB,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=None,
    )
    target = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    target.save_pretrained(root / "target")
    words = Tokenizer(WordLevel({f"w{i}": i for i in range(REAL_VOCAB)}, unk_token="w1"))
    words.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, eos_token="w0", unk_token="w1")
    tokenizer.save_pretrained(root / "target")
    drafter_config = dflash_config(config, num_layers=1, block_size=16, mask_token_id=2)
    DFlashDrafter(drafter_config).to(torch.bfloat16).save_pretrained(root / "drafter")
    return root / "target", root / "drafter"


DFLASH2_ONLY = ("_conv.", "candidate_selector.")  # tensors a DFlash2 drafter has and a DFlash one has not


def builtin_dflash(root: Path) -> Path:
    """A DFlash checkpoint for the built-in target: the built-in drafter itself if it is one, else its
    DFlash parts (the built-in DFlash2 drafter less its convolutions and candidate selector) written under
    ``root``: trained attention and MLP weights, so its drafts are often accepted."""
    import json

    from safetensors.torch import load_file, save_file

    config = json.loads((DEFAULT_DRAFTER / "config.json").read_text())
    if config["architectures"] == ["DFlashDraftModel"]:
        return DEFAULT_DRAFTER
    draft = config.pop("dflash_config")
    config["block_size"] = config.get("block_size") or draft["block_size"]
    config["architectures"] = ["DFlashDraftModel"]
    config["dflash_config"] = {k: draft[k] for k in ("mask_token_id", "target_layer_ids")}
    weights = load_file(str(DEFAULT_DRAFTER / "model.safetensors"))
    out = root / "builtin-dflash"
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    kept = {k: v for k, v in weights.items() if not any(part in k for part in DFLASH2_ONLY)}
    save_file(kept, str(out / "model.safetensors"))
    return out
