"""The target's own log-probabilities of emitted tokens (raw logits, before any sampling transform), as
OpenAI's ``logprobs`` report them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
