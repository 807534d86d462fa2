"""The target's forward for the engine: HF's own layers and weights, our attention over the paged KV cache.

The engine owns this loop (as gpt-fast, vLLM and SGLang own theirs) because a batch of requests needs what
HF's cache and mask plumbing does not give: each row writes its tokens into its own KV blocks and attends
through a mask built once per round (``ddtree.attention``: SDPA or FlexAttention). Everything else
(projections, q/k norms, rotary tables, MLPs, norms) is the HF module itself, so Qwen3, Qwen3-MoE, Qwen2,
Llama and Mistral checkpoints run unchanged; HF's forward stays the oracle the tests compare against.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ddtree.attention import attend
from ddtree.kv_cache import CacheWrite


class TargetForward:
    """``decoder(ids, positions, KV blocks/columns, mask) -> final hidden states (+ drafter features)``."""

    def __init__(self, target) -> None:
        config = target.config  # its attention is full over the context (ddtree.models checks it)
        decoder = target.get_decoder()
        self.embed = decoder.embed_tokens
        self.layers = decoder.layers
        self.norm = decoder.norm
        self.rotary = decoder.rotary_emb
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = attn.scaling

    def __call__(
        self,
        ids: torch.Tensor,  # [B, T] int64
        positions: torch.Tensor,  # [B, T] int64
        write: CacheWrite,  # where the T tokens' keys/values go and how many columns attention reads
        mask: torch.Tensor | BlockMask,  # [B, 1, T, span] bool, True = attend; or flex's block mask
        feature_layers: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden states [B, T, H] (before the LM head) and, when ``feature_layers`` is given, the
        drafter's features [B, T, F * H]: the outputs of those layers (the last one after the final norm,
        as HF reports it)."""
        x = self.embed(ids)  # [B, T, H]
        cos, sin = self.rotary(x, positions)  # [B, T, D] each
        b, t, _ = x.shape
        kept: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(b, t, self.num_heads, self.head_dim)
            k = attn.k_proj(h).view(b, t, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(h).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
            if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [B, heads, T, D]
            keys, values = write.write(i, k, v)  # [B, kv_heads, span, D]
            out = attend(q, keys, values, mask, self.scaling)  # [B, heads, T, D]
            x = x + attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if feature_layers is not None and i in feature_layers and i != last:
                kept[i] = x
        x = self.norm(x)
        if feature_layers is None:
            return x, None
        kept[last] = x
        return x, torch.cat([kept[i] for i in feature_layers], dim=-1)
