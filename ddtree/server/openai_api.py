"""``/v1/completions``, ``/v1/chat/completions`` and ``/v1/models``: validate, queue, answer.

Cheap checks (types, ranges, model name, unsupported parameters, sampling values) happen here, before a
request takes a queue slot; checks that need the tokenizer (prompt length, chat template) happen on the
engine thread and still come back before any byte of the answer, so a bad request is a 400 even when
it asked to stream.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import APIRouter, Request

from ddtree.errors import DDTreeError
from ddtree.request.params import RequestOptions, SamplingParams, StructuredOutputs, lossy_threshold_fields
from ddtree.server.body import LargeBodyRoute
from ddtree.server.chat import message_dicts
from ddtree.server.errors import APIError, invalid, unsupported
from ddtree.server.events import EventStreamResponse, event_stream, job_items, job_pieces
from ddtree.server.generation import Generation, Plan, Started
from ddtree.server.limits import check_plan
from ddtree.server.protocol import (
    IGNORED_FIELDS,
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
    GenerationRequest,
    ModelCard,
    ModelList,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsRequest,
)
from ddtree.server.responses import ChatAnswer, CompletionAnswer, MessageParsing
from ddtree.server.tool_parsers import named_schema, required_schema
from ddtree.server.worker import Job, QueueFull, ShuttingDown

if TYPE_CHECKING:
    from ddtree.server.config import ServerConfig

ERRORS = {code: {"model": ErrorResponse} for code in (400, 404, 429, 503, 504)}
# ``stream: true``: one server-sent event per chunk (its ``data`` a chunk object as JSON), then ``[DONE]``
EVENT = {"type": "object", "properties": {"data": {"type": "string"}}, "required": ["data"]}
STREAMED = {200: {"content": {"text/event-stream": {"schema": EVENT}}}}

router = APIRouter(prefix="/v1", tags=["openai"], route_class=LargeBodyRoute)
log = logging.getLogger("ddtree.server")


@router.get("/models", response_model=ModelList)
def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(request)])


@router.get("/models/{model_id:path}", response_model=ModelCard, responses=ERRORS)
def get_model(model_id: str, request: Request) -> ModelCard:
    check_model(request, model_id)
    return _card(request)


@router.post("/completions", response_model=Completion, responses=ERRORS | STREAMED)
async def create_completion(body: CompletionRequest, request: Request):
    """Continue a prompt (text or token ids; a batch gives ``len(prompt) * n`` choices)."""
    start = time.perf_counter()
    check_model(request, body.model)
    _note_ignored(request, body)
    if body.echo:
        raise unsupported("echo")
    if body.suffix is not None:
        raise unsupported("suffix")
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise unsupported("best_of")
    plan = Plan(
        params=_sampling_params(body, body.logprobs),
        max_tokens=body.max_tokens,
        n=n,
        prompts=_prompts(body.prompt),
        options=_options(body),
        skip_special_tokens=body.skip_special_tokens is not False,
    )
    answer = CompletionAnswer(_name(request), _include_usage(body), body.logprobs is not None, n)
    return await _answer(request, plan, answer, bool(body.stream), start)


@router.post("/chat/completions", response_model=ChatCompletion, responses=ERRORS | STREAMED)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    """Answer a conversation, rendered by the tokenizer's chat template or the plain fallback."""
    start = time.perf_counter()
    check_model(request, body.model)
    _note_ignored(request, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()]
    config = request.app.state.ddtree.config
    parsing, tool_grammar = _message_parsing(config, body, tools)
    params = _sampling_params(body, logprobs, body.response_format)
    if tool_grammar is not None:
        if params.structured_outputs is not None:
            raise invalid(
                "tool_choice required or a named function constrains the answer already; drop "
                "response_format and structured_outputs",
                "tool_choice",
            )
        params = replace(params, structured_outputs=tool_grammar)
    # vLLM's default: a tool parser reads the special tokens too (kimi_k2's markers are)
    skip_special = not (parsing is not None and parsing.tool_parser is not None)
    plan = Plan(
        params=params,
        max_tokens=body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens,
        n=body.n or 1,
        messages=message_dicts(body.messages),
        options=_options(body),
        tools=tools or None,
        template_kwargs=body.chat_template_kwargs,
        skip_special_tokens=skip_special if body.skip_special_tokens is None else body.skip_special_tokens,
        grammar_after_reasoning=parsing is not None
        and parsing.reasoning is not None
        and not config.structured_outputs_in_reasoning,
    )
    answer = ChatAnswer(_name(request), _include_usage(body), bool(body.logprobs), plan.n, parsing=parsing)
    return await _answer(request, plan, answer, bool(body.stream), start)


async def _answer(
    request: Request, plan: Plan, answer: CompletionAnswer | ChatAnswer, stream: bool, start: float
):
    """Queue the plan, wait for the engine's verdict on it, then answer whole or as a stream."""
    state = request.app.state.ddtree
    model = state.model()  # 503 while loading
    engine = model.engine
    answer.thresholds = lossy_threshold_fields(
        engine.config.accept_threshold_single, engine.config.accept_threshold_acc
    )
    metrics, config = state.metrics, state.config
    check_plan(plan, model.max_positions, state.token_chars, config.limits)
    if plan.params.structured_outputs is not None:  # compiled here (cached), never on the engine thread
        from ddtree.request.grammar import (
            CompilesFull,  # xgrammar: loaded by the engine for this request anyway
        )

        try:
            await asyncio.to_thread(engine.check_structured_outputs, plan.params.structured_outputs)
        except CompilesFull as exc:
            headers = {"Retry-After": str(config.retry_after)}
            raise APIError(
                429, str(exc), "rate_limit_error", None, "grammar_compiles_full", headers
            ) from None
    # Chat template and tokenizer run here, in the event loop's thread pool: never on the engine thread.
    rows_id = uuid.uuid4().hex  # its engine rows are "<rows_id>-<choice>"
    generation = await asyncio.to_thread(Generation, model, plan, metrics, rows_id)
    job = Job(generation.engine_rows(), generation.prompt_tokens, asyncio.get_running_loop(), plan.options)
    try:
        state.worker.submit(job)
    except QueueFull:
        raise APIError(
            429,
            f"the server is busy ({state.worker.capacity} requests are running or waiting); retry shortly",
            "rate_limit_error",
            None,
            "queue_full",
            {"Retry-After": str(config.retry_after)},
        ) from None
    except ShuttingDown:
        raise APIError(
            503, "the server is shutting down", "service_unavailable", None, "shutting_down"
        ) from None
    items = job_items(
        job, request, state.worker, metrics, start + config.request_timeout, config.request_timeout
    )
    first_token = _once(lambda: metrics.first_token.observe(time.perf_counter() - start))
    try:
        started = await anext(items)
    except BaseException:
        generation.close()
        await items.aclose()
        raise
    assert isinstance(started, Started)
    answer.start(started)
    pieces = job_pieces(items, generation, state.worker, job)
    if stream:
        return EventStreamResponse(event_stream(pieces, answer, first_token))
    try:
        async for piece in pieces:
            if piece.num_tokens:
                first_token()
            answer.add(piece)
    finally:
        await pieces.aclose()
    return answer.response()


def _sampling_params(
    body: GenerationRequest, logprobs: int | None, response_format: ResponseFormat | None = None
) -> SamplingParams:
    """OpenAI's defaults (temperature 1, top_p 1); raises DDTreeError (a 400) on a bad combination."""
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    temperature = 1.0 if body.temperature is None else body.temperature
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    return SamplingParams(
        temperature=temperature,
        top_k=max(body.top_k or 0, 0),
        top_p=1.0 if body.top_p is None else body.top_p,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        max_new_tokens=max(1, body.min_tokens or 0),  # set for real once the prompt's length is known
        stop=tuple(stop),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        structured_outputs=_structured_outputs(body.structured_outputs, response_format),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        logit_bias=_logit_bias(body.logit_bias),
        min_tokens=body.min_tokens or 0,
        bad_words=tuple(body.bad_words or ()),
    )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    """OpenAI's string keys as token ids (the engine checks them against the vocabulary)."""
    out = {}
    for key, value in (bias or {}).items():
        if not key.strip().isdigit():
            raise invalid(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        out[int(key)] = value
    return out


def _structured_outputs(
    request: StructuredOutputsRequest | None, response_format: ResponseFormat | None
) -> StructuredOutputs | None:
    """The constraint asked for by vLLM's ``structured_outputs`` or OpenAI's ``response_format`` (not
    both); its grammar is compiled before the request is queued (``_answer``)."""
    fmt = None if response_format is None or response_format.type == "text" else response_format
    if request is not None and fmt is not None:
        raise invalid("give structured_outputs or response_format, not both", "response_format")
    if fmt is not None and fmt.type == "json_object":
        return StructuredOutputs(json_object=True)
    if fmt is not None:
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise invalid("response_format json_schema needs json_schema.schema", "response_format")
        return StructuredOutputs.of_schema(fmt.json_schema.schema_)
    if request is None:
        return None
    try:
        return StructuredOutputs(
            json=None if request.json_ is None else StructuredOutputs.of_schema(request.json_).json,
            regex=request.regex,
            choice=None if request.choice is None else tuple(request.choice),
            grammar=request.grammar,
            json_object=bool(request.json_object),
            disable_any_whitespace=bool(request.disable_any_whitespace),
        )
    except DDTreeError as exc:
        raise invalid(str(exc), "structured_outputs") from None


def _message_parsing(
    config: ServerConfig, body: ChatCompletionRequest, tools: list[dict]
) -> tuple[MessageParsing | None, StructuredOutputs | None]:
    """How the answers are read (None: the text is the content) and the grammar that ``tool_choice``
    ``"required"`` or a named function puts on them, as vLLM does; its 400s come before queueing."""
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice != "none" and not tools:
        raise invalid("tool_choice needs tools", "tool_choice")
    forced = grammar = None
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t["function"]["name"] == choice.function.name), None)
        if tool is None:
            raise invalid(f"tool_choice names {choice.function.name!r}, which is not in tools", "tool_choice")
        forced, grammar = choice.function.name, _compact(named_schema(tool))
    elif choice == "required":
        schema = required_schema(tools, parallel=body.parallel_tool_calls is not False)
        forced, grammar = "required", _compact(schema)
    elif choice == "auto" and not (config.enable_auto_tool_choice and config.tool_call_parser):
        raise invalid(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            "tool_choice",
        )
    kwargs = body.chat_template_kwargs or {}
    thinking = kwargs.get("enable_thinking") is not False and kwargs.get("thinking") is not False
    # a grammar holds the answer from its first token: there is no reasoning to read
    reasoning = config.reasoning_parser if thinking and forced is None else None
    tool_parser = config.tool_call_parser if choice == "auto" else None
    if reasoning is None and tool_parser is None and forced is None:
        return None, None
    return MessageParsing(reasoning, tool_parser, tuple(tools), forced), grammar


def _compact(schema: dict) -> StructuredOutputs:
    """A tool call's grammar: JSON with json.dumps' whitespace only, so a model cannot spend its tokens on
    whitespace between the call's fields (vLLM's disable_any_whitespace)."""
    return StructuredOutputs.of_schema(schema, disable_any_whitespace=True)


def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """One prompt or a batch, as a list of prompts; none may be empty."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) or not prompt:
        prompts = [prompt]
    else:
        prompts = list(prompt)
    if any(len(p) == 0 for p in prompts):
        raise invalid("prompt is empty", "prompt")
    return prompts


def _options(body: GenerationRequest) -> RequestOptions:
    """The request's ``speculative`` (false: plain decoding; true or unset: the server's defaults) and
    ``cache_salt``, as the engine takes them."""
    option, salt = body.speculative, body.cache_salt
    if option is False:
        return RequestOptions(method="ar", cache_salt=salt)
    if option is None or option is True:
        return RequestOptions(cache_salt=salt)
    return RequestOptions(option.method, option.budget, option.topk, salt)


def _note_ignored(request: Request, body: GenerationRequest) -> None:
    """Log, once per field name and server, a field this request set that the server ignores."""
    logged = request.app.state.ddtree.ignored_fields_logged
    for name in IGNORED_FIELDS:
        if getattr(body, name) is not None and name not in logged:
            logged.add(name)
            log.warning("ignoring the request field %r: it does not change the output (logged once)", name)


def _include_usage(body: GenerationRequest) -> bool:
    return bool(body.stream and body.stream_options and body.stream_options.include_usage)


def _name(request: Request) -> str:
    return request.app.state.ddtree.config.model_name


def check_model(request: Request, model: str | None) -> None:
    name = _name(request)
    if model is not None and model != name:
        message = f"the model {model!r} does not exist; this server serves {name!r}"
        raise APIError(404, message, param="model", code="model_not_found")


def _card(request: Request) -> ModelCard:
    state = request.app.state.ddtree
    model = state.worker.engine
    return ModelCard(
        id=state.config.model_name,
        created=int(state.started_at),
        max_model_len=model.max_positions if model is not None else None,
    )


def _once(action):
    done = False

    def run() -> None:
        nonlocal done
        if not done:
            done = True
            action()

    return run
