"""The target's forward for the engine: HF's own layers and weights, our attention over the paged KV cache.

The engine owns this loop (as gpt-fast, vLLM and SGLang own theirs) because a batch of requests needs what
HF's cache and mask plumbing does not give: each row writes its tokens into its own KV blocks and attends
through a mask built once per round (``ddtree.attention``: SDPA or FlexAttention). Everything else
(projections, q/k norms, rotary tables, MLPs, norms) is the HF module itself, so Qwen3, Qwen3-MoE, Qwen2,
Llama and Mistral checkpoints run unchanged; HF's forward stays the oracle the tests compare against.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask
from torch.overrides import TorchFunctionMode
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ddtree.attention import attend
from ddtree.kv_cache import CacheWrite
from ddtree.tensor_parallel import TPGroup


class Float32Linear(TorchFunctionMode):
    """Linear layers over half-precision activations computed in float32, the result rounded back.

    For a CPU without native bf16 matmuls, where bf16 is emulated: on Qwen3-0.6B's MLP (one thread) 512
    tokens took 1,112-1,261 ms in bf16 and 188-282 ms through this mode; below ~16 tokens casting the
    weight costs more than it saves (1 token: 6.5 vs 46 ms). Used for prefill chunks only
    (``ModelRunner.prefill``), so decode rounds keep one rule whatever the batch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and args[0].dtype in (torch.bfloat16, torch.float16):
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
            return out.to(x.dtype)
        return func(*args, **kwargs)


class TargetForward:
    """``decoder(ids, positions, KV blocks/columns, mask) -> final hidden states (+ drafter features)``.

    With ``tp`` (a target sharded by ``ddtree.tensor_parallel.shard_target``) it runs this rank's heads
    and MLP slice, and sums the ranks' partial ``o_proj`` and MLP outputs (Megatron's two all-reduces a
    layer), so every rank carries the same residual stream and final hidden states."""

    def __init__(self, target, tp: TPGroup | None = None) -> None:
        config = target.config  # its attention is full over the context (ddtree.models checks it)
        decoder = target.get_decoder()
        self.embed = decoder.embed_tokens
        self.layers = decoder.layers
        self.norm = decoder.norm
        self.rotary = decoder.rotary_emb
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        world = 1 if tp is None else tp.world_size
        self.num_heads = config.num_attention_heads // world  # this rank's heads: its KV cache's layout
        self.num_kv_heads = config.num_key_value_heads // world
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.scaling = attn.scaling

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel output [B, T, H] summed over the ranks in place; unsharded, the tensor itself."""
        if self.tp is not None:
            dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=self.tp.group)
        return partial

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
            x = x + self.reduce(attn.o_proj(out.transpose(1, 2).reshape(b, t, -1)))
            x = x + self.reduce(layer.mlp(layer.post_attention_layernorm(x)))
            if feature_layers is not None and i in feature_layers and i != last:
                kept[i] = x
        x = self.norm(x)
        if feature_layers is None:
            return x, None
        kept[last] = x
        return x, torch.cat([kept[i] for i in feature_layers], dim=-1)
