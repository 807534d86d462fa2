"""Worker pieces -> OpenAI answers: one body (``stream: false``) or chunks (``stream: true``).

One formatter serves one request. It accumulates every piece (usage and the ``ddtree`` stats need the
totals either way) and, when streaming, turns each piece into the chunks OpenAI clients expect:
completions send ``text`` per chunk; chat sends a role chunk, content chunks, then an empty delta with
the finish_reason. A chat read by a reasoning or tool parser (``MessageParser``) sends
``reasoning_content`` and ``tool_calls`` deltas too, and its whole answer is those same deltas put
together. The chunk that finishes a choice carries that choice's ``ddtree`` stats; with
``stream_options.include_usage`` a last chunk with ``choices: []`` carries the usage and the totals.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from ddtree.request.stats import mean_acceptance_length
from ddtree.server.generation import Piece, Started, TokenInfo
from ddtree.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptLogprob,
    PromptTokensDetails,
    SpeculativeStats,
    TokenLogprob,
    ToolCall,
    TopLogprob,
    Usage,
)
from ddtree.server.reasoning import ReasoningStream
from ddtree.server.tool_parsers import (
    FORMATS,
    CallStream,
    NamedCallStream,
    RequiredCallsStream,
    ToolCallDelta,
    ToolCallStream,
    call_id,
    parses,
)


@dataclass(frozen=True)
class MessageParsing:
    """How a chat request's answers are read: reasoning first (``--reasoning-parser``), then tool calls in
    what remains (``--tool-call-parser`` for ``tool_choice: "auto"``; ``"required"`` or a named function:
    the grammar's JSON)."""

    reasoning: str | None = None
    tool_parser: str | None = None
    tools: tuple[dict, ...] = ()
    forced: str | None = None  # "required", or the named function's name
    id_format: str | None = None  # the server's --tool-call-parser: its ids for every tool_choice
    first_call: int = 0  # tool calls earlier in the conversation (kimi_k2's ids count them)
    include_reasoning: bool = True  # false: the reasoning is read, and left out of the answer

    def calls(self) -> CallStream | None:
        ids = FORMATS[self.id_format].call_id if self.id_format is not None else call_id
        if self.forced == "required":
            return RequiredCallsStream(ids, self.first_call)
        if self.forced is not None:
            return NamedCallStream(self.forced, ids, self.first_call)
        if self.tool_parser is not None:
            return ToolCallStream(FORMATS[self.tool_parser](list(self.tools)), self.first_call)
        return None


@dataclass
class MessageDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class MessageParser:
    """One choice's text as reasoning, content and tool calls, piece by piece."""

    def __init__(self, parsing: MessageParsing) -> None:
        self.reasoning = ReasoningStream(parsing.reasoning) if parsing.reasoning else None
        self.calls = parsing.calls()

    def feed(self, text: str, final: bool) -> MessageDelta:
        """The delta ``text`` makes (``final``: the text has ended, so nothing is held any more)."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        if final and self.reasoning:
            more = self.reasoning.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        if self.calls is None:
            return MessageDelta(reasoning, content)
        content, calls = self.calls.feed(content)
        if final:
            rest, more = self.calls.finish()
            content, calls = content + rest, _merged(calls + more)
        return MessageDelta(reasoning, content, calls)


def _merged(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive deltas of one call as one."""
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            out[-1].arguments += d.arguments
        else:
            out.append(d)
    return out


@dataclass
class _Choice:
    text: str = ""
    tokens: int = 0
    logprobs: list[TokenInfo] = field(default_factory=list)
    finish_reason: str | None = None
    stats: SpeculativeStats | None = None
    text_offset: int = 0  # completions logprobs: where the next token starts in the choice's text
    prompt_logprobs: list[TokenInfo] | None = None  # completions: vLLM's prompt_logprobs, when asked
    opened: bool = False  # chat streaming: the role chunk was sent
    parser: MessageParser | None = None  # chat with a reasoning or tool parser
    delta: MessageDelta | None = None  # what the parser made of the latest piece
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def total_stats(stats: list[SpeculativeStats]) -> SpeculativeStats | None:
    """Several choices' stats as one: rounds and acceptance lengths pooled, tau over all rounds."""
    if not stats:
        return None
    lengths = [n for s in stats for n in s.acceptance_lengths]
    return SpeculativeStats(
        method=stats[0].method,
        budget=stats[0].budget,
        tau=mean_acceptance_length(lengths),
        rounds=len(lengths),
        acceptance_lengths=lengths,
        drafted_nodes=[n for s in stats for n in s.drafted_nodes],
        auto=stats[-1].auto,
        accept_threshold_single=stats[0].accept_threshold_single,
        accept_threshold_acc=stats[0].accept_threshold_acc,
    )


class _Answer:
    prefix = "cmpl"

    def __init__(self, model: str, include_usage: bool = False, logprobs: bool = False, n: int = 1) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.n = n  # choices per prompt: usage counts each prompt once, as its first choice
        self.prompt_tokens = 0
        self.cached_tokens: dict[int, int] = {}  # choice index -> prompt tokens its row found cached
        self.choices: dict[int, _Choice] = {}
        self.thresholds: dict[str, float] = {}  # the engine's lossy acceptance thresholds, if any

    def start(self, started: Started) -> None:
        self.prompt_tokens = started.prompt_tokens

    def add(self, piece: Piece) -> _Choice:
        choice = self.choices.setdefault(piece.index, _Choice())
        choice.text += piece.text
        choice.tokens += piece.num_tokens
        choice.logprobs += piece.logprobs
        if piece.prompt_logprobs is not None:
            choice.prompt_logprobs = piece.prompt_logprobs
        if piece.index % self.n == 0:
            self.cached_tokens[piece.index] = piece.cached_tokens
        if piece.finish_reason is not None:
            choice.finish_reason = piece.finish_reason
            choice.stats = piece.stats.model_copy(update=self.thresholds) if piece.stats else None
        return choice

    def usage(self) -> Usage:
        completion = sum(c.tokens for c in self.choices.values())
        return Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=completion,
            total_tokens=self.prompt_tokens + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values())),
        )

    def stats(self) -> SpeculativeStats | None:
        return total_stats([c.stats for _, c in sorted(self.choices.items()) if c.stats is not None])

    def _envelope(self, **fields) -> dict:
        return {"id": self.id, "created": self.created, "model": self.model, **fields}

    def closing_chunks(self) -> list[dict]:
        if not self.include_usage:
            return []
        chunk = self._chunk([], usage=self.usage())
        chunk["ddtree"] = dump_stats(self.stats())
        return [chunk]

    def _chunk(
        self, choices: list, usage: Usage | None = None, stats: SpeculativeStats | None = None
    ) -> dict:
        raise NotImplementedError


class CompletionAnswer(_Answer):
    prefix = "cmpl"

    def response(self) -> Completion:
        choices = [
            CompletionChoice(
                index=i,
                text=c.text,
                logprobs=self._logprobs(c, c.logprobs) if self.logprobs else None,
                finish_reason=c.finish_reason,
                prompt_logprobs=_prompt_logprobs(c.prompt_logprobs),
            )
            for i, c in sorted(self.choices.items())
        ]
        return Completion(**self._envelope(choices=choices, usage=self.usage(), ddtree=self.stats()))

    def chunks(self, piece: Piece) -> list[dict]:
        choice = self.add(piece)
        if not (piece.text or piece.logprobs or piece.finish_reason):
            return []
        logprobs = self._logprobs(choice, piece.logprobs) if self.logprobs else None
        item = CompletionChoice(
            index=piece.index,
            text=piece.text,
            logprobs=logprobs,
            finish_reason=piece.finish_reason,
            prompt_logprobs=_prompt_logprobs(piece.prompt_logprobs),
        )
        return [self._chunk([item], stats=choice.stats)]

    def _chunk(
        self, choices: list, usage: Usage | None = None, stats: SpeculativeStats | None = None
    ) -> dict:
        body = Completion(**self._envelope(choices=choices, usage=usage)).model_dump(mode="json")
        return _with_stats(body, stats)

    @staticmethod
    def _logprobs(choice: _Choice, infos: list[TokenInfo]) -> CompletionLogprobs:
        """OpenAI's legacy layout: parallel lists; ``text_offset`` counts from the choice's start."""
        offsets = []
        for info in infos:
            offsets.append(choice.text_offset)
            choice.text_offset += len(info.token)
        return CompletionLogprobs(
            tokens=[i.token for i in infos],
            token_logprobs=[i.logprob for i in infos],
            top_logprobs=[None if i.top is None else {s: v for s, _, v in i.top} for i in infos],
            text_offset=offsets,
        )


def _prompt_logprobs(infos: list[TokenInfo] | None) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's layout: per prompt token, by token id, the token itself and the top N (ranks from 1)."""
    if infos is None:
        return None
    out: list[dict[str, PromptLogprob] | None] = []
    for info in infos:
        if info.logprob is None:
            out.append(None)
            continue
        entry = {
            str(t): PromptLogprob(logprob=v, rank=rank, decoded_token=s)
            for rank, (t, (s, _, v)) in enumerate(zip(info.top_ids, info.top or (), strict=True), 1)
        }
        if str(info.token_id) not in entry:  # outside the top N: its rank is not computed
            entry[str(info.token_id)] = PromptLogprob(logprob=info.logprob, decoded_token=info.token)
        out.append(entry)
    return out


class ChatAnswer(_Answer):
    prefix = "chatcmpl"

    def __init__(
        self,
        model: str,
        include_usage: bool = False,
        logprobs: bool = False,
        n: int = 1,
        parsing: MessageParsing | None = None,
    ) -> None:
        super().__init__(model, include_usage, logprobs, n)
        self.parsing = parsing  # None: the text is the content, as it comes

    def add(self, piece: Piece) -> _Choice:
        choice = super().add(piece)
        if self.parsing is None:
            return choice
        if choice.parser is None:
            choice.parser = MessageParser(self.parsing)
        choice.delta = delta = choice.parser.feed(piece.text, piece.finish_reason is not None)
        choice.reasoning += delta.reasoning
        choice.content += delta.content
        for d in delta.tool_calls:
            if d.id is not None:
                choice.tool_calls.append(ToolCall(id=d.id, function=FunctionCall(name=d.name, arguments="")))
            choice.tool_calls[d.index].function.arguments += d.arguments
        if choice.tool_calls and choice.finish_reason is not None:
            choice.finish_reason = _calls_finish(choice)
        return choice

    def response(self) -> ChatCompletion:
        choices = [
            ChatChoice(
                index=i,
                message=self._message(c),
                logprobs=_chat_logprobs(c.logprobs) if self.logprobs else None,
                finish_reason=c.finish_reason,
            )
            for i, c in sorted(self.choices.items())
        ]
        return ChatCompletion(**self._envelope(choices=choices, usage=self.usage(), ddtree=self.stats()))

    def _message(self, c: _Choice) -> AssistantMessage:
        if self.parsing is None:
            return AssistantMessage(content=c.text)
        reasoning = (c.reasoning or None) if self.parsing.include_reasoning else None
        return AssistantMessage(
            content=c.content or None,
            reasoning_content=reasoning,
            reasoning=reasoning,
            tool_calls=c.tool_calls,
        )

    def chunks(self, piece: Piece) -> list[dict]:
        choice = self.add(piece)
        out = []
        if not choice.opened:
            choice.opened = True
            out.append(
                self._chunk(
                    [ChatChunkChoice(index=piece.index, delta=DeltaMessage(role="assistant", content=""))]
                )
            )
        if self.parsing is None:
            delta = DeltaMessage(content=piece.text)
        else:
            delta = _delta(choice.delta, self.parsing.include_reasoning)
        if delta.content or delta.reasoning_content or delta.tool_calls or piece.logprobs:
            logprobs = _chat_logprobs(piece.logprobs) if self.logprobs else None
            out.append(self._chunk([ChatChunkChoice(index=piece.index, delta=delta, logprobs=logprobs)]))
        if piece.finish_reason is not None:
            end = ChatChunkChoice(index=piece.index, delta=DeltaMessage(), finish_reason=choice.finish_reason)
            out.append(self._chunk([end], stats=choice.stats))
        return out

    def _chunk(
        self, choices: list, usage: Usage | None = None, stats: SpeculativeStats | None = None
    ) -> dict:
        body = ChatCompletionChunk(**self._envelope(choices=choices, usage=usage)).model_dump(mode="json")
        for c, choice in zip(body["choices"], choices, strict=True):  # a delta names only what it carries
            c["delta"] = choice.delta.model_dump(mode="json", exclude_none=True)
        return _with_stats(body, stats)


def _calls_finish(choice: _Choice) -> str:
    """The finish reason of an answer that made calls, as OpenAI's: ``tool_calls`` only when every call
    is whole (its arguments parse); a text the length limit cut is ``length`` (its calls as far as they
    went), unless a grammar's calls had all ended; a call broken otherwise (a stop string) is ``stop``."""
    whole = all(parses(c.function.arguments) for c in choice.tool_calls)
    calls = choice.parser.calls if choice.parser is not None else None
    if choice.finish_reason == "length" and not (calls is not None and calls.complete and whole):
        return "length"
    return "tool_calls" if whole else "stop"


def _delta(delta: MessageDelta, include_reasoning: bool = True) -> DeltaMessage:
    """A parsed delta in OpenAI's shape (a call's first entry: its id, type and name)."""
    calls = [
        DeltaToolCall(
            index=d.index,
            id=d.id,
            type="function" if d.id is not None else None,
            function=DeltaFunctionCall(name=d.name, arguments=d.arguments),
        )
        for d in delta.tool_calls
    ]
    reasoning = (delta.reasoning or None) if include_reasoning else None
    return DeltaMessage(
        content=delta.content or None,
        reasoning_content=reasoning,
        reasoning=reasoning,
        tool_calls=calls or None,
    )


def _chat_logprobs(infos: list[TokenInfo]) -> ChoiceLogprobs:
    return ChoiceLogprobs(
        content=[
            TokenLogprob(
                token=i.token,
                logprob=i.logprob,
                bytes=i.bytes,
                top_logprobs=[TopLogprob(token=s, logprob=v, bytes=b) for s, b, v in i.top],
            )
            for i in infos
        ]
    )


def dump_stats(stats: SpeculativeStats | None) -> dict | None:
    """The ``ddtree`` object of a response, a chunk or a Responses API body."""
    return stats.model_dump(mode="json") if stats is not None else None


def _with_stats(body: dict, stats: SpeculativeStats | None) -> dict:
    body.pop("ddtree", None)
    if stats is not None:
        body["ddtree"] = dump_stats(stats)
    return body
