"""The target's forward for the engine: HF's own layers and weights, our attention over the paged KV cache.

The engine owns this loop (as gpt-fast, vLLM and SGLang own theirs) because a batch of requests needs what
HF's cache and mask plumbing does not give: each row writes its tokens into its own KV blocks and attends
through a mask built once per round (``ddtree.model.attention``: SDPA or FlexAttention). Everything else
(projections, q/k norms, rotary tables, MLPs and MoE routers, norms) is the HF module itself, and the
rotation is the HF model's own ``apply_rotary_pos_emb`` (GLM-4's rotates the first half of each head only;
DeepSeek's rotates interleaved pairs), so Qwen3, Qwen3-MoE, Qwen2, Llama, Mistral, GLM-4 MoE, DeepSeek-V2/V3
and Kimi K2 / K2.5 checkpoints run unchanged; HF's forward stays the oracle the tests compare against.

Two attention kinds (``docs/design.md``):
- GQA: per-head keys and values in the pool.
- MLA (DeepSeek-V2/V3, Kimi): the pool holds the latent ``[c_KV ; k_rope]``, kv_lora_rank + qk_rope_head_dim
  values per token. The verify forward (a few tree nodes per row over a long context) runs the absorbed
  form: queries go through W_UK into the latent space and score against the latent itself, outputs come out
  through W_UV, so no per-head key or value is built. A prefill (many queries per row) expands keys and
  values from the latent through ``kv_b_proj``, as HF does; both forms compute the same attention.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask
from torch.overrides import TorchFunctionMode

from ddtree.model import invariance
from ddtree.model.attention import attend, attend_latent, fold_heads
from ddtree.model.invariance import ExactRows
from ddtree.model.kv_cache import CacheWrite, KVLayout
from ddtree.model.precision import HALF_PRECISION
from ddtree.model.tensor_parallel import TPGroup, is_mla

Rope = tuple[torch.Tensor, torch.Tensor] | torch.Tensor  # HF's (cos, sin) [B, T, D] each; DeepSeek-V2's freqs


def rotation(attn) -> Callable[[torch.Tensor, torch.Tensor, Rope], tuple[torch.Tensor, torch.Tensor]]:
    """``rotate(q, k, rope)``: the HF model's own rotary function for ``attn``'s layers (one source: its
    modeling module), so partial rotary (GLM-4) and interleaved pairs (DeepSeek) are exactly HF's."""
    modeling = sys.modules[type(attn).__module__]
    if hasattr(modeling, "apply_rotary_emb"):  # DeepSeek-V2: complex frequencies, one tensor
        return modeling.apply_rotary_emb
    if getattr(attn.config, "rope_interleave", False):  # DeepSeek-V3 / Kimi
        fn = modeling.apply_rotary_pos_emb_interleave
    else:
        fn = modeling.apply_rotary_pos_emb
    return lambda q, k, rope: fn(q, k, *rope)


class Float32Linear(TorchFunctionMode):
    """Linear layers over half-precision activations computed in float32, the result rounded back.

    For a CPU without native bf16 matmuls, where bf16 is emulated: on Qwen3-0.6B's MLP (one thread) 512
    tokens took 1,112-1,261 ms in bf16 and 188-282 ms through this mode; below ~16 tokens casting the
    weight costs more than it saves (1 token: 6.5 vs 46 ms). Used for prefill chunks only
    (``ModelRunner.prefill``), so decode rounds keep one rule whatever the batch."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and args[0].dtype in HALF_PRECISION:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
            return out.to(x.dtype)
        return func(*args, **kwargs)


class TargetForward:
    """``decoder(ids, positions, KV blocks/columns, mask) -> final hidden states (+ drafter features)``.

    With ``tp`` (a target sharded by ``ddtree.model.tensor_parallel.shard_target``) it runs this rank's heads
    and MLP slice (MoE: its routed experts and its slice of the shared ones), and sums the ranks' partial
    ``o_proj`` and MLP outputs (Megatron's two all-reduces a layer), so every rank carries the same
    residual stream and final hidden states."""

    def __init__(self, target, tp: TPGroup | None = None) -> None:
        decoder = target.get_decoder()
        self.embed = decoder.embed_tokens
        self.layers = decoder.layers
        self.norm = decoder.norm
        self.rotary = decoder.rotary_emb
        attn = self.layers[0].self_attn
        self.tp = tp if tp is not None and tp.world_size > 1 else None
        self.scaling = attn.scaling  # HF's: for DeepSeek's YaRN, with mscale(factor, mscale_all_dim)^2
        self.rotate = rotation(attn)
        self.mla = is_mla(attn)
        # Head counts are the shard's (its weights' rows; target.config keeps the whole model's): they fix
        # this rank's views and, for GQA, its KV cache's layout. MLA's latent is every rank's whole.
        if self.mla:
            self.rank, self.rope_dim = attn.kv_lora_rank, attn.qk_rope_head_dim
            self.nope_dim, self.v_dim = attn.qk_nope_head_dim, attn.v_head_dim
            self.num_heads = attn.kv_b_proj.weight.shape[0] // (self.nope_dim + self.v_dim)
            self.layout = KVLayout.mla(self.rank + self.rope_dim)
        else:
            self.head_dim = attn.head_dim
            self.num_heads = attn.q_proj.weight.shape[0] // self.head_dim
            self.num_kv_heads = attn.k_proj.weight.shape[0] // self.head_dim
            self.layout = KVLayout.gqa(self.num_kv_heads, self.head_dim)

    def over(self, layers: list[int]) -> TargetForward:
        """This forward over only the decoder layers ``layers`` (the memory profile's representatives)."""
        part = copy.copy(self)
        part.layers = [self.layers[i] for i in layers]
        return part

    def representative_layers(self) -> list[int]:
        """The first layer of each kind (attention and MLP classes: a DeepSeek's dense first layers and
        its MoE ones): every layer of a kind holds the same transient memory, so a step's peak over all the
        layers is its peak over these."""
        kinds: dict[tuple[type, type], int] = {}
        for i, layer in enumerate(self.layers):
            kinds.setdefault((type(layer.self_attn), type(layer.mlp)), i)
        return sorted(kinds.values())

    def gathered_bytes_per_column(self, elem: int, absorbed: bool = False) -> int:
        """Transient bytes per context column a row's attention builds: the gathered GQA keys/values and the
        heads they expand to, or the gathered latent and, unless ``absorbed`` (a round's verify forward),
        the keys/values a prefill expands from it."""
        if self.mla:
            expanded = 0 if absorbed else self.num_heads * (self.nope_dim + self.rope_dim + self.v_dim)
            return (self.rank + self.rope_dim + expanded) * elem
        return (2 * self.num_kv_heads + self.num_heads) * self.head_dim * elem

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
        absorbed: bool = True,
        exact: ExactRows | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Final hidden states [B, T, H] (before the LM head) and, when ``feature_layers`` is given, the
        drafter's features [B, T, F * H]: the outputs of those layers (the last one after the final norm,
        as HF reports it). ``absorbed`` picks MLA's form (the verify forward's; a prefill expands);
        GQA targets ignore it. ``exact``: rows computed batch-invariantly (``ddtree.model.invariance``)."""
        if exact is None:
            return self.layers_forward(ids, positions, write, mask, feature_layers, absorbed, None)
        with invariance.active(exact):  # the target's linears, routed by ``invariance.install``
            return self.layers_forward(ids, positions, write, mask, feature_layers, absorbed, exact)

    def layers_forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        write: CacheWrite,
        mask: torch.Tensor | BlockMask,
        feature_layers: list[int] | None,
        absorbed: bool,
        exact: ExactRows | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embed(ids)  # [B, T, H]
        rope = self.rotary(x, positions)  # (cos, sin) [B, T, D] each; DeepSeek-V2: complex [B, T, D / 2]
        if self.mla and absorbed:
            mask = fold_heads(mask, self.num_heads)  # [B, 1, heads * T, span]
        kept: dict[int, torch.Tensor] = {}
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            if self.mla:
                out = self.latent_attention(layer.self_attn, i, h, rope, write, mask, absorbed, exact)
            else:
                out = self.attention(layer.self_attn, i, h, rope, write, mask, exact)
            x = x + self.reduce(out)
            x = x + self.reduce(layer.mlp(layer.post_attention_layernorm(x)))
            if feature_layers is not None and i in feature_layers and i != last:
                kept[i] = x
        x = self.norm(x)
        if feature_layers is None:
            return x, None
        kept[last] = x
        return x, torch.cat([kept[i] for i in feature_layers], dim=-1)

    def attention(
        self,
        attn,
        i: int,
        h: torch.Tensor,
        rope: Rope,
        write: CacheWrite,
        mask: torch.Tensor | BlockMask,
        exact: ExactRows | None = None,
    ) -> torch.Tensor:
        """GQA (with q/k norms and qkv bias where the model has them): the o_proj output [B, T, H]. The
        ``exact`` rows attend once more, batch-invariantly (``ExactRows.attend``)."""
        b, t, _ = h.shape
        q = attn.q_proj(h).view(b, t, self.num_heads, self.head_dim)
        k = attn.k_proj(h).view(b, t, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(h).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if hasattr(attn, "q_norm"):  # Qwen3, GLM-4 (use_qk_norm) normalise each head before the rotation
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rotate(q.transpose(1, 2), k.transpose(1, 2), rope)  # [B, heads, T, D]
        keys, values = write.write(i, k, v)  # [B, kv_heads, span, D]
        whole = exact is not None and exact.whole
        out = None if whole else attend(q, keys, values, mask, self.scaling)  # [B, heads, T, D]
        if exact is not None:
            out = exact.attend(out, q, keys, values, mask, self.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def latent_attention(
        self,
        attn,
        i: int,
        h: torch.Tensor,  # [B, T, H]
        rope: Rope,
        write: CacheWrite,
        mask: torch.Tensor | BlockMask,  # absorbed: folded over the heads (``fold_heads``)
        absorbed: bool,
        exact: ExactRows | None = None,
    ) -> torch.Tensor:
        """MLA (HF's DeepseekV3Attention / DeepseekV2Attention, step by step): the o_proj output [B, T, H].

        The latent cached per token is ``[kv_a_layernorm(c_KV) ; rotated k_rope]``, as HF's own cache holds
        it. With W = kv_b_proj's weight viewed [heads, nope + v, rank] (W_UK its first nope rows, W_UV the
        rest), a head's score is q_nope . (W_UK c) + q_rope . k_rope = (W_UK^T q_nope) . c + q_rope . k_rope,
        and its output W_UV (sum_s p_s c_s): the absorbed form, exact up to float rounding."""
        b, t, _ = h.shape
        heads, nope, rank = self.num_heads, self.nope_dim, self.rank
        if attn.q_lora_rank is None:
            q = attn.q_proj(h)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(h)))
        q = q.view(b, t, heads, nope + self.rope_dim).transpose(1, 2)  # [B, heads, T, nope + rope]
        q_nope, q_rot = q.split([nope, self.rope_dim], dim=-1)
        c, k_rot = attn.kv_a_proj_with_mqa(h).split([rank, self.rope_dim], dim=-1)  # [B, T, rank], [.., rope]
        q_rot, k_rot = self.rotate(q_rot, k_rot[:, None], rope)  # [B, heads, T, rope], [B, 1, T, rope]
        new = torch.cat((attn.kv_a_layernorm(c), k_rot[:, 0]), dim=-1)  # [B, T, rank + rope]
        latent = write.write_latent(i, new)  # [B, S, rank + rope]
        w = attn.kv_b_proj.weight.view(heads, nope + self.v_dim, rank)  # [heads, nope + v, rank]
        if exact is not None and exact.whole:
            out = None  # the exact pass below computes every row
        elif absorbed:
            q_lat = torch.matmul(q_nope, w[:, :nope])  # [B, heads, T, rank]: W_UK^T q_nope
            out = attend_latent(torch.cat((q_lat, q_rot), dim=-1), latent, rank, mask, self.scaling)
            out = torch.matmul(out, w[:, nope:].transpose(1, 2))  # [B, heads, T, v]: through W_UV
        else:
            s = latent.shape[1]
            kv = attn.kv_b_proj(latent[..., :rank]).view(b, s, heads, nope + self.v_dim).transpose(1, 2)
            k_nope, values = kv.split([nope, self.v_dim], dim=-1)  # [B, heads, S, nope], [B, heads, S, v]
            k_pe = latent[:, None, :, rank:].expand(b, heads, s, self.rope_dim)  # [B, heads, S, rope]
            keys = torch.cat((k_nope, k_pe), dim=-1)  # [B, heads, S, nope + rope]
            q = torch.cat((q_nope, q_rot), dim=-1)  # [B, heads, T, nope + rope]
            out = attend(q, keys, values, mask, self.scaling)  # [B, heads, T, v]
        if exact is not None:  # one float64 form for prefill and verify (``exact_latent_attention``)
            dense = mask.view(b, 1, heads, t, -1)[:, :, 0] if absorbed else mask  # unfolded: [B, 1, T, S]
            out = exact.attend_latent(out, q_nope, q_rot, latent, w, dense, self.scaling)
        return attn.o_proj(out.transpose(1, 2).reshape(b, t, -1))
