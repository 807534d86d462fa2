"""``POST /v1/responses``: OpenAI's Responses API on the chat path.

A request becomes a chat request (``instructions`` a system message, input items messages: a
``function_call`` an assistant's tool call, a ``function_call_output`` a tool message, a ``reasoning`` item
the next assistant message's ``reasoning_content``), so the chat template, the tool and reasoning parsers,
structured outputs and the engine are the chat endpoint's own; only the answer's shape differs: output
items (reasoning, message, function calls) and, streamed, the Responses API's typed events. Nothing is
stored: ``store`` is answered ``false`` (logged once), and ``previous_response_id`` / ``conversation`` are a
400 (send the whole conversation as ``input``), as for a server that keeps no state.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ddtree.server.body import LargeBodyRoute
from ddtree.server.errors import invalid, unsupported
from ddtree.server.openai_api import ERRORS, STREAMED, answer_plan, chat_plan, check_model
from ddtree.server.protocol import (
    API_SEED,
    API_TOP_K,
    LOGPROBS,
    MAX_MESSAGES,
    MAX_TOOLS,
    TEMPERATURE,
    TOP_P,
    ChatCompletionRequest,
    ReasoningEffort,
    SpeculativeOptions,
    _Body,
    _bounded,
    _Strict,
)
from ddtree.server.responses import ChatAnswer, MessageParsing, dump_stats
from ddtree.server.tool_parsers import ToolCallDelta

router = APIRouter(prefix="/v1", tags=["openai"], route_class=LargeBodyRoute)
log = logging.getLogger("ddtree.server")


# -- request --------------------------------------------------------------------------------------------


class _Item(BaseModel):
    """Input items are read as clients send them back: fields this server has no use for (``id``,
    ``status``, ``annotations``, ``logprobs``, ...) are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)


class TextPart(_Item):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str | None = None
    refusal: str | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[TextPart]


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]


class ReasoningPart(_Item):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ReasoningPart] = []
    content: list[ReasoningPart] | None = None


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class FunctionTool(_Strict):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(_Strict):
    type: Literal["function"]
    name: str


class TextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(_Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="accepted and ignored")


class ReasoningOptions(_Strict):
    effort: ReasoningEffort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = Field(None, description="accepted and ignored")
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    """``POST /v1/responses``. ``temperature``, ``top_p`` and the extensions (``seed``, ``top_k``,
    ``speculative``) mean what they mean for chat."""

    model: str | None = None
    input: str | list[InputItem] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = Field(None, description="a system message before the input")
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: _bounded(float, TEMPERATURE) | None = None
    top_p: _bounded(float, TOP_P) | None = None
    top_logprobs: _bounded(int, LOGPROBS) | None = Field(None, description="accepted and ignored")
    stream: bool | None = None
    text: TextOptions | None = None
    reasoning: ReasoningOptions | None = None
    store: bool | None = Field(None, description="nothing is stored: answered false")
    previous_response_id: str | None = Field(None, description="not supported: send the whole conversation")
    conversation: str | dict | None = Field(None, description="not supported: send the whole conversation")
    background: bool | None = Field(None, description="only false is supported")
    include: list[str] | None = Field(None, description="accepted and ignored")
    truncation: Literal["auto", "disabled"] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # extensions, as for chat
    seed: _bounded(int, API_SEED) | None = None
    top_k: _bounded(int, API_TOP_K) | None = None
    speculative: bool | SpeculativeOptions | None = None


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request is."""
    if body.previous_response_id is not None or body.conversation is not None:
        param = "previous_response_id" if body.previous_response_id is not None else "conversation"
        raise unsupported(param, f"{param} is not supported (this server stores nothing): send the whole "
                          "conversation as input")  # fmt: skip
    if body.background:
        raise unsupported("background")
    fields: dict[str, Any] = {
        "model": body.model,
        "messages": _messages(body),
        "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "stream": body.stream,
        "seed": body.seed,
        "top_k": body.top_k,
        "speculative": body.speculative,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
            for t in body.tools
        ]
    if isinstance(body.tool_choice, NamedFunction):
        fields["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    else:
        fields["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if body.tool_choice == "required" or isinstance(body.tool_choice, NamedFunction):
        fmt = None  # the format is the message's, and a forced call writes none (agents send both)
    if fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise invalid("text.format json_schema needs a schema", "text.format.schema")
        schema = {"name": fmt.name or "answer", "schema": fmt.schema_, "strict": fmt.strict}
        fields["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None:
        fields["response_format"] = {"type": fmt.type}
    if body.reasoning is not None and body.reasoning.effort is not None:
        fields["reasoning_effort"] = body.reasoning.effort
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # a message this server's chat refuses (an empty conversation ...)
        error = exc.errors()[0]
        raise invalid(f"input: {error['msg']}", "input") from None


def _messages(body: ResponsesRequest) -> list[dict]:
    """Chat messages: the instructions, then the input items in order; consecutive function calls (and
    the reasoning before them) are one assistant message, as chat templates expect them."""
    messages: list[dict] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    reasoning: str | None = None
    for item in items:
        if isinstance(item, ReasoningItem):
            parts = item.content if item.content else item.summary
            reasoning = (reasoning or "") + "".join(p.text for p in parts)
        elif isinstance(item, MessageItem):
            message = {"role": item.role, "content": _text(item.content)}
            if item.role == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)  # the answer's next call
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning is not None:
                    messages[-1]["reasoning_content"], reasoning = reasoning, None
        else:
            output = _text(item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    if not messages or all(m["role"] == "system" for m in messages):
        raise invalid("input has no message to answer", "input")
    return messages


def _text(content: str | list[TextPart]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text or p.refusal or "" for p in content)


# -- answer ---------------------------------------------------------------------------------------------


class ResponsesAnswer(ChatAnswer):
    """The chat answer as output items; ``chunks`` gives the Responses API's streaming events (created,
    output items opened, text / reasoning / arguments deltas, items done, then completed or incomplete)."""

    def __init__(self, model: str, parsing: MessageParsing | None, request: ResponsesRequest) -> None:
        super().__init__(model, parsing=parsing)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.request = request
        self.items: list[dict] = []  # the output so far
        self.open: dict[str, int] = {}  # "reasoning" / "message" -> its item's index while it grows
        self.calls: dict[int, int] = {}  # a tool call's index -> its item's index
        self.events: list[dict] = []
        self.sequence = 0

    def add(self, piece) -> object:
        choice = super().add(piece)
        if not self.sequence:
            self._emit("response.created", response=self._body("in_progress"))
            self._emit("response.in_progress", response=self._body("in_progress"))
        if self.parsing is None:
            reasoning, content, calls = "", piece.text, []
        else:
            delta = choice.delta
            reasoning, content, calls = delta.reasoning, delta.content, delta.tool_calls
        if reasoning:
            self._grow("reasoning", reasoning)
        if content:
            self._grow("message", content)
        for call in calls:
            self._call(call)
        if choice.finish_reason is not None:
            for kind in list(self.open):
                self._close(kind)
            for index in self.calls.values():
                item = self.items[index] | {"status": "completed"}
                self.items[index] = item
                self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                           name=item["name"], arguments=item["arguments"])  # fmt: skip
                self._emit("response.output_item.done", output_index=index, item=item)
            status = self._status()
            self._emit(f"response.{status}", response=self._body(status))
        return choice

    def chunks(self, piece) -> list[dict]:
        self.add(piece)
        events, self.events = self.events, []
        return events

    def closing_chunks(self) -> list[dict]:
        return []

    def response(self) -> dict:
        return self._body(self._status())

    def _status(self) -> str:
        choice = self.choices.get(0)
        return "incomplete" if choice is not None and choice.finish_reason == "length" else "completed"

    def _emit(self, kind: str, **fields) -> None:
        self.events.append({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1

    def _grow(self, kind: str, text: str) -> None:
        """Add text to the open reasoning or message item, opening it (and closing the other) first."""
        if kind not in self.open:
            for other in list(self.open):
                self._close(other)
            index = len(self.items)
            self.open[kind] = index
            if kind == "reasoning":
                text = [{"type": "reasoning_text", "text": ""}]
                item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": text,
                        "status": "in_progress"}  # fmt: skip
            else:
                item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant",
                        "status": "in_progress", "content": []}  # fmt: skip
            self.items.append(item)
            self._emit("response.output_item.added", output_index=index, item=_copy(item))
            if kind == "message":
                item["content"].append({"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                self._emit("response.content_part.added", item_id=item["id"], output_index=index,
                           content_index=0, part=_copy(item["content"][0]))  # fmt: skip
        index = self.open[kind]
        item = self.items[index]
        item["content"][0]["text"] += text
        event = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        self._emit(event, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra)

    def _close(self, kind: str) -> None:
        index = self.open.pop(kind)
        item = self.items[index]
        item["status"] = "completed"
        part = item["content"][0]
        if kind == "reasoning":
            self._emit("response.reasoning_text.done", item_id=item["id"], output_index=index,
                       content_index=0, text=part["text"])  # fmt: skip
        else:
            self._emit("response.output_text.done", item_id=item["id"], output_index=index,
                       content_index=0, text=part["text"], logprobs=[])  # fmt: skip
            self._emit("response.content_part.done", item_id=item["id"], output_index=index,
                       content_index=0, part=_copy(part))  # fmt: skip
        self._emit("response.output_item.done", output_index=index, item=_copy(item))

    def _call(self, delta: ToolCallDelta) -> None:
        if delta.id is not None:  # a new call
            for kind in list(self.open):
                self._close(kind)
            index = len(self.items)
            self.calls[delta.index] = index
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": delta.id,
                    "name": delta.name, "arguments": "", "status": "in_progress"}  # fmt: skip
            self.items.append(item)
            self._emit("response.output_item.added", output_index=index, item=_copy(item))
        index = self.calls[delta.index]
        item = self.items[index]
        if delta.arguments:
            item["arguments"] += delta.arguments
            self._emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                       delta=delta.arguments)  # fmt: skip

    def _body(self, status: str) -> dict:
        """The response object, as it stands."""
        r = self.request
        usage = self.usage()
        fmt = r.text.format if r.text is not None and r.text.format is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": [_copy(item) for item in self.items] if status != "in_progress" else [],
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "error": None,
            "instructions": r.instructions,
            "tools": [t.model_dump(exclude_none=True) for t in r.tools or ()],
            "tool_choice": r.tool_choice.model_dump() if isinstance(r.tool_choice, BaseModel)
            else (r.tool_choice or "auto"),
            "parallel_tool_calls": r.parallel_tool_calls is not False,
            "temperature": r.temperature,
            "top_p": r.top_p,
            "max_output_tokens": r.max_output_tokens,
            "previous_response_id": None,
            "reasoning": {"effort": r.reasoning.effort if r.reasoning else None, "summary": None},
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "truncation": r.truncation or "disabled",
            "store": False,
            "metadata": r.metadata or {},
            "usage": {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": usage.prompt_tokens_details.cached_tokens},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            }
            if status != "in_progress"
            else None,
            "ddtree": dump_stats(self.stats()),
        }  # fmt: skip


def _copy(item: dict) -> dict:
    return {k: ([dict(p) for p in v] if isinstance(v, list) else v) for k, v in item.items()}


@router.post("/responses", responses=ERRORS | STREAMED)
async def create_response(body: ResponsesRequest, request: Request):
    """Answer ``input`` (a text, or the conversation's items) as the chat endpoint would, in the Responses
    API's shape; ``stream: true`` sends its typed events."""
    start = time.perf_counter()
    check_model(request, body.model)
    state = request.app.state.ddtree
    if body.store and "store" not in state.ignored_fields_logged:
        state.ignored_fields_logged.add("store")
        log.warning("store: true is not supported: responses are not kept (answered false; logged once)")
    plan, parsing = chat_plan(request, chat_request(body))
    answer = ResponsesAnswer(state.config.model_name, parsing, body)
    return await answer_plan(request, plan, answer, bool(body.stream), start)
