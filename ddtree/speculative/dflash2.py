"""DFlash2 drafter: DFlash with grouped dynamic convolutions around each layer's attention and MLP, and a
candidate selector that scores token pairs across neighbouring block positions.

Format (public ``DFlash2DraftModel`` checkpoints; vLLM ``qwen3_dflash2.py``, z-lab/dflash ``model.py``):
everything of a DFlash checkpoint, plus per layer ``layers.{i}.attention_conv`` and ``layers.{i}.mlp_conv``,
each ``base_kernel`` [2, taps, H] and ``kernel_projection.weight`` [2 * taps * G, H] (G = H / group size),
and ``candidate_selector.predecessor_codebook`` / ``successor_codebook`` [V, R] (bare parameters, no
``.weight``) and ``candidate_selector.hidden_projection.weight`` [R, H]. ``dflash_config`` carries
``conv_kernel_size`` (taps), ``conv_group_size``, ``selector_rank`` (R), ``selector_top_k`` (K) and
optionally ``input_embedding_scale``, ``output_multiplier`` and ``final_logit_softcapping``.

Convolution, over the block axis only (position 0 is the bonus token; nothing before the block is seen).
For input x [S, H] cut into G channel groups, ``kernel_projection(x)`` gives per position two sets
(side 0 before the wrapped module, side 1 after it) of ``taps`` coefficients per group, d[s, side, t, g]:

    conv_side(y)[s, g] = sum_{t < taps, t <= s} (base_kernel[side, t, g] + d[s, side, t, g]) * y[s - t, g]

Both sides' coefficients come from the wrapped module's input x. A layer is
``h = x + conv_1(attn(conv_0(norm_in(x))))`` then ``h + conv_1'(mlp(conv_0'(norm_post(h))))``, with each
conv's own ``d`` from its module's normed input. Block embeddings are multiplied by ``input_embedding_scale``.

Selector. Drafted positions l = 1 .. S-1 each take the LM head's top-K (logits times ``output_multiplier``,
then ``cap * tanh(. / cap)``), ids c[l, k] and values u[l, k]. With z_l = hidden_projection(h_l), the score
of candidate k at l after predecessor token p (the candidate chosen at l - 1; the bonus token at l = 1) is

    score(l, p, k) = u[l, k] + sum_r predecessor_codebook[p, r] * z_l[r] * successor_codebook[c[l, k], r]

The public drafters decode a chain greedily (or sample softmax(score / T)) through this lattice. The engine
drafts over it too (``lattice``): ``ddtree`` trees hold the best paths by the sum of their edges' log-probs
(``ddtree.speculative.tree.lattice_tree``), ``dflash`` follows the greedy edge at every position. Output is
the target's either way: verification does not read the draft's scores.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn
from transformers import Qwen3Config

from ddtree.errors import DDTreeError
from ddtree.model.precision import rows_linear
from ddtree.speculative.drafter import DFlashDecoderLayer, DFlashDrafter, default_target_layer_ids

ARCHITECTURE = "DFlash2DraftModel"


@dataclass(frozen=True)
class DFlash2Settings:
    """The DFlash2 fields of a config, checked."""

    taps: int
    group_size: int
    rank: int
    top_k: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config) -> DFlash2Settings:
        """Read from ``dflash_config`` (else top-level keys, as the reference does); a one-line DDTreeError
        names what is missing or out of range."""
        draft = getattr(config, "dflash_config", None) or {}

        def value(name: str, default=None):
            return draft.get(name, getattr(config, name, default))

        required = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        missing = [k for k in required if value(k) is None]
        if missing:
            raise DDTreeError(f"DFlash2 config is missing dflash_config {', '.join(missing)}")
        try:
            ints = {k: int(value(k)) for k in required}
            scale = float(value("input_embedding_scale", 1.0))
            multiplier = float(value("output_multiplier", 1.0))
            cap = float(value("final_logit_softcapping", None) or 0.0)
        except (TypeError, ValueError) as exc:
            raise DDTreeError(f"DFlash2 config has a non-numeric setting: {exc}") from None
        small = [f"{k} {v}" for k, v in ints.items() if v < 1]
        if small:
            raise DDTreeError(f"DFlash2 config needs positive {', '.join(small)}")
        hidden, vocab = int(config.hidden_size), int(config.vocab_size)
        if hidden % ints["conv_group_size"]:
            raise DDTreeError(
                f"DFlash2 conv_group_size {ints['conv_group_size']} does not divide hidden_size {hidden}"
            )
        if ints["selector_top_k"] > vocab:
            raise DDTreeError(f"DFlash2 selector_top_k {ints['selector_top_k']} exceeds vocab_size {vocab}")
        if not (math.isfinite(multiplier) and multiplier > 0):
            # the engine drafts from the plain LM head: only a positive scale keeps its argmax the drafter's
            raise DDTreeError(f"DFlash2 output_multiplier must be positive, got {multiplier}")
        if not (math.isfinite(scale) and math.isfinite(cap) and cap >= 0):
            raise DDTreeError(
                f"DFlash2 input_embedding_scale {scale} / final_logit_softcapping {cap} invalid"
            )
        return cls(*ints.values(), scale, multiplier, cap or None)

    def config_entries(self) -> dict:
        """The public ``dflash_config`` keys these settings are saved as."""
        entries = {
            "conv_kernel_size": self.taps,
            "conv_group_size": self.group_size,
            "selector_rank": self.rank,
            "selector_top_k": self.top_k,
            "input_embedding_scale": self.input_embedding_scale,
            "output_multiplier": self.output_multiplier,
        }
        return entries | ({"final_logit_softcapping": self.softcap} if self.softcap else {})


class GroupedDynamicConv(nn.Module):
    """A causal convolution over the block axis whose per-group taps are a learned base plus a correction
    predicted from each position's input; ``prepare`` convolves the input and returns the coefficients of
    the output side, ``finish`` convolves the wrapped module's output with them."""

    def __init__(self, hidden_size: int, taps: int, group_size: int) -> None:
        super().__init__()
        self.taps, self.groups = taps, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def identity_(self) -> GroupedDynamicConv:
        """Make both sides the identity (one tap of weight 1, no correction): a layer wrapped so computes
        what the DFlash layer it starts from does (training a DFlash2 drafter from a DFlash one)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()
        return self

    def convolve(self, y: torch.Tensor, coefficients: torch.Tensor, side: int) -> torch.Tensor:
        """y [B, S, H]; coefficients [B, S, taps, G] -> [B, S, H]."""
        b, s, h = y.shape
        taps = self.taps
        base = self.base_kernel[side].to(y.dtype).view(taps, self.groups, -1)  # [taps, G, H / G]
        weights = (base + coefficients[..., None].to(y.dtype)).view(b, s, taps, h)  # [B, S, taps, H]
        # All taps at once (a loop over taps costs ~30 small ops a call, most of a CPU drafter pass): window
        # k of position s holds y[s + k - (taps - 1)], zero before the block, so tap t is window taps-1-t.
        windows = F.pad(y, (0, 0, taps - 1, 0)).unfold(1, taps, 1)  # [B, S, H, taps]
        return (windows * weights.flip(2).transpose(2, 3)).sum(dim=-1)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        coefficients = self.kernel_projection(x).view(b, s, 2, self.taps, self.groups)
        return self.convolve(x, coefficients[:, :, 0], 0), coefficients[:, :, 1]

    def finish(self, y: torch.Tensor, coefficients: torch.Tensor) -> torch.Tensor:
        return self.convolve(y, coefficients, 1)


class DFlash2DecoderLayer(DFlashDecoderLayer):
    def __init__(self, config: Qwen3Config, layer_idx: int, settings: DFlash2Settings) -> None:
        super().__init__(config, layer_idx)
        conv = (config.hidden_size, settings.taps, settings.group_size)
        self.attention_conv = GroupedDynamicConv(*conv)
        self.mlp_conv = GroupedDynamicConv(*conv)

    def forward(self, x, ctx, rope, cache, mask) -> torch.Tensor:
        h, coefficients = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, ctx, rope, cache, mask), coefficients)
        h, coefficients = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        # The MLP may hold lower-precision weights than the rest (the engine drafts so): cast in and out.
        h = self.mlp(h.to(self.mlp.down_proj.weight.dtype)).to(x.dtype)
        return x + self.mlp_conv.finish(h, coefficients)


class CandidateSelector(nn.Module):
    """Low-rank pair scores between a position's top-K candidates and its predecessor's token."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,  # [B, L, H] drafted positions' final hidden states
        candidate_ids: torch.Tensor,  # [B, L, K] int64
        candidate_logits: torch.Tensor,  # [B, L, K] their (scaled, capped) LM-head logits
        previous_ids: torch.Tensor,  # [B, L, P] int64 predecessor tokens of each position
    ) -> torch.Tensor:
        """Edge scores [B, L, P (predecessor), K (candidate)], float32. The lattice passes every candidate
        of the position before (the anchor for l = 0); training passes the true previous token (P = 1)."""
        z = rows_linear(hidden, self.hidden_projection.weight).float()  # [B, L, R]; hidden may be strided
        predecessors = F.embedding(previous_ids, self.predecessor_codebook)  # [B, L, P, R] (no index op)
        modulated = predecessors.float() * z[:, :, None]  # [B, L, P, R]
        successors = F.embedding(candidate_ids, self.successor_codebook).float()  # [B, L, K, R]
        pair = torch.matmul(modulated, successors.transpose(-1, -2))  # [B, L, P, K]
        return candidate_logits.float()[:, :, None, :] + pair

    @staticmethod
    def lattice_predecessors(candidate_ids: torch.Tensor, anchor_ids: torch.Tensor) -> torch.Tensor:
        """[B, L, K]: position l's predecessors are position l - 1's candidates; position 0's all the anchor
        (``anchor_ids`` [B], the bonus tokens)."""
        b, _, k = candidate_ids.shape
        return torch.cat((anchor_ids.view(b, 1, 1).expand(b, 1, k), candidate_ids[:, :-1]), dim=1)


class DFlash2Drafter(DFlashDrafter):
    """The DFlash2 draft model: ``DFlashDrafter``'s contract (forward returns the block's normed hidden
    states; the engine applies the target's LM head) with DFlash2 layers and the candidate selector."""

    def __init__(self, config: Qwen3Config) -> None:
        settings = DFlash2Settings.of(config)
        draft = dict(getattr(config, "dflash_config", None) or {})
        draft.setdefault(
            "target_layer_ids", default_target_layer_ids(config.num_target_layers, config.num_hidden_layers)
        )
        # The DFlash parts come from DFlashDrafter, built over a layerless copy of the config (its layers
        # would be thrown away); the layers are DFlash2's.
        shell = copy.copy(config)
        shell.num_hidden_layers, shell.dflash_config = 0, draft
        super().__init__(shell)
        self.config = config
        self.settings = settings
        self.layers = nn.ModuleList(
            DFlash2DecoderLayer(config, i, settings) for i in range(config.num_hidden_layers)
        )
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, settings.rank, settings.top_k
        )
        for module in (self.layers, self.candidate_selector):
            module.apply(self._init_weights)

    def forward(self, block_embeds, features, block_positions, ctx_positions, cache=None, mask=None):
        """As ``DFlashDrafter.forward``; the block embeddings are scaled by ``input_embedding_scale``."""
        scale = self.settings.input_embedding_scale
        block_embeds = block_embeds * scale if scale != 1.0 else block_embeds
        return super().forward(block_embeds, features, block_positions, ctx_positions, cache, mask)

    # -- the candidate lattice -------------------------------------------------------------------------

    def draft_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's logits from the LM head's: times ``output_multiplier``, then soft-capped. Both are
        monotone, so the argmax and top-K ids are the plain LM head's."""
        logits = logits.float() * self.settings.output_multiplier
        cap = self.settings.softcap
        return torch.tanh(logits / cap) * cap if cap else logits

    def candidates(
        self, hidden: torch.Tensor, lm_head: torch.Tensor, bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-``selector_top_k`` ids [B, S-1, K] and draft logits [B, S-1, K] (descending) of the drafted
        positions 1 .. S-1 of the block hidden states [B, S, H], through ``lm_head`` [V, H]."""
        drafted = hidden[:, 1:]
        logits = self.draft_logits(rows_linear(drafted.to(lm_head.dtype), lm_head, bias))
        values, ids = torch.topk(logits, self.settings.top_k, dim=-1)
        return ids, values

    def edge_scores(
        self,
        hidden: torch.Tensor,  # [B, S, H] block hidden states (position 0: the bonus token)
        candidate_ids: torch.Tensor,  # [B, S-1, K]
        candidate_logits: torch.Tensor,  # [B, S-1, K]
        anchor_ids: torch.Tensor,  # [B] the bonus tokens
    ) -> torch.Tensor:
        """Per-edge scores [B, S-1, K, K] (float32): [b, l, p, c] scores candidate c of drafted position
        l + 1 after candidate p of position l (the anchor for l = 0, every p alike)."""
        previous = self.candidate_selector.lattice_predecessors(candidate_ids, anchor_ids)
        return self.candidate_selector(hidden[:, 1:], candidate_ids, candidate_logits, previous)

    def edge_log_probs(self, *args: torch.Tensor) -> torch.Tensor:
        """``edge_scores`` normalized over the candidates: log q(c | p) at temperature 1."""
        return torch.log_softmax(self.edge_scores(*args), dim=-1)

    def lattice(
        self,
        hidden: torch.Tensor,
        logits: torch.Tensor,
        anchors: torch.Tensor,
        whole: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The lattice the engine's trees are drafted over: candidate ids [B, L, K] and edge log-probs
        [B, L, K, K] (``edge_log_probs``'s layout) of drafted positions' hidden states ``hidden`` [B, L, H]
        (the block less its bonus token), from the LM head's ``logits`` [B, L, V] as the engine has them
        (penalised, grammar-masked) and the bonus tokens ``anchors`` [B].

        The rows ``whole`` lists (sampled rows) normalise each edge over the whole vocabulary: the K
        candidates with their edge scores, every other token with its draft logit (the selector scores
        candidates only). A sampled row's tree is worth the target's probability of its paths, and an edge
        normalised over the candidates alone claims they hold all the mass, which at T = 1 they do not, so
        deep nodes looked likelier than they are: tau at T = 1 1.530 -> 1.562 on the built-in pair, T = 0.7
        + top-p unchanged. Greedy rows keep the candidates' normalisation, whose confidence in depth suits
        an argmax chain (the whole vocabulary's: tau 5.61 -> 5.35 at T = 0; ``docs/benchmarks.md``), and
        their rows skip the whole-vocabulary sums (at V = 151,936, 2.7 ms a row a round on a CPU thread)."""
        drafted = self.draft_logits(logits)  # [B, L, V]
        values, ids = torch.topk(drafted, self.settings.top_k, dim=-1)  # [B, L, K]
        previous = self.candidate_selector.lattice_predecessors(ids, anchors)  # [B, L, K]
        scores = self.candidate_selector(hidden, ids, values, previous)  # [B, L, K, K]
        edges = torch.log_softmax(scores, dim=-1)  # [B, L, K, K] over the candidates
        if whole is None:
            return ids, edges
        # log of the mass outside the candidates, from the drafter's own logits (-inf: they hold it all)
        # Row by row: at V = 151,936 one logsumexp over 16 rows' [L, V] took 119 ms on a CPU thread (its
        # temporaries are 146 MB), 16 over one row each 37 ms; gathering the rows first copies them all.
        full = torch.full(drafted.shape[:2], float("-inf"), device=drafted.device)  # [B, L]
        for i in whole:
            full[i] = torch.logsumexp(drafted[i], dim=-1)
        # the rest's log mass; a row left out (full -inf) gets log1p(-1) = -inf, no mass outside
        rest = full + torch.log1p(-torch.exp(torch.logsumexp(values, dim=-1) - full).clamp(max=1.0))
        # log(candidates' mass + rest) - log(candidates' mass): 0 where rest is -inf (greedy rows' bits)
        return ids, edges - F.softplus(rest[:, :, None, None] - torch.logsumexp(scores, dim=-1, keepdim=True))

    # -- checkpoint I/O in the public DFlash2 format --------------------------------------------------

    def save_pretrained(self, directory: str | Path) -> None:
        directory = Path(directory)
        super().save_pretrained(directory)
        config = self.config.to_dict()
        config["architectures"] = [ARCHITECTURE]
        config["dflash_config"] = {
            **(getattr(self.config, "dflash_config", None) or {}),
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": self.target_layer_ids,
            **self.settings.config_entries(),
        }
        (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    @classmethod
    def from_pretrained(cls, directory: str | Path, dtype: torch.dtype | None = None) -> DFlash2Drafter:
        """Load a public-format DFlash2 checkpoint: every tensor consumed, none missing, every shape the
        config's; otherwise a one-line DDTreeError."""
        try:
            return super().from_pretrained(directory, dtype)
        except DDTreeError as exc:
            if str(exc).startswith("DFlash2 config"):  # from the settings: say which checkpoint
                raise DDTreeError(f"drafter {directory}: {exc}") from None
            raise
        except RuntimeError as exc:  # load_state_dict's shape mismatches, listed one per line
            lines = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
            reason = lines[0] if lines else str(exc).splitlines()[0]
            raise DDTreeError(
                f"DFlash2 drafter weights in {directory} do not fit its config: {reason}"
            ) from None
        except SafetensorError as exc:
            raise DDTreeError(f"DFlash2 drafter weights in {directory} are unreadable: {exc}") from None
