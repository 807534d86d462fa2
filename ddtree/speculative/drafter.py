"""DFlash block-diffusion drafter: one non-causal pass drafts a whole block from the target's features.

The block ``[bonus token, MASK x (block_size - 1)]`` is embedded with the target's own embedding. Each
layer's attention takes queries from the block and keys/values from ``[context ; block]``, where the
context is ``hidden_norm(fc(concat of target hidden states at target_layer_ids))`` of every committed
token. Within the block attention is bidirectional, so every MASK position is predicted at once. The
drafter's final hidden states go through its own ``norm`` and then the target's LM head.

Context keys/values never change once computed, so the engine caches them (a ``KVCache`` row per request);
a pass writes the new context and the block after the cached context, and only the context counts as
cached, so the next pass overwrites the block.
The checkpoint format is the public DFlash one (``DFlashDraftModel``), so checkpoints interoperate.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.attention.flex_attention import BlockMask
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

from ddtree.errors import DDTreeError
from ddtree.model.attention import attend
from ddtree.model.kv_cache import CacheWrite


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default: spread the feature layers from layer 1 to L - 3 (the middle layer if n == 1)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def dflash_config(
    target_config,
    num_layers: int = 1,
    block_size: int = 16,
    mask_token_id: int | None = None,
    target_layer_ids: list[int] | None = None,
    **overrides,
) -> Qwen3Config:
    """A drafter config sized like ``target_config`` (hidden size, heads, vocab, rope) for training/tests."""
    num_target_layers = target_config.num_hidden_layers
    if target_layer_ids is None:
        target_layer_ids = default_target_layer_ids(num_target_layers, num_layers)
    heads, kv_heads = target_config.num_attention_heads, target_config.num_key_value_heads
    head_dim = getattr(target_config, "head_dim", None) or target_config.hidden_size // heads
    if hasattr(target_config, "kv_lora_rank"):
        # An MLA target has no GQA heads to copy (its head_dim is the rope part): GQA heads of its value
        # width, 8 KV heads where they divide the heads (the public Kimi K2.6 DFlash drafter's layout).
        head_dim, kv_heads = target_config.v_head_dim, 8 if heads % 8 == 0 else heads
    # The drafter rotates whole heads: a target's partial rotary (GLM-4) is not the drafter's.
    rope = dict(target_config.rope_parameters or {"rope_type": "default", "rope_theta": 10000.0})
    rope.pop("partial_rotary_factor", None)
    fields = dict(
        vocab_size=target_config.vocab_size,
        hidden_size=target_config.hidden_size,
        intermediate_size=target_config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=target_config.rms_norm_eps,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=rope,
    )
    fields.update(overrides)
    return Qwen3Config(
        **fields,
        architectures=["DFlashDraftModel"],
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding; x [B, heads, T, D], cos/sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from [cached context ; new context ; block]; no causal mask."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H] block hidden states
        ctx: torch.Tensor,  # [B, C, H] projected context features not yet cached (C may be 0)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos/sin [B, C + S, D] of [new context ; block]
        cache: CacheWrite | None,  # where [new context ; block] go; None: no cache, ctx is the whole context
        mask: torch.Tensor | BlockMask | None,  # [B, 1, S, span] bool (True = attend), flex's, None: all
    ) -> torch.Tensor:
        b, s, _ = x.shape
        c = ctx.shape[1]
        cos, sin = rope
        q = self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _rotate(q, cos[:, c:], sin[:, c:])  # [B, heads, S, D]
        # New context and block share the key/value projections: one matmul each instead of two.
        kv_in = torch.cat((ctx, x), dim=1)  # [B, C + S, H]
        k = self.k_norm(self.k_proj(kv_in).view(b, c + s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        k = _rotate(k, cos, sin)  # [B, kv_heads, C + S, D]
        v = self.v_proj(kv_in).view(b, c + s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.write(self.layer_idx, k, v)  # [B, kv_heads, span, D]
        out = attend(q, k, v, mask)  # [B, heads, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, ctx, rope, cache, mask) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope, cache, mask)
        h = self.post_attention_layernorm(x)
        # The MLP may hold lower-precision weights than the rest (the engine drafts so): cast in and out.
        return x + self.mlp(h.to(self.mlp.down_proj.weight.dtype)).to(x.dtype)


class DFlashDrafter(nn.Module):
    """The DFlash draft model. Embedding and LM head are the target's and are not part of it."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        dflash = getattr(config, "dflash_config", None) or {}
        self.config = config
        self.block_size: int = int(config.block_size)
        self.mask_token_id: int | None = dflash.get("mask_token_id")
        self.target_layer_ids: list[int] = list(
            dflash.get("target_layer_ids")
            or default_target_layer_ids(config.num_target_layers, config.num_hidden_layers)
        )
        h = config.hidden_size
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))

    def select_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Concatenate the target's hidden states after layers ``target_layer_ids``: [B, T, F * H]."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    def forward(
        self,
        block_embeds: torch.Tensor,  # [B, S, H] target embeddings of [bonus, MASK, ...]
        features: torch.Tensor,  # [B, C, F * H] target features of context tokens not yet in the cache
        block_positions: torch.Tensor,  # [B, S] int64
        ctx_positions: torch.Tensor,  # [B, C] int64
        cache: CacheWrite | None = None,
        mask: torch.Tensor | None = None,  # [B, 1, S, span] bool; None = attend to everything
    ) -> torch.Tensor:
        """Final (normed) hidden states of the block, [B, S, H]; apply the target's LM head to get logits."""
        ctx = self.hidden_norm(self.fc(features))  # [B, C, H]
        rope = self.rotary_emb(ctx, torch.cat((ctx_positions, block_positions), dim=1))  # [B, C + S, D] x2
        x = block_embeds
        for layer in self.layers:
            x = layer(x, ctx, rope, cache, mask)
        return self.norm(x)

    # -- checkpoint I/O in the public DFlash format ------------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        config = self.config.to_dict()
        config["architectures"] = ["DFlashDraftModel"]
        config["dflash_config"] = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": self.target_layer_ids,
        }
        (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items() if "rotary_emb" not in k}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | None = None) -> DFlashDrafter:
        directory = Path(directory)
        config_path, weights_path = directory / "config.json", directory / "model.safetensors"
        if not config_path.is_file() or not weights_path.is_file():
            raise DDTreeError(f"drafter directory {directory} must hold config.json and model.safetensors")
        try:
            raw = json.loads(config_path.read_text())
        except json.JSONDecodeError as exc:
            raise DDTreeError(f"drafter config {config_path} is not valid JSON: {exc.msg}") from None
        # Newer DFlash configs keep block_size in dflash_config only (the reference reads both).
        raw.setdefault("block_size", (raw.get("dflash_config") or {}).get("block_size"))
        missing = [
            k
            for k in ("block_size", "num_target_layers", "hidden_size", "num_hidden_layers")
            if raw.get(k) is None
        ]
        if missing:
            raise DDTreeError(
                f"drafter config {config_path} is not a DFlash config: missing {', '.join(missing)}"
            )
        raw.pop("model_type", None)
        try:  # other keys (layer_types, is_causal, auto_map, ...) become attributes, as in HF
            config = Qwen3Config(**raw)
        except (StrictDataclassError, TypeError, ValueError) as exc:
            reason = str(exc).strip().splitlines()[-1].strip()
            raise DDTreeError(f"drafter config {config_path} is invalid: {reason}") from None
        model = cls(config)
        state = load_file(str(weights_path))
        result = model.load_state_dict(state, strict=False)
        missing_keys = [k for k in result.missing_keys if "rotary_emb" not in k]
        if missing_keys or result.unexpected_keys:
            raise DDTreeError(
                f"drafter weights in {weights_path} do not match its config "
                f"(missing {missing_keys[:3]}, unexpected {result.unexpected_keys[:3]})"
            )
        model.eval()
        return model.to(dtype) if dtype is not None else model
