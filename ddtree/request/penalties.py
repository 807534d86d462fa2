"""Penalties and biases (vLLM's sampling parameters): ``presence_penalty``, ``frequency_penalty``,
``repetition_penalty``, ``logit_bias``, ``min_tokens`` and ``bad_words``, applied at every node of a row's
draft tree.

The target's law at a node is the one plain decoding would see after the request's output so far plus the
node's own path (its drafted ancestors and itself; the root, the last committed token, is in the output
already). So a node's counts are the row's output counts plus its path's tokens, its depth says how many
tokens come before the one it predicts, and a multi-token bad word is matched against output + path. With
every node's logits adjusted that way, greedy acceptance picks the penalised argmax and sampled acceptance
draws from the penalised law: the output is exactly plain penalised decoding's, at any budget and in any
batch. The drafter drafts from its own, unpenalised distributions: that can only cost acceptance.

Order, as vLLM's sampler: the grammar's mask, bad words, logit bias, min_tokens, then the repetition,
frequency and presence penalties; temperature and the sampling filters come after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from ddtree.errors import DDTreeError
from ddtree.model.capture import upload
from ddtree.request.params import SamplingParams
from ddtree.speculative.tree import ends_with
from ddtree.speculative.verify import ancestor_mask

if TYPE_CHECKING:
    from ddtree.request.output import OutputState
    from ddtree.speculative.tree import TreeBatch


@dataclass(frozen=True)
class RequestPenalties:
    """A request's penalties resolved once, at admission: bad words as token ids (vLLM's rule: each word
    as written and with a leading space), bias keys checked against the vocabulary, and the token ids
    ``min_tokens`` holds back (its stop token ids and, unless ``ignore_eos``, EOS)."""

    presence: float
    frequency: float
    repetition: float
    bias: tuple[tuple[int, float], ...]  # (token, added logit); banned single-token words at -inf
    min_tokens: int
    held_back: tuple[int, ...]
    bad_sequences: tuple[tuple[int, ...], ...]  # multi-token bad words: the last is banned after the rest
    # The prompt's distinct tokens, which the repetition penalty counts as seen (an array: every round
    # reads it, and converting a 40k-token prompt from Python ints each time cost ~40 ms at 16 rows)
    prompt_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), compare=False)

    @classmethod
    def of(
        cls,
        params: SamplingParams,
        prompt_ids: Sequence[int],
        eos_token_ids: frozenset[int],
        tokenizer,
        vocab: int,
    ) -> RequestPenalties | None:
        """None for a request without any penalty (the round then skips this work for it)."""
        if not params.penalised:
            return None
        check_logit_bias(params, vocab)
        bias = dict(params.logit_bias)
        single, sequences = _bad_word_ids(params.bad_words, tokenizer)
        bias |= dict.fromkeys(single, float("-inf"))
        held = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        repeats = params.repetition_penalty != 1.0
        return cls(
            presence=params.presence_penalty,
            frequency=params.frequency_penalty,
            repetition=params.repetition_penalty,
            bias=tuple(sorted(bias.items())),
            min_tokens=params.min_tokens,
            held_back=tuple(sorted(t for t in held if 0 <= t < vocab)),
            bad_sequences=sequences,
            prompt_ids=np.unique(np.asarray(prompt_ids if repeats else [], dtype=np.int64)),
        )


class PenalizedRow(Protocol):
    """What the penalties read of a running request (the engine's ``Request``): its resolved penalties
    and the tokens it has output so far."""

    penalties: RequestPenalties | None
    output: OutputState


def check_logit_bias(params: SamplingParams, vocab: int) -> None:
    """Every biased token is in the model's vocabulary (``vocab`` LM-head rows)."""
    for token, _ in params.logit_bias:
        if not 0 <= token < vocab:
            raise DDTreeError(f"logit_bias names token {token}, outside the vocabulary [0, {vocab})")


def _bad_word_ids(words: Sequence[str], tokenizer) -> tuple[set[int], tuple[tuple[int, ...], ...]]:
    """vLLM's tokenization of ``bad_words``: each word as written (leading spaces stripped) and, when it
    tokenizes to as many tokens with a different first one, with a leading space."""
    if not words:
        return set(), ()
    if tokenizer is None:
        raise DDTreeError("bad_words need the target's tokenizer; this target has none")
    found: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not plain:
            raise DDTreeError(f"bad word {word!r} has no tokens")
        found.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            found.append(spaced)
    return {s[0] for s in found if len(s) == 1}, tuple(s for s in found if len(s) > 1)


class NodePenalties:
    """One round's penalties for a group of G rows and their trees (None: every row at its root, as for
    the first token after a prefill), applied to logits at any of their nodes.

    Per-row state goes to the device once, as [G] and [G, V] tensors; a node's own contribution (its path)
    is a scatter over the tree's N columns, so nothing [G, N, V] is ever built beyond the logits asked
    for."""

    def __init__(
        self, rows: Sequence[PenalizedRow], trees: TreeBatch | None, vocab: int, device: torch.device
    ):
        pens = [r.penalties for r in rows]
        g = len(rows)
        none = RequestPenalties(0.0, 0.0, 1.0, (), 0, (), ())
        pens = [p or none for p in pens]
        coef = np.array([(p.presence, p.frequency, p.repetition) for p in pens], dtype=np.float32)  # [G, 3]
        self.presence, self.frequency, self.repetition = upload(coef.T.copy(), device)  # [G] each
        self.counting = any(p.presence or p.frequency or p.repetition != 1.0 for p in pens)
        self.repeating = any(p.repetition != 1.0 for p in pens)
        self.bias = None
        if any(p.bias for p in pens):  # [G, V] float32
            at = np.array([(i, t) for i, p in enumerate(pens) for t, _ in p.bias], dtype=np.int64)
            values = np.array([v for p in pens for _, v in p.bias], dtype=np.float32)
            self.bias = torch.zeros(g, vocab, device=device)
            self.bias[tuple(upload(at.T.copy(), device))] = upload(values, device)
        self.counts = self.seen = None
        if self.counting:  # the output's counts [G, V] (its tokens up to the root) and the prompt's tokens
            self.counts = _scatter_rows([r.output.token_ids for r in rows], vocab, device, torch.float32)
            if self.repeating:
                self.seen = _scatter_rows([p.prompt_ids for p in pens], vocab, device, torch.bool)
        n = 1 if trees is None else trees.tokens.shape[1]
        self.generated = upload(np.array([len(r.output.token_ids) for r in rows], dtype=np.int64), device)
        self.min_tokens = upload(np.array([p.min_tokens for p in pens], dtype=np.int64), device)
        self.holding = any(p.min_tokens > len(r.output.token_ids) for p, r in zip(pens, rows, strict=True))
        self.held = None
        if self.holding:  # [G, V] bool: what min_tokens holds back
            self.held = _scatter_rows([p.held_back for p in pens], vocab, device, torch.bool)
        self.width = n
        if trees is None:
            self.tokens = self.path = self.depths = None
        else:
            self.tokens = trees.tokens  # [G, N]
            self.depths = trees.depths  # [G, N]
            self.path = ancestor_mask(trees)  # [G, N, N]
            self.path[:, :, 0] = False  # the root is the output's last token, counted already
        self.bans = _sequence_bans(rows, pens, trees, device)  # [K, 3] (row, node, token) or None

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor, nodes: torch.Tensor) -> torch.Tensor:
        """``logits`` [M, V] of the nodes ``nodes`` [M] of rows ``rows`` [M] (indices into the group),
        penalised (a new tensor)."""
        if self.bans is not None:  # multi-token bad words completed at these nodes
            key = rows * self.width + nodes  # [M]
            hit = key[:, None] == (self.bans[:, 0] * self.width + self.bans[:, 1])[None]  # [M, K]
            src = torch.where(hit, float("-inf"), float("inf")).to(logits.dtype)
            logits = logits.scatter_reduce(1, self.bans[:, 2].expand_as(hit), src, reduce="amin")
        depths = 0 if self.depths is None else self.depths[rows, nodes][:, None]  # tokens before it, [M, 1]
        counts = None
        if self.counting:
            counts = self.counts[rows]  # [M, V], a gathered copy
            if self.path is not None:
                counts.scatter_add_(1, self.tokens[rows], self.path[rows, nodes].to(counts.dtype))
        return self._apply(logits, rows, depths, counts)

    def drafts(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [G, L, V] penalised as a first level's would be, at each position's depth: the
        drafted tokens before a position are not known yet, so only the output counts (a new tensor)."""
        if self.bans is not None:  # words the output's end completes
            logits = logits.clone()
            logits[self.bans[:, 0], :, self.bans[:, 2]] = float("-inf")
        depths = torch.arange(logits.shape[1], device=logits.device)[None, :, None]  # [1, L, 1]
        counts = None if self.counts is None else self.counts[:, None]  # [G, 1, V]
        return self._apply(logits, slice(None), depths, counts)

    def _apply(self, logits: torch.Tensor, rows, depths, counts: torch.Tensor | None) -> torch.Tensor:
        """Bias, min_tokens and the repetition, frequency and presence penalties on logits [M, V] (rows
        ``rows`` [M]) or [G, L, V] (every row: ``rows`` is ``slice(None)``); ``depths`` and ``counts``
        already broadcast to the logits' shape ([M, 1] / [M, V], or [1, L, 1] / [G, 1, V])."""
        lead = logits.dim() - 2  # 0 for [M, V], 1 for [G, L, V]

        def per_row(x: torch.Tensor) -> torch.Tensor:  # [G] -> [M, 1] or [G, 1, 1]
            return x[rows].view(-1, *[1] * (lead + 1))

        def per_token(x: torch.Tensor) -> torch.Tensor:  # [G, V] -> [M, V] or [G, 1, V]
            return x[rows].view(-1, *[1] * lead, x.shape[-1])

        if self.bias is not None:
            logits = logits + per_token(self.bias)
        if self.holding:
            short = per_row(self.generated) + depths < per_row(self.min_tokens)
            logits = logits.masked_fill(short & per_token(self.held), float("-inf"))
        if counts is None:
            return logits
        seen = counts > 0
        if self.repeating:
            rep = per_row(self.repetition)
            hit = seen | per_token(self.seen)
            logits = torch.where(hit, torch.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - per_row(self.frequency) * counts
        return logits - per_row(self.presence) * seen


def _scatter_rows(lists: Sequence[Sequence[int]], vocab: int, device: torch.device, dtype) -> torch.Tensor:
    """[G, V]: per row, how often each token occurs in its list (float) or whether it does (bool)."""
    lengths = np.array([len(x) for x in lists], dtype=np.int64)
    flat = np.concatenate([np.asarray(x, dtype=np.int64) for x in lists])
    at = upload(np.repeat(np.arange(len(lists)), lengths) * vocab + flat, device)
    out = torch.zeros(len(lists) * vocab, dtype=dtype, device=device)
    if dtype == torch.bool:
        out[at] = True
    else:
        out.index_add_(0, at, torch.ones(len(at), dtype=dtype, device=device))
    return out.view(len(lists), vocab)


def _sequence_bans(
    rows: Sequence[PenalizedRow],
    pens: Sequence[RequestPenalties],
    trees: TreeBatch | None,
    device: torch.device,
) -> torch.Tensor | None:
    """[K, 3] int64 (row, node, token): at each node whose output + path ends with all but the last
    token of a multi-token bad word, that last token is banned (vLLM's rule). The trees of rows with such
    words come to the host (one read, for them only)."""
    group = [i for i, p in enumerate(pens) if p.bad_sequences]
    if not group:
        return None
    width = 1 if trees is None else trees.tokens.shape[1]
    nodes = np.zeros((2, len(rows), width), dtype=np.int64)  # tokens, parents (padding and roots: 0)
    sizes = np.ones(len(rows), dtype=np.int64) if trees is None else trees.sizes
    if trees is not None:
        at = upload(np.asarray(group, dtype=np.int64), device)
        host = torch.stack((trees.tokens[at], trees.parents[at])).cpu().numpy()  # [2, C, N]
        nodes[:, group] = host
    tokens, parents = nodes
    bans = []
    for i in group:
        longest = max(map(len, pens[i].bad_sequences)) - 1
        history = rows[i].output.token_ids[-longest:]  # the output's end, the root last
        for node in range(int(sizes[i])):
            for seq in pens[i].bad_sequences:
                if ends_with(seq[:-1], history, tokens[i], parents[i], node):
                    bans.append((i, node, seq[-1]))
    if not bans:
        return None
    return upload(np.array(bans, dtype=np.int64), device)
