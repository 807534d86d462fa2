"""What a request asks of the engine thread (:class:`Plan`) and what comes back (:class:`Started`, pieces).

Everything here runs on the engine thread, since it touches the engine and its tokenizer: rendering the
chat prompt, tokenizing, checking the context, then streaming each choice in turn. Choices run one after
another (the engine is batch-1); each is independent, and seeded ones use ``seed + index``.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from dataclasses import dataclass, field, replace

from ddtree.errors import DDTreeError
from ddtree.params import SamplingParams
from ddtree.server.chat import render_chat
from ddtree.server.errors import invalid
from ddtree.server.metrics import Metrics
from ddtree.server.protocol import SpeculativeStats
from ddtree.server.tokens import TokenNames

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs to the context's end
FLOOR_LOGPROB = -9999.0  # JSON has no -inf; a token the target gives no mass gets this


@dataclass
class ServedModel:
    """The loaded engine and what the server derives from it once."""

    engine: object
    names: TokenNames
    max_positions: int


@dataclass(frozen=True)
class Plan:
    """One request, validated: prompts (completions) or messages (chat), params and the engine choice."""

    params: SamplingParams
    max_tokens: int | None  # None: the completions default, or the rest of the context for chat
    n: int = 1
    prompts: list[str | list[int]] | None = None
    messages: list[dict[str, str]] | None = None
    method: str | None = None
    budget: int | None = None
    topk: int | None = None


@dataclass
class Started:
    """The request passed the engine's checks; generation begins."""

    prompt_tokens: int


@dataclass
class TokenInfo:
    token: str
    bytes: list[int]
    logprob: float
    top: list[tuple[str, list[int], float]]


@dataclass
class Piece:
    """What one engine round added to choice ``index``; its last piece has finish_reason and stats."""

    index: int
    text: str
    num_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenInfo] = field(default_factory=list)
    stats: SpeculativeStats | None = None


def run_plan(model: ServedModel, plan: Plan, metrics: Metrics) -> Generator[Started | Piece, None, None]:
    """Validate against the model, yield Started, then every choice's pieces in order."""
    engine = model.engine
    if plan.messages is not None:
        prompts, param = [render_chat(engine.tokenizer, plan.messages)], "messages"
    else:
        prompts, param = plan.prompts or [], "prompt"
    ids = [_encode(engine, p, param) for p in prompts]
    streams = []
    try:
        for i, prompt_ids in enumerate(ids):
            max_new = _max_new_tokens(plan, len(prompt_ids), model.max_positions, param)
            for j in range(plan.n):
                index = i * plan.n + j
                seed = None if plan.params.seed is None else plan.params.seed + index
                params = replace(plan.params, max_new_tokens=max_new, seed=seed)
                stream = engine.stream(
                    prompt_ids, params, method=plan.method, budget=plan.budget, topk=plan.topk
                )
                streams.append((index, stream))
        prompt_tokens = sum(map(len, ids))
        metrics.prompt_tokens.inc(prompt_tokens)
        yield Started(prompt_tokens)
        for index, stream in streams:
            yield from _run_choice(model, index, stream, metrics, plan.params.logprobs is not None)
    finally:
        for _, stream in streams:
            stream.close()


def _run_choice(model: ServedModel, index: int, stream, metrics: Metrics, want_logprobs: bool):
    delta, tokens = None, 0
    try:
        for delta in stream:
            tokens += len(delta.token_ids)
            done = delta.finish_reason is not None
            yield Piece(
                index,
                delta.text,
                len(delta.token_ids),
                delta.finish_reason,
                [_token_info(model.names, lp) for lp in delta.logprobs] if want_logprobs else [],
                _stats(delta.stats) if done else None,
            )
    finally:
        stream.close()
        if delta is not None:
            metrics.record_generation(delta.stats.method, delta.stats.acceptance_lengths, tokens)


def _encode(engine, prompt: str | list[int], param: str) -> list[int]:
    if isinstance(prompt, str) and engine.tokenizer is None:
        raise invalid("this model has no tokenizer; send the prompt as token ids", param)
    try:
        return engine.encode(prompt)
    except DDTreeError as exc:
        raise invalid(str(exc), param) from None


def _max_new_tokens(plan: Plan, prompt_len: int, context: int, param: str) -> int:
    room = context - prompt_len
    if room < 1:
        raise invalid(
            f"the prompt has {prompt_len} tokens; the model's context holds {context} (including the answer)",
            param,
            "context_length_exceeded",
        )
    if plan.max_tokens is None:
        return room if plan.messages is not None else min(COMPLETION_DEFAULT_MAX_TOKENS, room)
    if plan.max_tokens > room:
        raise invalid(
            f"the prompt ({prompt_len} tokens) plus max_tokens ({plan.max_tokens}) exceeds the model's "
            f"context of {context} tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    return plan.max_tokens


def _token_info(names: TokenNames, lp) -> TokenInfo:
    token, raw = names.lookup(lp.token)
    top = []
    for t, value in lp.top:
        s, b = names.lookup(t)
        top.append((s, b, _finite(value)))
    return TokenInfo(token, raw, _finite(lp.logprob), top)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR_LOGPROB


def _stats(stats) -> SpeculativeStats:
    return SpeculativeStats(
        method=stats.method,
        budget=stats.budget,
        tau=stats.tau,
        rounds=stats.rounds,
        acceptance_lengths=list(stats.acceptance_lengths),
    )
