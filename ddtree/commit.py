"""The one commit path shared by greedy and sampled verification (and by the dflash and ar baselines).

A round's verdict, per row, is ``(accepted node indices with the root first, emitted tokens with the bonus
last)``. Committing it means: write the tokens (stopping exactly at EOS, a stop token id, a stop string or
``max_new_tokens``, even in the middle of an accepted block), pack the target KV row so the accepted nodes
sit contiguously after the committed context, and keep those nodes' hidden features for the drafter's next
pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ddtree.errors import DDTreeError
from ddtree.kv_cache import KVCache
from ddtree.params import SamplingParams


def pack_accepted(cache: KVCache, rows: list[int], starts: list[int], paths: list[list[int]]) -> None:
    """Row ``rows[i]`` keeps the keys/values of its tree nodes ``paths[i]`` at columns ``starts[i] + 0 .. m``.

    A path is m increasing node indices starting with the root (0), which stays where it is. A path that is
    already ``0 .. m - 1`` (a first-child chain, the common case) is in place; the others move together in
    one gather and one scatter per buffer, padded with the scratch column. The tree's other columns need no
    clearing: the next round's mask hides everything past a row's committed tokens.
    """
    moved = [
        (row, start, path)
        for row, start, path in zip(rows, starts, paths, strict=True)
        if path[-1] != len(path) - 1
    ]
    if not moved:
        return
    width = max(len(path) for _, _, path in moved)
    pad = [cache.scratch] * width
    src = [[start + j for j in path] + pad[len(path) :] for _, start, path in moved]  # [K, width]
    dst = [list(range(start, start + len(path))) + pad[len(path) :] for _, start, path in moved]
    device = cache.keys[0].device
    cache.move_cols(*(torch.tensor(x, device=device) for x in ([row for row, _, _ in moved], src, dst)))


@dataclass
class TokenLogprobs:
    """The target's own log-probabilities at one emitted position (raw logits, before sampling transforms)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]  # the ``n`` most probable tokens, most probable first


def token_logprobs(logits: torch.Tensor, tokens: list[int], n: int) -> list[TokenLogprobs]:
    """Logprobs of ``tokens`` under ``logits`` [len(tokens), V], row i being the distribution of token i."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [m, V]
    chosen = logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()
    top = logp.topk(n, dim=-1) if n > 0 else None
    top_ids = top.indices.tolist() if top is not None else [[] for _ in tokens]
    top_vals = top.values.tolist() if top is not None else [[] for _ in tokens]
    return [
        TokenLogprobs(t, c, list(zip(ids, vals, strict=True)))
        for t, c, ids, vals in zip(tokens, chosen, top_ids, top_vals, strict=True)
    ]


@dataclass
class OutputState:
    """The tokens a request has produced so far and why it stopped, if it has."""

    params: SamplingParams
    eos_token_ids: frozenset[int]
    tokenizer: object | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # aligned with token_ids when requested
    finish_reason: str | None = None
    stop_text_end: int | None = None  # where the text ends when a stop string was found

    def __post_init__(self) -> None:
        if self.params.stop and self.tokenizer is None:
            raise DDTreeError("stop strings need a tokenizer; pass stop_token_ids instead")
        self._stop_ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            self._stop_ids |= self.eos_token_ids

    def write(self, tokens: list[int], logprobs: list[TokenLogprobs] | None = None) -> int:
        """Append ``tokens`` (and their logprobs) up to the first stop; returns how many were taken."""
        taken = 0
        for i, token in enumerate(tokens):
            self.token_ids.append(token)
            if logprobs is not None:
                self.logprobs.append(logprobs[i])
            taken += 1
            if token in self._stop_ids:
                self.finish_reason = "stop"
                break
            if len(self.token_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.params.stop:
            self._truncate_at_stop_string(taken)
        return taken

    def _truncate_at_stop_string(self, taken: int) -> None:
        """If a stop string appeared, keep tokens up to the one that completed it and cut the text there."""
        first_new = len(self.token_ids) - taken
        hit = _find_stop(self.text_upto(len(self.token_ids)), self.params.stop)
        if hit is None:
            return
        for count in range(first_new + 1, len(self.token_ids) + 1):  # the token that completed it
            if _find_stop(self.text_upto(count), self.params.stop) is not None:
                del self.token_ids[count:]
                del self.logprobs[count:]
                break
        self.finish_reason = "stop"
        self.stop_text_end = _find_stop(self.text_upto(len(self.token_ids)), self.params.stop)

    def text_upto(self, count: int) -> str:
        ids = self.token_ids[:count]
        if ids and ids[-1] in self._stop_ids:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=True) if self.tokenizer is not None else ""

    @property
    def text(self) -> str:
        text = self.text_upto(len(self.token_ids))
        return text if self.stop_text_end is None else text[: self.stop_text_end]

    def stable_text(self) -> str:
        """Text that can be streamed now: no dangling partial character or possible stop-string prefix."""
        text = self.text
        if self.finish_reason is not None:
            return text
        text = text.rstrip("\ufffd")
        hold = max((_overlap(text, s) for s in self.params.stop), default=0)
        return text[: len(text) - hold]


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index where the earliest stop string starts in ``text``, or None."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
