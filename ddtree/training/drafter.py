"""Train a DFlash drafter for a target (``ddtree train drafter``), following the DFlash recipe.

Data is the target's own continuations (``ddtree.training.distill``). A training example is a *block*:
pick an anchor position ``p`` in a sequence, feed ``[token p, MASK x (S-1)]`` at positions ``p..p+S-1``
and ask for tokens ``p+1..p+S-1``. The block sees the target's features of positions ``< p`` only: at
inference the root token's own target state does not exist yet (the drafter runs before the target has
processed the root), so training must never show it, or the drafter learns to copy what it will not have.

Layout: one frozen target forward per sequence gives the features ``[T, F*H]`` of every position; ``A``
anchors of the sequence are then packed into one drafter call whose queries are the ``A`` blocks
concatenated (``A*S``) and whose keys are ``[T context features ; A*S block tokens]``. A bool mask
``[A*S, T + A*S]`` lets block ``a`` see context columns ``< anchor_a`` and its own block's columns
(bidirectionally) and nothing else, so the packed call computes exactly what ``A`` separate inference-style
calls would.

Loss: the drafter's normed output goes through the target's frozen LM head, only at labelled positions.
Block position ``k >= 1`` is weighted ``exp(-(k-1)/gamma)``: an early mistake ends acceptance, so early
positions matter most. Only the drafter trains (the target, including embedding and LM head, is frozen).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ddtree.errors import DDTreeError
from ddtree.model.loader import check_pair, eos_token_ids, load_drafter, load_target
from ddtree.model.precision import rows_linear
from ddtree.speculative.dflash2 import ARCHITECTURE as DFLASH2
from ddtree.speculative.dflash2 import DFlash2Drafter, DFlash2Settings
from ddtree.speculative.drafter import DFlashDrafter, dflash_config
from ddtree.training.checkpoint import CHECKPOINT, SAVE_DTYPES, load_checkpoint, save_checkpoint
from ddtree.training.configs import DrafterConfig
from ddtree.training.distill import (
    ListPrompts,
    StreamPrompts,
    build_sequences,
    read_prompts,
    weights_fingerprint,
)
from ddtree.training.loop import autocast, lr_at, make_optimizer, progress, step_bar

DATA = "data.pt"
METRICS = "training.json"
MASK_TOKEN = "<|mask|>"
SELECTOR_INIT = 0.1  # std of a fresh DFlash2 drafter's selector codebooks
GAMMAS = {8: 4.0, 10: 5.0, 16: 7.0}  # DFlash's loss-decay constants per block size


RUN_FIELDS = {
    "steps",
    "ckpt_every",
    "save_dtype",
    "max_minutes",
    "eval_prompts",
    "eval_prompt_len",
    "eval_new_tokens",
    "eval_budget",
    "num_sequences",
    "gen_batch_size",
}  # may change on resume


# -- the training objective ----------------------------------------------------------------------------


def default_gamma(block_size: int) -> float:
    """DFlash's gamma (7 for 16, 5 for 10, 4 for 8), interpolated linearly for other block sizes."""
    if block_size in GAMMAS:
        return GAMMAS[block_size]
    if block_size < 8:
        return block_size / 2
    if block_size > 16:
        return GAMMAS[16] + (block_size - 16) / 3
    lo = max(s for s in GAMMAS if s < block_size)
    hi = min(s for s in GAMMAS if s > block_size)
    return GAMMAS[lo] + (GAMMAS[hi] - GAMMAS[lo]) * (block_size - lo) / (hi - lo)


def loss_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """[S] weight of block position k: 0 at k = 0 (the given anchor token), exp(-(k-1)/gamma) after."""
    gamma = gamma or default_gamma(block_size)
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def sample_anchors(
    lengths: torch.Tensor,  # [B] sequence lengths
    prompt_lens: torch.Tensor,  # [B]
    block_size: int,
    num_anchors: int,
    gen: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Anchors [B, A] and validity [B, A].

    An anchor needs a full block of labels (``anchor + S - 1 < length``) and at least one context feature
    (``anchor >= 1``). It is drawn from the continuation (``anchor >= prompt_len``: the root at inference
    is always a target-generated token), falling back to the whole sequence when the continuation is too
    short, and distinct when there is room. A sequence too short for any block gets invalid anchors.
    """
    b = lengths.numel()
    anchors = torch.ones(b, num_anchors, dtype=torch.long)
    valid = torch.ones(b, num_anchors, dtype=torch.bool)
    for row in range(b):
        hi = int(lengths[row]) - block_size  # last anchor whose block fits
        lo = max(1, int(prompt_lens[row]))
        if lo > hi:
            lo = 1
        n = hi - lo + 1
        if n <= 0:
            valid[row] = False
            continue
        picks = (
            torch.randperm(n, generator=gen)[:num_anchors]
            if n >= num_anchors
            else torch.randint(n, (num_anchors,), generator=gen)
        )
        anchors[row] = lo + picks
    return anchors, valid


def training_mask(anchors: torch.Tensor, block_size: int, ctx_len: int) -> torch.Tensor:
    """[B, 1, A*S, ctx_len + A*S] bool: block a sees context columns < anchor_a and its own block only."""
    b, a = anchors.shape
    s = block_size
    ctx = torch.arange(ctx_len)[None, None, :] < anchors[:, :, None]  # [B, A, C]
    ctx = ctx[:, :, None, :].expand(b, a, s, ctx_len).reshape(b, a * s, ctx_len)  # [B, A*S, C]
    blk = torch.arange(a * s) // s
    own = (blk[:, None] == blk[None, :]).expand(b, a * s, a * s)  # [B, A*S, A*S] block-diagonal
    return torch.cat((ctx, own), dim=-1)[:, None]


def block_inputs(
    ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block tokens [B, A*S] (anchor token then MASKs), their positions [B, A*S], labels [B, A, S].

    ``labels[:, a, k]`` is the token at ``anchor_a + k`` (k = 0 is the anchor itself, never scored).
    """
    b, t = ids.shape
    a = anchors.shape[1]
    pos = anchors[:, :, None] + torch.arange(block_size)[None, None, :]  # [B, A, S]
    labels = ids.gather(1, pos.clamp(max=t - 1).flatten(1)).view(b, a, block_size)
    tokens = torch.full_like(labels, mask_token_id)
    tokens[:, :, 0] = labels[:, :, 0]
    return tokens.flatten(1), pos.flatten(1), labels


class _Enough(Exception):
    """Raised by a forward hook once the deepest feature layer has run: the rest of the target is waste."""


@torch.no_grad()
def target_features(target, drafter: DFlashDrafter, ids: torch.Tensor) -> torch.Tensor:
    """[B, T, F*H] features of every position: the engine's ``select_features(hidden_states)``.

    Only layers up to the deepest feature layer run (DFlash's rule stops at L - 3, so a third of a 6-layer
    target is skipped): hooks grab those layers' outputs and stop the forward. When the last layer is a
    feature layer, HF reports it after the final norm, so that case runs the full forward like the engine.
    """
    layers = getattr(getattr(target, "model", None), "layers", None)
    deepest = max(drafter.target_layer_ids)
    if layers is None or deepest >= len(layers) - 1:
        return target_outputs(target, drafter, ids, logits=False)[0]
    captured: dict[int, torch.Tensor] = {}

    def grab(index: int):
        def hook(module, args, output) -> None:
            captured[index] = output[0] if isinstance(output, tuple) else output
            if index == deepest:
                raise _Enough

        return hook

    handles = [layers[i].register_forward_hook(grab(i)) for i in set(drafter.target_layer_ids)]
    try:
        target(input_ids=ids, logits_to_keep=1, use_cache=False)
    except _Enough:
        pass
    finally:
        for h in handles:
            h.remove()
    return torch.cat([captured[i] for i in drafter.target_layer_ids], dim=-1)


@torch.no_grad()
def target_outputs(
    target, drafter: DFlashDrafter, ids: torch.Tensor, logits: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The features [B, T, F*H] and, with ``logits``, the target's logits [B, T, V] of every position (what
    the kl objective distils): one full forward."""
    out = target(input_ids=ids, output_hidden_states=True, logits_to_keep=0 if logits else 1, use_cache=False)
    return drafter.select_features(out.hidden_states), out.logits if logits else None


def teacher_log_probs(
    target_logits: torch.Tensor,  # [B, T, V]
    positions: torch.Tensor,  # [B, A, S] absolute positions of the block tokens
    valid: torch.Tensor,  # [B, A]
    temperature: float,
) -> torch.Tensor:
    """[N, S-1, V] log-probabilities the target gives block positions 1 .. S-1 of the valid blocks: the
    token at position p is predicted by the target's output at p - 1, at ``temperature``."""
    before = (positions[:, :, 1:] - 1)[valid]  # [N, S-1]
    rows = torch.arange(target_logits.shape[0])[:, None, None].expand_as(positions[:, :, 1:])[valid]
    return torch.log_softmax(target_logits[rows, before].float() / temperature, dim=-1)


def drafter_loss(
    drafter: DFlashDrafter,
    embed: torch.nn.Module,
    lm_head: torch.nn.Module,
    features: torch.Tensor,  # [B, T, F*H]
    ids: torch.Tensor,  # [B, T]
    anchors: torch.Tensor,  # [B, A]
    valid: torch.Tensor,  # [B, A]
    weights: torch.Tensor,  # [S]
    mask_token_id: int,
    target_logits: torch.Tensor | None = None,  # [B, T, V]: distil the distribution (kl) instead of tokens
    temperature: float = 1.0,
    tokens_too: bool = False,  # with target_logits: the tokens' cross-entropy added to the KL ("both")
) -> tuple[torch.Tensor, torch.Tensor]:
    """The weighted block loss over all valid blocks (plus a DFlash2 drafter's selector loss), and (no
    grad) the blocks' mean greedy acceptance length.

    Block loss: cross-entropy to the sequence's tokens, or with ``target_logits`` the KL divergence from
    the target's distribution at ``temperature`` (at T > 0 a draft is accepted with the target's probability
    of it, so the drafter should cover that whole distribution, not only its argmax), or with ``tokens_too``
    both added (the KL alone moved greedy drafts' argmax: tau -11% at T = 0). The acceptance length
    of a block is 1 + the number of leading positions whose greedy draft is right: what method ``dflash``
    would accept on this sequence when its continuation was greedy.
    """
    b, t = ids.shape
    s = drafter.block_size
    tokens, positions, labels = block_inputs(ids, anchors, s, mask_token_id)
    mask = training_mask(anchors, s, t)
    ctx_positions = torch.arange(t)[None].expand(b, t)
    hidden = drafter(embed(tokens), features, positions, ctx_positions, mask=mask)  # [B, A*S, H]
    hidden = hidden.view(b, anchors.shape[1], s, -1)[valid]  # [N, S, H]
    labels = labels[valid]  # [N, S]
    if labels.numel() == 0:
        return hidden.sum() * 0.0, torch.tensor(1.0)
    logits = rows_linear(hidden[:, 1:], lm_head.weight, lm_head.bias).float()  # [N, S-1, V]
    teacher = None
    if target_logits is not None:
        teacher = teacher_log_probs(target_logits, positions.view(b, -1, s), valid, temperature)
    w = weights[1:].to(logits.device)  # [S-1]

    def weighted(per_position: torch.Tensor) -> torch.Tensor:  # [N, S-1] -> the blocks' weighted mean
        return (per_position * w).sum() / (w.sum() * labels.shape[0])

    # The objective's terms, one rule for the block and the selector: the tokens' cross-entropy (argmax,
    # both) and the KL to the teacher (kl, both).
    tokens_term = teacher is None or tokens_too
    loss = logits.new_zeros(())
    if teacher is not None:
        loss = loss + weighted(position_loss(logits, labels[:, 1:], teacher))
    if tokens_term:
        loss = loss + weighted(position_loss(logits, labels[:, 1:], None))
    if isinstance(drafter, DFlash2Drafter):
        selector, correct = selector_loss(drafter, hidden, logits, labels, teacher, tokens_term)
        loss = loss + weighted(selector)
    else:
        correct = logits.argmax(-1) == labels[:, 1:]  # [N, S-1]
    with torch.no_grad():
        accepted = correct.long().cumprod(-1).sum(-1).float().mean() + 1
    return loss, accepted


def position_loss(
    logits: torch.Tensor,  # [..., V] the drafter's
    labels: torch.Tensor,  # [...] the sequence's tokens
    teacher: torch.Tensor | None,  # [..., V] the target's log-probs (kl), or None (argmax)
) -> torch.Tensor:
    """Per-position loss [...]: cross-entropy to the label, or KL(teacher || drafter)."""
    if teacher is None:
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none").view_as(labels)
    log_q = torch.log_softmax(logits, dim=-1)
    return F.kl_div(log_q, teacher, log_target=True, reduction="none").sum(-1)


def selector_loss(
    drafter: DFlash2Drafter,
    hidden: torch.Tensor,  # [N, S, H] block hidden states
    logits: torch.Tensor,  # [N, S-1, V] LM-head logits of block positions 1 .. S-1
    labels: torch.Tensor,  # [N, S] the block's tokens (position 0: the anchor)
    teacher: torch.Tensor | None,  # [N, S-1, V] the target's log-probs: the KL term, or None
    tokens: bool,  # the tokens' cross-entropy term (``drafter_loss`` decides both terms)
) -> tuple[torch.Tensor, torch.Tensor]:
    """The candidate selector's loss [N, S-1] and its greedy drafts' correctness [N, S-1] (no grad).

    Teacher forcing: position l's predecessor is the true token l - 1, so the selector's edge scores over
    l's top-K candidates learn q(token l | token l - 1), the quantity the lattice's trees add up. Argmax:
    cross-entropy to the true token among the candidates (0 where it is not one). KL: to the target's
    distribution restricted to the candidates. The greedy chain through the lattice (``dflash``) is right
    at l exactly when every earlier position was and l's best-scored candidate is the true token.
    """
    values, candidates = torch.topk(drafter.draft_logits(logits), drafter.settings.top_k, dim=-1)  # [N, L, K]
    previous = labels[:, :-1, None]  # [N, L, 1]
    scores = drafter.candidate_selector(hidden[:, 1:], candidates, values, previous)[:, :, 0]  # [N, L, K]
    target = labels[:, 1:]  # [N, L]
    hit = candidates == target[..., None]  # [N, L, K]
    loss = torch.zeros_like(scores[..., 0])  # [N, L]
    if tokens:
        present = hit.any(-1)
        ce = F.cross_entropy(scores.flatten(0, 1), hit.float().argmax(-1).flatten(), reduction="none")
        loss = loss + ce.view_as(target) * present
    if teacher is not None:
        kept = torch.log_softmax(teacher.gather(-1, candidates), dim=-1)  # [N, L, K]
        loss = loss + F.kl_div(torch.log_softmax(scores, -1), kept, log_target=True, reduction="none").sum(-1)
    with torch.no_grad():
        correct = candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0] == target
    return loss, correct


# -- building blocks of the run ------------------------------------------------------------------------


def resolve_mask_token_id(tokenizer, given: int, vocab_size: int) -> int:
    """The given id, else the tokenizer's ``<|mask|>``: DFlash needs a token the target never emits."""
    if given >= 0:
        mask_id = given
    else:
        vocab = tokenizer.get_vocab() if tokenizer is not None else {}
        if MASK_TOKEN not in vocab:
            where = f"its tokenizer has no {MASK_TOKEN}" if tokenizer is not None else "it has no tokenizer"
            raise DDTreeError(f"cannot pick the drafter's mask token: {where}; pass --mask-token-id")
        mask_id = vocab[MASK_TOKEN]
    if not 0 <= mask_id < vocab_size:
        raise DDTreeError(f"mask_token_id {mask_id} is outside the target's vocabulary of {vocab_size}")
    return mask_id


def build_drafter(target, cfg: DrafterConfig, mask_token_id: int) -> DFlashDrafter:
    """A fresh drafter shaped like the target (hidden size must match: it shares embedding and LM head), of
    ``cfg.architecture``; a DFlash2 drafter's convolutions start as the identity, so it starts as DFlash."""
    layers = target.config.num_hidden_layers
    ids = cfg.layer_ids()
    if ids is not None and not all(0 <= i < layers for i in ids):
        raise DDTreeError(f"target_layer_ids {ids} must lie in [0, {layers}) for this target")
    torch.manual_seed(cfg.seed)
    config = dflash_config(
        target.config,
        num_layers=cfg.num_layers,
        block_size=cfg.block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=ids,
    )
    if cfg.architecture == "dflash":
        return DFlashDrafter(config)
    config.dflash_config |= dflash2_settings(cfg).config_entries()
    config.architectures = [DFLASH2]
    drafter = DFlash2Drafter(config)
    for layer in drafter.layers:
        layer.attention_conv.identity_()
        layer.mlp_conv.identity_()
    # Small random codebooks: the pair scores start near 0 (the lattice starts as the marginals), and
    # unlike zeros (where each codebook's gradient is the other's value) they can learn.
    selector = drafter.candidate_selector
    for codebook in (selector.predecessor_codebook, selector.successor_codebook):
        torch.nn.init.normal_(codebook, std=SELECTOR_INIT)
    return drafter


def dflash2_settings(cfg: DrafterConfig) -> DFlash2Settings:
    return DFlash2Settings(cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k)


def start_from(directory: Path, cfg: DrafterConfig, target) -> tuple[DFlashDrafter, DrafterConfig]:
    """The drafter of ``cfg.architecture`` holding the weights of the drafter saved in ``directory`` (DFlash
    or DFlash2), and ``cfg`` with that drafter's shape. DFlash weights in a DFlash2 drafter: everything but
    the convolutions (identity) and the selector (fresh) is the saved drafter's."""
    saved = load_drafter(directory).float()
    check_pair(target, saved)
    shape = dict(
        num_layers=saved.config.num_hidden_layers,
        block_size=saved.block_size,
        target_layer_ids=",".join(map(str, saved.target_layer_ids)),
        mask_token_id=saved.mask_token_id,
    )
    from_dflash = not isinstance(saved, DFlash2Drafter)
    if not from_dflash:
        s = saved.settings
        shape |= dict(
            conv_kernel_size=s.taps,
            conv_group_size=s.group_size,
            selector_rank=s.rank,
            selector_top_k=s.top_k,
        )
        if cfg.architecture == "dflash":
            raise DDTreeError(
                f"--init-from {directory} is a DFlash2 drafter: train it with --architecture dflash2"
            )
    cfg = replace(cfg, **shape)
    drafter = build_drafter(target, cfg, saved.mask_token_id)
    result = drafter.load_state_dict(saved.state_dict(), strict=False)
    missing = [
        k for k in result.missing_keys if "rotary_emb" not in k and not (from_dflash and _dflash2_only(k))
    ]
    if missing or result.unexpected_keys:
        raise DDTreeError(f"--init-from {directory}: its weights do not fit (missing {missing[:3]})")
    return drafter, cfg


def _dflash2_only(key: str) -> bool:
    """Whether a DFlash2 state-dict key has no DFlash counterpart."""
    return key.startswith("candidate_selector.") or ".attention_conv." in key or ".mlp_conv." in key


def _corpus_stream(tokenizer, split: str, root: Path | None) -> torch.Tensor:
    from ddtree.training.data import token_stream  # corpus tokenisation only when the corpus is used

    if tokenizer is None:
        raise DDTreeError("corpus prompts need the target's tokenizer; this target has none (use --prompts)")
    return token_stream(tokenizer, split, root)


def prompt_sources(
    cfg: DrafterConfig, tokenizer, prompts: Path | None, root: Path | None
) -> tuple[StreamPrompts | ListPrompts, list[list[int]]]:
    """Training prompt source and held-out evaluation prompts.

    Corpus: train-split windows for data, held-out-split windows for evaluation. Prompts file: the last
    ``eval_prompts`` prompts are held out for evaluation and never generate training data.
    """
    gen = torch.Generator().manual_seed(cfg.seed + 7919)
    if prompts is not None:
        items = read_prompts(prompts, tokenizer)
        n_eval = cfg.eval_prompts
        if len(items) <= n_eval:
            raise DDTreeError(f"{prompts} has {len(items)} prompts; need more than eval_prompts={n_eval}")
        train, held = items[: len(items) - n_eval], items[len(items) - n_eval :]
        return ListPrompts(train, cfg.prompt_max), [p[-cfg.eval_prompt_len :] for p in held]
    train = StreamPrompts(_corpus_stream(tokenizer, "train", root), cfg.prompt_min, cfg.prompt_max)
    held: list[list[int]] = []
    if cfg.eval_prompts:
        stream = _corpus_stream(tokenizer, "heldout", root)
        if stream.numel() <= cfg.eval_prompt_len:
            raise DDTreeError(f"the held-out split has {stream.numel()} tokens, too few for eval prompts")
        starts = torch.randint(0, stream.numel() - cfg.eval_prompt_len, (cfg.eval_prompts,), generator=gen)
        held = [stream[s : s + cfg.eval_prompt_len].tolist() for s in starts.tolist()]
    return train, held


@torch.no_grad()
def evaluate_tau(
    target, drafter: DFlashDrafter, tokenizer, prompts: list[list[int]], new_tokens: int, budget: int
) -> dict:
    """Greedy tau (tokens per target forward) of ``dflash`` and ``ddtree`` on ``prompts``, pooled over
    rounds, and whether both reproduced method ``ar`` token for token (they must: decoding is lossless)."""
    from ddtree.engine import Engine
    from ddtree.request.params import METHODS, SamplingParams
    from ddtree.request.stats import mean_acceptance_length

    params = SamplingParams(max_new_tokens=new_tokens)
    result: dict = {"prompts": len(prompts), "new_tokens": new_tokens, "budget": budget}
    outputs: dict[str, list[list[int]]] = {}
    for method in METHODS:
        engine = Engine(target, drafter, tokenizer, method=method, budget=budget)
        lens: list[int] = []
        outputs[method] = []
        t0 = time.perf_counter()
        for p in prompts:
            r = engine.generate(p, params)
            outputs[method].append(r.token_ids)
            lens += r.stats.acceptance_lengths
        if method != "ar":
            result[method] = {
                "tau": round(mean_acceptance_length(lens), 4),
                "rounds": len(lens),
                "seconds": round(time.perf_counter() - t0, 2),
            }
    for method in result.keys() & set(METHODS):  # ar runs last in METHODS: compare once it has
        result[method]["matches_ar"] = outputs[method] == outputs["ar"]
    return result


def _save_final(drafter: DFlashDrafter, out: Path, cfg: DrafterConfig) -> DFlashDrafter:
    """Save in ``save_dtype`` (public DFlash / DFlash2 format), reload in fp32: the returned drafter is what
    ships."""
    shipped = type(drafter)(drafter.config)
    shipped.load_state_dict(drafter.state_dict())
    shipped.to(SAVE_DTYPES[cfg.save_dtype]).save_pretrained(out)
    return type(drafter).from_pretrained(out, dtype=torch.float32)


# -- the run -------------------------------------------------------------------------------------------


def load_frozen_target(directory: str | Path):
    """The target (fp32) and its tokenizer, every parameter frozen, embedding and LM head included."""
    model, tokenizer = load_target(directory)
    model.requires_grad_(False)
    return model, tokenizer


def train_step(
    target,
    drafter: DFlashDrafter,
    opt: torch.optim.Optimizer,
    ids: torch.Tensor,  # [B, T] right-padded sequences
    lengths: torch.Tensor,  # [B]
    prompt_lens: torch.Tensor,  # [B]
    cfg: DrafterConfig,
    gen: torch.Generator,
    weights: torch.Tensor,  # [S] loss weights
) -> tuple[float, float]:
    """One optimizer step on ``cfg.anchors`` blocks per sequence; returns (loss, mean acceptance length).

    With ``bf16_autocast`` the frozen target's forward runs in bf16 too (half its cost, which dominates a
    step on CPU); the features then carry bf16 rounding, a small train/inference gap the drafter tolerates.
    """
    anchors, valid = sample_anchors(lengths, prompt_lens, cfg.block_size, cfg.anchors, gen)  # [B, A]
    with autocast(cfg.bf16_autocast):
        if cfg.objective != "argmax":
            features, target_logits = target_outputs(target, drafter, ids)  # [B, T, F*H], [B, T, V]
        else:
            features, target_logits = target_features(target, drafter, ids), None
        loss, accepted = drafter_loss(
            drafter,
            target.get_input_embeddings(),
            target.get_output_embeddings(),
            features,
            ids,
            anchors,
            valid,
            weights,
            drafter.mask_token_id,
            target_logits,
            cfg.distill_temperature,
            tokens_too=cfg.objective == "both",
        )
    loss.backward()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), accepted.item()


def train_drafter(
    target: str | Path,
    out: str | Path,
    cfg: DrafterConfig | None = None,
    *,
    prompts: str | Path | None = None,
    corpus_root: str | Path | None = None,
    work_dir: str | Path = "runs/drafter",
    data_path: str | Path | None = None,
    resume: bool = False,
    threads: int | None = None,
    until_step: int | None = None,
) -> dict:
    """Generate (or load) the data, train, save ``out`` (drafter + ``training.json``), return the metrics.

    ``work_dir`` holds the data cache (unless ``data_path``) and ``checkpoint.pt`` (drafter, AdamW moments,
    step, loss history), written every ``ckpt_every`` steps; ``resume=True`` continues from it, with
    ``cfg.steps`` free to grow. ``until_step`` stops early after checkpointing (a session-sized piece of a
    long run: resume later); then nothing is saved to ``out`` and the metrics say ``"finished": False``.
    """
    cfg = cfg or DrafterConfig()
    if prompts is not None and corpus_root is not None:
        raise DDTreeError("give either prompts or a corpus root, not both")
    work_dir, out = Path(work_dir), Path(out)
    data_path = work_dir / DATA if data_path is None else Path(data_path)
    root = None if corpus_root is None else Path(corpus_root)
    if threads is not None:
        torch.set_num_threads(threads)

    model, tokenizer = load_frozen_target(target)
    vocab = model.get_input_embeddings().num_embeddings
    if cfg.init_from:
        drafter, cfg = start_from(Path(cfg.init_from), cfg, model)
        mask_id = drafter.mask_token_id
    else:
        mask_id = resolve_mask_token_id(tokenizer, cfg.mask_token_id, vocab)
        drafter = build_drafter(model, cfg, mask_id)
    ckpt_path = work_dir / CHECKPOINT
    state = load_checkpoint(ckpt_path, cfg, RUN_FIELDS) if resume else None  # cfg with the drafter's shape
    eos = eos_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0

    source, eval_prompts = prompt_sources(cfg, tokenizer, None if prompts is None else Path(prompts), root)
    limit = model.config.max_position_embeddings
    if cfg.prompt_max + cfg.continuation > limit or cfg.eval_prompt_len + cfg.eval_new_tokens > limit:
        raise DDTreeError(f"prompt plus continuation must fit the target's context of {limit} tokens")
    data = build_sequences(
        model,
        source,
        data_path,
        {"target": weights_fingerprint(target)},
        cfg.num_sequences,
        cfg.gen_batch_size,
        cfg.continuation,
        cfg.sample_fraction,
        cfg.seed,
        pad_id,
        eos,
    )

    opt = make_optimizer(drafter, cfg)
    start, elapsed, history = 0, 0.0, []
    if state is not None:
        drafter.load_state_dict(state["drafter"])
        opt.load_state_dict(state["optimizer"])
        start, elapsed, history = state["step"], state["elapsed"], state["history"]
    n_params = sum(p.numel() for p in drafter.parameters())
    n_tokens = int(data.lengths.sum())
    tqdm.write(
        f"drafter: {n_params / 1e6:.2f}M params, layers {cfg.num_layers}, block {cfg.block_size}, "
        f"features from target layers {drafter.target_layer_ids}, mask id {mask_id}; data "
        f"{len(data)} sequences ({n_tokens:,} tokens); steps {start}->{cfg.steps}",
        file=sys.stderr,
    )

    weights = loss_weights(cfg.block_size, cfg.gamma or None)
    labelled_per_step = cfg.batch_size * cfg.anchors * (cfg.block_size - 1)
    stop = cfg.steps if until_step is None else min(cfg.steps, until_step)
    bar = step_bar(cfg.steps, start)

    def checkpoint(done: int, seconds: float) -> None:
        parts = {"history": history, "drafter": drafter.state_dict(), "optimizer": opt.state_dict()}
        save_checkpoint(ckpt_path, cfg, done, seconds, **parts)

    drafter.train()
    t0 = time.perf_counter()
    step = start
    finished = True
    while step < cfg.steps:
        if step >= stop:
            finished = False
            break
        frac = progress(step, elapsed + time.perf_counter() - t0, cfg)
        if frac >= 1.0:
            break  # out of time: the schedule has already decayed to min_lr
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg, frac, progress_warmup=False)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)  # resumed runs see the same batches
        indices = torch.randint(0, len(data), (cfg.batch_size,), generator=gen)
        ids, lengths, prompt_lens = data.batch(indices, pad_id)  # [B, T]
        loss, accepted = train_step(model, drafter, opt, ids, lengths, prompt_lens, cfg, gen, weights)
        step += 1

        history.append([step, round(loss, 5), round(accepted, 4)])
        recent = history[-20:]
        tok_s = (step - start) * labelled_per_step / (time.perf_counter() - t0)
        bar.set_postfix(
            loss=f"{sum(h[1] for h in recent) / len(recent):.3f}",
            acc_len=f"{sum(h[2] for h in recent) / len(recent):.2f}",
            tok_s=f"{tok_s:.0f}",
            refresh=False,
        )
        bar.update(1)
        if step % cfg.ckpt_every == 0:
            checkpoint(step, elapsed + time.perf_counter() - t0)
    bar.close()
    elapsed += time.perf_counter() - t0
    checkpoint(step, elapsed)

    def mean(col: int, rows: list[list[float]]) -> float | None:
        return round(sum(r[col] for r in rows) / len(rows), 4) if rows else None

    metrics: dict = {
        "finished": finished,
        "params": n_params,
        "steps": step,
        "train_seconds_total": round(elapsed, 1),
        "sequences": len(data),
        "data_tokens": n_tokens,
        "labelled_tokens_seen": step * labelled_per_step,
        "first_train_loss": mean(1, history[:20]),
        "final_train_loss": mean(1, history[-20:]),
        "final_train_acceptance": mean(2, history[-20:]),
        "mask_token_id": mask_id,
        "target_layer_ids": drafter.target_layer_ids,
    }
    if not finished:
        tqdm.write(f"stopped at step {step} (checkpointed); resume to continue", file=sys.stderr)
        return metrics
    out.mkdir(parents=True, exist_ok=True)
    shipped = _save_final(drafter, out, cfg)
    if eval_prompts:
        metrics["eval"] = evaluate_tau(
            model, shipped, tokenizer, eval_prompts, cfg.eval_new_tokens, cfg.eval_budget
        )
        ev = metrics["eval"]
        tqdm.write(
            f"held-out tau ({ev['prompts']} prompts x {ev['new_tokens']} tokens, greedy): dflash "
            f"{ev['dflash']['tau']:.3f}, ddtree (budget {ev['budget']}) {ev['ddtree']['tau']:.3f}",
            file=sys.stderr,
        )
    metrics["config"] = asdict(cfg)
    metrics["history"] = history[:: max(1, len(history) // 200)]  # a plottable loss curve, <= ~200 points
    (out / METRICS).write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics
