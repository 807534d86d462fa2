"""A request on the API side of the server: its plan, its choices, and its pieces.

The engine thread only schedules and runs rounds. Everything a tokenizer does happens here, on the API
side (the event loop and its thread pool), as vLLM's API process and SGLang's tokenizer and detokenizer
managers do: rendering the chat prompt, tokenizing and checking the context (``plan_choices``, in a worker
thread), and turning each engine row's token ids into text with stop strings (``Generation.piece``). One
engine row per choice, each independent; seeded ones use ``seed + index``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from ddtree.errors import DDTreeError
from ddtree.request.output import OutputState
from ddtree.request.params import RequestOptions, SamplingParams
from ddtree.request.penalties import check_logit_bias
from ddtree.request.stats import mean_acceptance_length
from ddtree.server.chat import render_chat
from ddtree.server.errors import invalid
from ddtree.server.metrics import Metrics
from ddtree.server.protocol import SpeculativeStats
from ddtree.server.reasoning import grammar_start
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
    # the engine's options for every row: method, budget, topk (None: the server's) and cache_salt
    options: RequestOptions = RequestOptions()
    tools: list[dict] | None = None  # chat: for the template
    template_kwargs: dict | None = None  # chat: the request's chat_template_kwargs
    skip_special_tokens: bool = True  # False: the text keeps them (a tool parser's markers may be special)
    grammar_after_reasoning: bool = False  # chat: structured outputs hold once the parsed reasoning ends
    echo: bool = False  # completions: the prompt's text (and its logprobs, when asked) before the answer
    prompt_logprobs: int | None = None  # completions: vLLM's prompt_logprobs (its top N)


@dataclass
class Started:
    """The request passed the engine's checks; generation begins."""

    prompt_tokens: int


@dataclass
class TokenInfo:
    token: str
    bytes: list[int]
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: list[tuple[str, list[int], float]] | None
    token_id: int = -1
    top_ids: tuple[int, ...] = ()


@dataclass
class Piece:
    """What one engine round added to choice ``index``; its last piece has finish_reason and stats."""

    index: int
    text: str
    num_tokens: int
    finish_reason: str | None = None
    logprobs: list[TokenInfo] = field(default_factory=list)
    stats: SpeculativeStats | None = None
    cached_tokens: int = 0  # of the row's prompt, tokens the prefix cache held at admission
    prompt_logprobs: list[TokenInfo] | None = None  # the first piece of a row that scored its prompt


@dataclass(frozen=True)
class Choice:
    """One row of a request: choice ``index`` (prompt-major) of one prompt, with its own params."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    echo: str = ""  # the text the answer starts with (``echo``: the prompt's)


def plan_choices(model: ServedModel, plan: Plan) -> list[Choice]:
    """Render, tokenize and check the request against the context (raising its 400); one choice per
    prompt x n, seeded ones with ``seed + index``."""
    engine = model.engine
    try:
        check_logit_bias(plan.params, engine.vocab_size)
    except DDTreeError as exc:
        raise invalid(str(exc), "logit_bias") from None
    params = plan.params
    if plan.messages is not None:
        prompts = [render_chat(engine.tokenizer, plan.messages, plan.tools, plan.template_kwargs)]
        param = "messages"
        if plan.grammar_after_reasoning and params.structured_outputs is not None:  # as vLLM
            start = grammar_start(engine.tokenizer, prompts[0])
            params = replace(params, structured_outputs=replace(params.structured_outputs, start_after=start))
    else:
        prompts, param = plan.prompts or [], "prompt"
    choices = []
    for i, prompt in enumerate(prompts):
        # A rendered chat carries its template's special tokens already (HF's apply_chat_template and vLLM
        # add none then); a completion prompt gets the tokenizer's (a BOS for Llama).
        prompt_ids = _encode(engine, prompt, param, add_special_tokens=plan.messages is None)
        max_new = _max_new_tokens(plan, len(prompt_ids), model.max_positions, param)
        if params.min_tokens > max_new:
            message = f"min_tokens ({params.min_tokens}) is more than max_tokens ({max_new})"
            raise invalid(message, "min_tokens")
        for j in range(plan.n):
            index = i * plan.n + j
            seed = None if params.seed is None else params.seed + index
            echo = _echo_text(engine, prompt, prompt_ids) if plan.echo else ""
            choices.append(
                Choice(index, prompt_ids, replace(params, max_new_tokens=max_new, seed=seed), echo)
            )
    return choices


@dataclass
class EngineRow:
    """One engine request of a job: what the engine thread passes to ``add_request``, nothing to tokenize."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams  # no stop strings, detokenize=False: the engine thread makes no text


@dataclass(frozen=True)
class RowDelta:
    """An engine delta as the engine thread hands it over, with the row's round count at that moment (the
    engine keeps appending to its stats; the API side reads them up to ``rounds``)."""

    delta: object  # ddtree.engine.StreamDelta, its text empty
    rounds: int


@dataclass
class _Row:
    index: int
    output: OutputState  # the API side's text, stop strings and kept tokens of this choice
    tokens: int = 0
    stats: object = None  # the engine's GenerationStats, from the row's latest delta
    rounds: int = 0
    last_at: float | None = None  # when its latest delta came (inter-token latency)
    finished: bool = False
    started: bool = False  # its first piece is out


class Generation:
    """One request on the API side: its choices (rendered and tokenized here, off the engine thread), the
    engine rows they become, and each row's deltas turned into :class:`Piece` s with incremental text and
    stop strings (a stop string found here ends the row; the caller aborts it in the engine)."""

    def __init__(self, model: ServedModel, plan: Plan, metrics: Metrics, request_id: str) -> None:
        self.model = model
        self.plan = plan
        self.metrics = metrics
        self.choices = plan_choices(model, plan)
        engine = model.engine
        self.rows = {
            f"{request_id}-{c.index}": _Row(
                c.index,
                OutputState(c.params, engine.eos_token_ids, engine.tokenizer, plan.skip_special_tokens),
            )
            for c in self.choices
        }
        self.prompt_tokens = sum(len(c.prompt_ids) for c in self.choices[:: plan.n])

    def engine_rows(self) -> list[EngineRow]:
        """The engine requests, one per choice: token ids, and params that make no text."""
        return [
            EngineRow(request_id, c.prompt_ids, replace(c.params, stop=(), detokenize=False))
            for request_id, c in zip(self.rows, self.choices, strict=True)
        ]

    @property
    def finished(self) -> bool:
        return all(row.finished for row in self.rows.values())

    def piece(self, item: RowDelta) -> Piece | None:
        """The piece for one engine delta of one of this request's rows (None once the row has ended here,
        as when a stop string cut it while the engine still ran it)."""
        delta = item.delta
        row = self.rows[delta.request_id]
        if row.finished:
            return None
        now = time.perf_counter()
        if row.last_at is not None and delta.token_ids:
            self.metrics.inter_token.observe(now - row.last_at)
        if delta.token_ids:
            row.last_at = now
        before = len(row.output.token_ids)
        taken = row.output.write(delta.token_ids, delta.logprobs or None)
        row.tokens += taken
        row.stats, row.rounds = delta.stats, item.rounds
        finish = row.output.finish_reason or delta.finish_reason
        want_logprobs = self.plan.params.logprobs is not None
        piece = Piece(
            row.index,
            row.output.new_text(),
            taken,
            finish,
            [_token_info(self.model.names, lp) for lp in row.output.logprobs[before:]]
            if want_logprobs
            else [],
            _stats(row.stats, row.rounds) if finish is not None else None,
            row.stats.cached_tokens,
        )
        if not row.started:  # the row's first piece: what the answer starts with
            row.started = True
            piece.text = self.choices[row.index].echo + piece.text
            if delta.prompt_logprobs is not None:
                names, first = self.model.names, self.choices[row.index].prompt_ids[0]
                scored = [
                    _token_info(names, lp) if lp is not None else _unscored(names, first)
                    for lp in delta.prompt_logprobs
                ]  # the engine scored the larger of the two top-Ns asked for
                if self.plan.echo and want_logprobs:
                    piece.logprobs = [_top(i, self.plan.params.logprobs) for i in scored] + piece.logprobs
                if self.plan.prompt_logprobs is not None:
                    piece.prompt_logprobs = [_top(i, self.plan.prompt_logprobs) for i in scored]
        if finish is not None:
            self._close(row)
        return piece

    def close(self) -> None:
        """Count what the unfinished rows generated (the request stops early: disconnect, timeout, error)."""
        for row in self.rows.values():
            if not row.finished:
                self._close(row)

    def _close(self, row: _Row) -> None:
        row.finished = True
        if row.stats is not None:
            lengths = row.stats.acceptance_lengths[: row.rounds]
            drafted = sum(row.stats.drafted_nodes[: row.rounds])
            self.metrics.record_generation(row.stats.method, lengths, row.tokens, drafted)


def _echo_text(engine, prompt: str | list[int], prompt_ids: list[int]) -> str:
    """The prompt as ``echo`` returns it: its text, or its token ids decoded (special tokens kept)."""
    if isinstance(prompt, str):
        return prompt
    return engine.tokenizer.decode(prompt_ids) if engine.tokenizer is not None else ""


def _encode(engine, prompt: str | list[int], param: str, add_special_tokens: bool) -> list[int]:
    if isinstance(prompt, str) and engine.tokenizer is None:
        raise invalid("this model has no tokenizer; send the prompt as token ids", param)
    try:
        return engine.encode(prompt, add_special_tokens)
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
    return TokenInfo(token, raw, _finite(lp.logprob), top, lp.token, tuple(t for t, _ in lp.top))


def _top(info: TokenInfo, n: int) -> TokenInfo:
    if info.top is None:
        return info
    return replace(info, top=info.top[:n], top_ids=info.top_ids[:n])


def _unscored(names: TokenNames, token_id: int) -> TokenInfo:
    """A prompt's first token: nothing before it predicts it."""
    token, raw = names.lookup(token_id)
    return TokenInfo(token, raw, None, None, token_id)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR_LOGPROB


def _stats(stats, rounds: int) -> SpeculativeStats:
    lengths = list(stats.acceptance_lengths[:rounds])
    return SpeculativeStats(
        method=stats.method,
        budget=stats.budget,
        tau=mean_acceptance_length(lengths),
        rounds=len(lengths),
        acceptance_lengths=lengths,
        drafted_nodes=list(stats.drafted_nodes[:rounds]),
        auto=None if stats.auto is None else stats.auto.as_dict(),
    )
