"""The OpenAI wire format the server speaks: request and response bodies as pydantic models.

Requests are strict (no type coercion, unknown fields refused) so a client's typo is a 400 that names
the field, never a silently ignored setting. As in vLLM, fields that cannot change the output (``store``,
``metadata``, ``user``, ...: ``IGNORED_FIELDS``) are accepted and ignored, and fields that would change it
in a way this server does not implement (``suffix``, ``best_of`` != n) are refused. Extensions
beyond OpenAI's API are marked as such: ``top_k``, ``min_p``, ``ignore_eos``, ``speculative`` and vLLM's
(``repetition_penalty``, ``min_tokens``, ``bad_words``, ``structured_outputs``, ...) in requests,
``ddtree`` in responses.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_serializer,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from ddtree.errors import DDTreeError
from ddtree.request.params import (
    FREQUENCY_PENALTY,
    LOGIT_BIAS,
    LOGPROBS,
    MAX_BUDGET,
    METHODS,
    MIN_P,
    PRESENCE_PENALTY,
    PROMPT_LOGPROBS,
    REPETITION_PENALTY,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    Bound,
    check_budget,
    lone_surrogate,
)
from ddtree.startup import Phase

MAX_N = 16  # choices per request; each is a whole generation on the one engine
MAX_PROMPTS = 16  # prompts in one batched completions request
MAX_STOP = 16
MAX_MESSAGES = 2048  # as OpenAI; checked while parsing, before a model is built per message
MAX_TOOLS = 128  # as OpenAI
MAX_LOGIT_BIAS = 1024  # tokens a request may bias
MAX_BAD_WORDS = 128
MAX_DRAFT_TOPK = 1 << 20
BOUND_ERROR = "bound"  # the pydantic error type of a value a ddtree.request.params rule refused

FinishReason = Literal["stop", "length", "tool_calls"]
Method = Literal[METHODS]
NonEmptyStr = Annotated[str, Field(min_length=1)]
_T = TypeVar("_T")
Batch = Annotated[list[_T], Field(max_length=MAX_PROMPTS)]


def _rule(check, **schema: Any) -> tuple:
    """Metadata that validates a value with ``check`` (a ``ddtree.request.params`` rule: its message is
    the 400's) and writes ``schema`` (its bounds) into the OpenAPI document."""

    def validate(value: _T) -> _T:
        try:
            check(value)
        except DDTreeError as exc:
            raise PydanticCustomError(BOUND_ERROR, "{message}", {"message": str(exc)}) from None
        return value

    return AfterValidator(validate), Field(json_schema_extra=schema)


def _bounded(kind: type, bound: Bound) -> Any:
    """``kind`` within ``bound``: the same values and the same message as ``SamplingParams``."""
    return Annotated[kind, *_rule(bound.check, **bound.schema())]


Budget = Annotated[int, *_rule(check_budget, minimum=1, maximum=MAX_BUDGET)]
# The API's own spellings of two bounds: top_k -1 is off too (vLLM's); a seed stays below 2**63, so that
# seed + choice index stays in SamplingParams' range.
API_TOP_K = dataclasses.replace(TOP_K, lo=-1, note=" (-1 and 0 disable it)")
API_SEED = dataclasses.replace(SEED, hi=1 << 63, text="[-2**63, 2**63)")


def _token_id_keys(bias: dict[str, float]) -> dict[str, float]:
    """OpenAI's ``logit_bias`` keys: token ids written in ASCII digits (``str.isdigit`` would also take "²",
    which ``int`` refuses, and "١", which it reads as 1). The vocabulary is checked with the model."""
    for key in bias:
        if not re.fullmatch(r"[0-9]+", key):
            raise PydanticCustomError(
                "token_id", "keys must be token ids in ASCII digits, got {key}", {"key": repr(key)}
            )
    return bias


LogitBias = Annotated[
    dict[str, _bounded(float, LOGIT_BIAS)], Field(max_length=MAX_LOGIT_BIAS), AfterValidator(_token_id_keys)
]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Body(_Strict):
    """A request body. Every string in it, down to free-form objects (schemas, template variables), must be
    Unicode text: a lone surrogate (JSON's ``"\\ud800"``) would fail the tokenizer, a chat template or the
    answer's encoding as a 500; it is a 400 naming the field instead."""

    @model_validator(mode="after")
    def _text_only(self) -> _Body:
        found = _lone_surrogate_in(self)
        if found is not None:
            loc, text, at = found
            error = PydanticCustomError(
                "invalid_text",
                "Input should be valid Unicode text, without lone surrogates (one at character {at})",
                {"at": at},
            )
            raise ValidationError.from_exception_data(
                type(self).__name__, [InitErrorDetails(type=error, loc=loc, input=text)]
            )
        return self


def _lone_surrogate_in(body: BaseModel) -> tuple[tuple[str | int, ...], str, int] | None:
    """A string of ``body`` that is not Unicode text, if any: its location (as pydantic's error ``loc``), the
    string and where its lone surrogate is; None when there is none. Iterative: objects may nest deep."""
    stack: list[tuple[tuple[str | int, ...], object]] = [((), body)]
    while stack:
        loc, value = stack.pop()
        if isinstance(value, str):
            at = lone_surrogate(value)
            if at is not None:
                return loc, value, at
        elif isinstance(value, BaseModel):
            fields = type(value).model_fields
            stack += [(loc + (field.alias or name,), getattr(value, name)) for name, field in fields.items()]
        elif isinstance(value, dict):
            for key, item in value.items():
                stack += [(loc + (key,), key), (loc + (key,), item)]
        elif isinstance(value, list):  # token ids (up to millions) hold no text: no location made for them
            stack += [(loc + (i,), v) for i, v in enumerate(value) if not isinstance(v, (int, float))]
    return None


# -- requests -----------------------------------------------------------------------------------------


class SpeculativeOptions(_Strict):
    """Extension: how this request is decoded; unset fields keep the server's defaults."""

    method: Method | None = Field(None, description="ddtree (tree), dflash (linear chain) or ar (none)")
    budget: Budget | Literal["auto"] | None = Field(
        None, description="draft tree nodes per round, or 'auto' (chosen per round)"
    )
    topk: int | None = Field(None, ge=1, le=MAX_DRAFT_TOPK, description="cap on candidates per tree depth")


class StreamOptions(_Strict):
    include_usage: bool | None = Field(None, description="send a last chunk with the usage (choices: [])")


class StructuredOutputsRequest(_Strict):
    """vLLM's ``structured_outputs`` request field (its names; one constraint)."""

    json_: dict | str | None = Field(None, alias="json", description="a JSON schema (object or text)")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = Field(None, description="json: only json.dumps' whitespace")


class GenerationRequest(_Body):
    """Fields completions and chat share. ``None`` always means "the default"."""

    model: str | None = Field(None, description="must name the served model; omitted = the served one")
    max_tokens: int | None = Field(None, ge=1)
    temperature: _bounded(float, TEMPERATURE) | None = Field(
        None, description="0 (or below 1e-5) = greedy decoding"
    )
    top_p: _bounded(float, TOP_P) | None = None
    top_k: _bounded(int, API_TOP_K) | None = Field(
        None, description="extension; 0 or -1 = off, above the vocabulary = off"
    )
    min_p: _bounded(float, MIN_P) | None = Field(None, description="extension; 0 = off")
    n: int | None = Field(None, ge=1, le=MAX_N, description="independent choices; seeded ones use seed + i")
    seed: _bounded(int, API_SEED) | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=MAX_STOP)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = Field(None, description="extension: keep going past end-of-sequence")
    speculative: bool | SpeculativeOptions | None = Field(
        None, description="extension: false = plain decoding (method ar); an object picks method/budget/topk"
    )
    frequency_penalty: _bounded(float, FREQUENCY_PENALTY) | None = None
    presence_penalty: _bounded(float, PRESENCE_PENALTY) | None = None
    logit_bias: LogitBias | None = Field(
        None, description="token id (as a string) -> logit added, in [-100, 100]"
    )
    repetition_penalty: _bounded(float, REPETITION_PENALTY) | None = Field(
        None, description="vLLM's extension: > 1 discourages seen tokens"
    )
    min_tokens: int | None = Field(
        None, ge=0, description="vLLM's extension: no EOS, stop token or stop string before this many tokens"
    )
    bad_words: Annotated[list[NonEmptyStr], Field(max_length=MAX_BAD_WORDS)] | None = Field(
        None, description="vLLM's extension: words never completed"
    )
    cache_salt: NonEmptyStr | None = Field(
        None, description="vLLM's extension: requests with different salts share no prefix-cache block"
    )
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="vLLM's extension: exactly one of json, regex, choice, grammar, json_object"
    )
    skip_special_tokens: bool | None = Field(
        None,
        description="vLLM's extension: leave special tokens out of the text (default true; false when a tool "
        "parser reads the answer, whose markers may be special tokens)",
    )
    # Accepted and ignored (the server logs each name once): none of them changes the output.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    prediction: dict | None = Field(None, description="predicted outputs: the output is the same without")


IGNORED_FIELDS = ("user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier",
                  "prediction")  # fmt: skip


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: text (or token-id) prompts, one or a batch."""

    prompt: str | list[int] | Batch[str] | Batch[list[int]] = Field(
        description="text, token ids, or a batch of either (up to 16 prompts)"
    )
    logprobs: _bounded(int, LOGPROBS) | None = Field(None, description="top-N alternatives per token")
    echo: bool | None = Field(
        None,
        description="the prompt comes back before each answer; with logprobs, its tokens' logprobs too "
        "(the first token has none): lm-eval's loglikelihood",
    )
    prompt_logprobs: _bounded(int, PROMPT_LOGPROBS) | None = Field(
        None,
        description="vLLM's extension: each prompt token's logprob plus the top N, in choices[i]"
        ".prompt_logprobs (the first token's is null)",
    )
    suffix: str | None = Field(None, description="not supported")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="only equal to n is supported")


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """A message of the conversation. ``tool`` messages (results of calls the client made) and assistant
    ``tool_calls`` from earlier turns go to the chat template as they are. An assistant message sent back
    as a server returned it keeps its other fields: the reasoning (``reasoning_content``, or vLLM's newer
    ``reasoning``) goes to a chat template that reads it (Kimi's, GLM's, Qwen3's); ``refusal``, ``audio``,
    ``annotations`` and ``function_call`` are accepted and ignored."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        None, description="null (or omitted) only for assistant tool_calls"
    )
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None
    reasoning_content: str | None = Field(None, description="an earlier answer's reasoning, for the template")
    reasoning: str | None = Field(None, description="the same as reasoning_content (vLLM's newer name)")
    refusal: str | None = Field(None, description="accepted and ignored")
    audio: dict | None = Field(None, description="accepted and ignored")
    annotations: list | None = Field(None, description="accepted and ignored")
    function_call: dict | None = Field(None, description="accepted and ignored (the legacy tool_calls)")


class JsonSchemaFormat(_Strict):
    """OpenAI's ``response_format.json_schema``: the schema the answer must follow (always enforced, as
    with ``strict: true``)."""

    name: str = Field(max_length=64)
    schema_: dict | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's ``response_format``: ``text``, ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.:-]+$")
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments")
    strict: bool | None = None


class ChatTool(_Strict):
    """A function the model may call: it goes to the chat template, and the server reads calls back."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ThinkingOption(_Strict):
    """DeepSeek's, Kimi's and GLM's ``thinking: {"type": "enabled" | "disabled"}``."""

    type: Literal["enabled", "disabled", "auto"]
    budget_tokens: int | None = Field(None, ge=0, description="accepted and ignored")


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``: messages rendered by the tokenizer's chat template (or the fallback)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, description="preferred over max_tokens")
    logprobs: bool | None = None
    top_logprobs: _bounded(int, dataclasses.replace(LOGPROBS, name="top_logprobs")) | None = Field(
        None, description="needs logprobs: true"
    )
    response_format: ResponseFormat | None = None
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(
        None,
        description="none, auto (default with tools; needs --enable-auto-tool-choice), required or a named "
        "function (both enforced by a grammar)",
    )
    parallel_tool_calls: bool | None = Field(None, description="false: required makes one call only")
    chat_template_kwargs: dict | None = Field(
        None, description="vLLM's extension: extra variables for the chat template (enable_thinking, ...)"
    )
    reasoning_effort: ReasoningEffort | None = Field(
        None,
        description="goes to the chat template as reasoning_effort; none also switches thinking off "
        "(enable_thinking and thinking false)",
    )
    thinking: bool | ThinkingOption | None = Field(
        None, description="extension: false or {type: disabled} switches thinking off in the chat template"
    )
    include_reasoning: bool | None = Field(
        None, description="vLLM's extension: false leaves the parsed reasoning out of the answer"
    )
    functions: list[FunctionDefinition] | None = Field(
        None, max_length=MAX_TOOLS, description="OpenAI's deprecated form of tools"
    )
    function_call: Literal["none", "auto"] | FunctionName | None = Field(
        None, description="OpenAI's deprecated form of tool_choice"
    )


# -- responses ----------------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens read from the prefix cache instead of prefilled


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class SpeculativeStats(BaseModel):
    """Extension: what speculation bought. ``tau`` is the mean of ``acceptance_lengths`` (one per round).

    The acceptance thresholds appear only when the server runs lossy ones (below 1.0).
    """

    method: str
    budget: int | str
    tau: float
    rounds: int
    acceptance_lengths: list[int]
    drafted_nodes: list[int] = Field(default_factory=list)  # drafted nodes verified per round
    auto: dict | None = None  # budget "auto": drafting on or off, why, and the measured costs
    accept_threshold_single: float | None = None
    accept_threshold_acc: float | None = None

    @model_serializer(mode="wrap")
    def _omit_lossless_thresholds(self, handler) -> dict:
        out = handler(self)
        if self.accept_threshold_single is None:
            out.pop("accept_threshold_single", None)
            out.pop("accept_threshold_acc", None)
        if self.auto is None:
            out.pop("auto", None)
        return out


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy layout; with ``echo`` the prompt's tokens come first, the very first with nulls."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs``: one token's logprob, its rank when known, its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    # vLLM's: per prompt token (the first is null), the token's entry and the top N, by token id
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    ddtree: SpeculativeStats | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    """The reasoning appears with a reasoning parser (as ``reasoning_content`` and as ``reasoning``, vLLM's
    newer name, both sent as vLLM sends them), ``tool_calls`` when the answer made calls."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler) -> dict:
        out = handler(self)
        if self.reasoning_content is None:
            out.pop("reasoning_content", None)
            out.pop("reasoning", None)
        if not self.tool_calls:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    ddtree: SpeculativeStats | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A call's first delta has its id, type and name; the next ones add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # the same text: vLLM's newer name
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    ddtree: SpeculativeStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ddtree"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Identity(BaseModel):
    """Who answered: a deployer tells an old process from its replacement by pid, instance_id, started_at."""

    state: Literal["loading", "warming", "ready", "failed", "dead"]
    pid: int
    instance_id: str
    started_at: str = Field(description="ISO 8601, UTC")
    uptime_seconds: float
    phase: Phase | None = Field(
        None, description="while loading or warming: the start-up phase running (none once ready)"
    )


class Health(Identity):
    """``GET /health`` (and ``GET /ready`` once ready)."""

    status: str = Field(description="liveness: always ok")


class NotReady(ErrorResponse, Identity):
    """``GET /ready`` while loading or warming up: an OpenAI error plus the identity fields (no ``status``:
    only the error says how the server is)."""


class TokenizeRequest(_Body):
    """``POST /tokenize`` (vLLM's): a ``prompt``, or ``messages`` rendered as chat renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = Field(None, description="default: true for prompt, false for messages")
    tools: list[ChatTool] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class Version(BaseModel):
    version: str
