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
    FunctionName,
    GenerationRequest,
    ModelCard,
    ModelList,
    NamedToolChoice,
    ResponseFormat,
    StructuredOutputsRequest,
    ThinkingOption,
    ToolChoice,
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
    if body.suffix is not None:
        raise unsupported("suffix")
    n = body.n or 1
    if body.best_of is not None and body.best_of != n:
        raise unsupported("best_of")
    params = _sampling_params(request, body, body.logprobs)
    # scored in the prefill: echo's logprobs and vLLM's prompt_logprobs, the larger top-N of the two
    scores = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs) if n is not None]
    plan = Plan(
        params=replace(params, prompt_logprobs=max(scores)) if scores else params,
        max_tokens=body.max_tokens,
        n=n,
        prompts=_prompts(body.prompt),
        options=_options(body),
        skip_special_tokens=body.skip_special_tokens is not False,
        echo=bool(body.echo),
        prompt_logprobs=body.prompt_logprobs,
    )
    answer = CompletionAnswer(_name(request), _include_usage(body), body.logprobs is not None, n)
    return await answer_plan(request, plan, answer, bool(body.stream), start)


@router.post("/chat/completions", response_model=ChatCompletion, responses=ERRORS | STREAMED)
async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    """Answer a conversation, rendered by the tokenizer's chat template or the plain fallback."""
    start = time.perf_counter()
    check_model(request, body.model)
    _note_ignored(request, body)
    plan, parsing = chat_plan(request, body)
    answer = ChatAnswer(_name(request), _include_usage(body), bool(body.logprobs), plan.n, parsing=parsing)
    return await answer_plan(request, plan, answer, bool(body.stream), start)


def chat_plan(request: Request, body: ChatCompletionRequest) -> tuple[Plan, MessageParsing | None]:
    """A chat request as the engine's plan and how its answers are read (the Responses API's too)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    tools, choice = _tools(body)
    config = request.app.state.ddtree.config
    template_kwargs = _template_kwargs(body)
    parsing, tool_grammar = _message_parsing(config, body, tools, choice, template_kwargs)
    params = _sampling_params(request, body, logprobs, body.response_format)
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
        template_kwargs=template_kwargs,
        skip_special_tokens=skip_special if body.skip_special_tokens is None else body.skip_special_tokens,
        grammar_after_reasoning=parsing is not None
        and parsing.reasoning is not None
        and not config.structured_outputs_in_reasoning,
    )
    return plan, parsing


async def answer_plan(
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
    request: Request,
    body: GenerationRequest,
    logprobs: int | None,
    response_format: ResponseFormat | None = None,
) -> SamplingParams:
    """The request's sampling; what it leaves out is the model's default (``--generation-config``) or
    OpenAI's (temperature 1, top_p 1); no seed is one drawn from ``--seed`` when given. Raises DDTreeError
    (a 400) on a bad combination."""
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed when stream is true", "stream_options")
    state = request.app.state.ddtree
    defaults = state.config.sampling_defaults

    def value(name: str, openai_default: float) -> float:
        given = getattr(body, name)
        return given if given is not None else defaults.get(name, openai_default)

    seed = body.seed
    if seed is None and state.seeds is not None:
        seed = state.seeds.randrange(1 << 62)
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    compact = state.config.disable_any_whitespace
    return SamplingParams(
        temperature=value("temperature", 1.0),
        top_k=max(int(value("top_k", 0)), 0),
        top_p=value("top_p", 1.0),
        min_p=value("min_p", 0.0),
        seed=seed,
        max_new_tokens=max(1, body.min_tokens or 0),  # set for real once the prompt's length is known
        stop=tuple(stop),
        ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs,
        structured_outputs=_structured_outputs(body.structured_outputs, response_format, compact),
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=value("repetition_penalty", 1.0),
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


JSON_OBJECT = {"type": "object"}  # json_object: OpenAI's "a JSON object", never an array or a number


def _structured_outputs(
    request: StructuredOutputsRequest | None, response_format: ResponseFormat | None, compact: bool = True
) -> StructuredOutputs | None:
    """The constraint asked for by vLLM's ``structured_outputs`` or OpenAI's ``response_format`` (not
    both); its grammar is compiled before the request is queued (``answer_plan``). JSON allows only
    json.dumps' whitespace when ``compact`` (``--disable-any-whitespace``), unless the request says
    otherwise."""
    fmt = None if response_format is None or response_format.type == "text" else response_format
    if request is not None and fmt is not None:
        raise invalid("give structured_outputs or response_format, not both", "response_format")
    if fmt is not None and fmt.type == "json_object":
        return StructuredOutputs.of_schema(JSON_OBJECT, disable_any_whitespace=compact)
    if fmt is not None:
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise invalid("response_format json_schema needs json_schema.schema", "response_format")
        return StructuredOutputs.of_schema(fmt.json_schema.schema_, disable_any_whitespace=compact)
    if request is None:
        return None
    if request.disable_any_whitespace is not None:
        compact = request.disable_any_whitespace
    schema = JSON_OBJECT if request.json_object and request.json_ is None else request.json_
    try:
        return StructuredOutputs(
            json=None if schema is None else StructuredOutputs.of_schema(schema).json,
            regex=request.regex,
            choice=None if request.choice is None else tuple(request.choice),
            grammar=request.grammar,
            json_object=bool(request.json_object) and request.json_ is not None,  # both: refused, one line
            disable_any_whitespace=compact and (schema is not None),
        )
    except DDTreeError as exc:
        raise invalid(str(exc), "structured_outputs") from None


def _tools(body: ChatCompletionRequest) -> tuple[list[dict], ToolChoice | None]:
    """The request's tools and tool_choice, or OpenAI's deprecated ``functions`` and ``function_call`` as
    them (the answer's calls come back as ``tool_calls``)."""
    if body.functions is None and body.function_call is None:
        return [tool.model_dump(exclude_none=True) for tool in body.tools or ()], body.tool_choice
    if body.tools is not None or body.tool_choice is not None:
        message = "give tools and tool_choice, or the deprecated functions and function_call"
        raise invalid(message, "functions")
    tools = [{"type": "function", "function": f.model_dump(exclude_none=True)} for f in body.functions or ()]
    choice = body.function_call
    if isinstance(choice, FunctionName):
        choice = NamedToolChoice(type="function", function=choice)
    return tools, choice


def _template_kwargs(body: ChatCompletionRequest) -> dict | None:
    """``chat_template_kwargs`` with ``reasoning_effort`` and ``thinking`` added as templates read them:
    ``reasoning_effort`` as it is (gpt-oss' templates), thinking off (effort ``none``, ``thinking`` false or
    disabled) or on as ``enable_thinking`` (Qwen3's, GLM's) and ``thinking`` (DeepSeek's, Kimi's). What the
    request's own ``chat_template_kwargs`` set wins."""
    kwargs = dict(body.chat_template_kwargs or {})
    mode = body.thinking.type if isinstance(body.thinking, ThinkingOption) else body.thinking
    if body.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", body.reasoning_effort)
        if body.reasoning_effort == "none" and mode is None:
            mode = False
    if mode in (False, "disabled", True, "enabled"):
        on = mode in (True, "enabled")
        kwargs.setdefault("enable_thinking", on)
        kwargs.setdefault("thinking", on)
    return kwargs if kwargs or body.chat_template_kwargs is not None else None


def _message_parsing(
    config: ServerConfig,
    body: ChatCompletionRequest,
    tools: list[dict],
    choice: ToolChoice | None = None,
    template_kwargs: dict | None = None,
) -> tuple[MessageParsing | None, StructuredOutputs | None]:
    """How the answers are read (None: the text is the content) and the grammar that ``tool_choice``
    ``"required"`` or a named function puts on them, as vLLM does; its 400s come before queueing."""
    choice = choice if choice is not None else ("auto" if tools else "none")
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
    kwargs = template_kwargs or {}
    thinking = kwargs.get("enable_thinking") is not False and kwargs.get("thinking") is not False
    # a grammar holds the answer from its first token: there is no reasoning to read
    reasoning = config.reasoning_parser if thinking and forced is None else None
    tool_parser = config.tool_call_parser if choice == "auto" else None
    if reasoning is None and tool_parser is None and forced is None:
        return None, None
    # a call's id in the tool parser's format whatever the tool_choice (kimi_k2's counts earlier calls)
    earlier = sum(len(m.tool_calls or ()) for m in body.messages)
    return MessageParsing(
        reasoning,
        tool_parser,
        tuple(tools),
        forced,
        id_format=config.tool_call_parser,
        first_call=earlier,
        include_reasoning=body.include_reasoning is not False,
    ), grammar


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
