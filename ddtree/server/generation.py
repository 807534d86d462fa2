"""What a request asks of the engine thread (:class:`Plan`) and what comes back (:class:`Started`, pieces).

Everything here runs on the engine thread, since it touches the engine and its tokenizer: rendering the
chat prompt, tokenizing, checking the context, adding one engine row per choice (they run side by side,
each independent; seeded ones use ``seed + index``) and turning each row's deltas into pieces.
"""

from __future__ import annotations

import math
import time
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
    messages: list[dict] | None = None
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


@dataclass(frozen=True)
class Choice:
    """One row of a request: choice ``index`` (prompt-major) of one prompt, with its own params."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams


def plan_choices(model: ServedModel, plan: Plan) -> list[Choice]:
    """Render, tokenize and check the request against the context (raising its 400); one choice per
    prompt x n, seeded ones with ``seed + index``."""
    engine = model.engine
    if plan.messages is not None:
        prompts, param = [render_chat(engine.tokenizer, plan.messages)], "messages"
    else:
        prompts, param = plan.prompts or [], "prompt"
    choices = []
    for i, prompt in enumerate(prompts):
        prompt_ids = _encode(engine, prompt, param)
        max_new = _max_new_tokens(plan, len(prompt_ids), model.max_positions, param)
        for j in range(plan.n):
            index = i * plan.n + j
            seed = None if plan.params.seed is None else plan.params.seed + index
            choices.append(Choice(index, prompt_ids, replace(plan.params, max_new_tokens=max_new, seed=seed)))
    return choices


@dataclass
class _Row:
    index: int
    tokens: int = 0
    stats: object = None  # the engine's GenerationStats, from the row's latest delta
    last_at: float | None = None  # when its latest delta came (inter-token latency)
    finished: bool = False


class Generation:
    """One request's rows in the engine, on the engine thread: adds them, turns each of their deltas into a
    :class:`Piece`, and counts what they generated (also when the request stops early)."""

    def __init__(self, model: ServedModel, plan: Plan, metrics: Metrics, request_id: str) -> None:
        self.model = model
        self.plan = plan
        self.metrics = metrics
        self.choices = plan_choices(model, plan)
        self.rows = {f"{request_id}-{c.index}": _Row(c.index) for c in self.choices}
        self.prompt_tokens = sum(len(c.prompt_ids) for c in self.choices[:: plan.n])

    def add_to(self, engine) -> Started:
        """Queue every row in the engine (all or none); DDTreeError for an option the engine refuses."""
        added = []
        try:
            for request_id, choice in zip(self.rows, self.choices, strict=True):
                engine.add_request(
                    choice.prompt_ids,
                    choice.params,
                    method=self.plan.method,
                    budget=self.plan.budget,
                    topk=self.plan.topk,
                    request_id=request_id,
                )
                added.append(request_id)
        except BaseException:
            for request_id in added:
                engine.abort(request_id)
            raise
        self.metrics.prompt_tokens.inc(self.prompt_tokens)
        return Started(self.prompt_tokens)

    @property
    def finished(self) -> bool:
        return all(row.finished for row in self.rows.values())

    def piece(self, delta) -> Piece:
        """The piece for one engine delta of one of this request's rows."""
        row = self.rows[delta.request_id]
        now = time.perf_counter()
        if row.last_at is not None and delta.token_ids:
            self.metrics.inter_token.observe(now - row.last_at)
        if delta.token_ids:
            row.last_at = now
        row.tokens += len(delta.token_ids)
        row.stats = delta.stats
        done = delta.finish_reason is not None
        want_logprobs = self.plan.params.logprobs is not None
        piece = Piece(
            row.index,
            delta.text,
            len(delta.token_ids),
            delta.finish_reason,
            [_token_info(self.model.names, lp) for lp in delta.logprobs] if want_logprobs else [],
            _stats(delta.stats) if done else None,
        )
        if done:
            self._close(row)
        return piece

    def abort(self, engine) -> None:
        """Take the unfinished rows out of the engine (their rows are free at the next step)."""
        for request_id, row in self.rows.items():
            if not row.finished:
                engine.abort(request_id)
                self._close(row)

    def _close(self, row: _Row) -> None:
        row.finished = True
        if row.stats is not None:
            self.metrics.record_generation(row.stats.method, row.stats.acceptance_lengths, row.tokens)


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
