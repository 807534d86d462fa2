"""Tools, reasoning and the token endpoints end to end: a real server (uvicorn on loopback, in a thread)
over the built-in pair, driven by the ``openai`` client and ``httpx``.

The built-in models write code-like text, never a tool call of their own: ``tool_choice`` ``"required"`` and
a named function get valid calls only through the grammar, and the ``auto`` parsers are shown a call by a
structured-output ``choice`` that makes the model write one.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from ddtree.cli import main
from ddtree.engine import Engine
from ddtree.server import ServerConfig, create_app
from ddtree.server.reasoning import grammar_start
from tests.server_helpers import ThreadServer

KEY = "test-key"
TEMPLATE = (
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": ZONE}
MESSAGES = [{"role": "user", "content": "Weather in Oslo for 2 days?"}]
CALL_TEXT = (
    '<think>Cold?</think>\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
    '"days": 2}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = Engine.from_pretrained(budget=16)
    engine.tokenizer.chat_template = TEMPLATE
    return engine


@pytest.fixture(scope="module")
def server(engine):
    config = ServerConfig(
        model_name="tiny",
        api_keys=(KEY,),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        structured_outputs_in_reasoning=True,  # so a grammar can make the model write a reasoning
    )
    with ThreadServer(create_app(lambda: engine, config)) as running:
        yield running


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(
        f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    )


def check_arguments(name: str, arguments: str) -> None:
    """The arguments follow the function's schema (``jsonschema`` is not a dependency: these schemas'
    rules by hand)."""
    schema, value = SCHEMAS[name], json.loads(arguments)
    assert isinstance(value, dict) and set(value) == set(schema["required"]), arguments
    for key, rule in schema["properties"].items():
        if "enum" in rule:
            assert value[key] in rule["enum"], arguments
        if rule["type"] == "integer":
            assert isinstance(value[key], int) and rule["minimum"] <= value[key] <= rule["maximum"], arguments


def streamed(client: openai.OpenAI, **request) -> tuple[dict, str | None]:
    """A streamed chat put together: {"content", "reasoning_content", "tool_calls"} and the finish reason."""
    message = {"content": "", "reasoning_content": "", "reasoning": "", "tool_calls": {}}
    finish = None
    for chunk in client.chat.completions.create(model="tiny", stream=True, **request):
        delta = chunk.choices[0].delta
        message["content"] += delta.content or ""
        message["reasoning_content"] += getattr(delta, "reasoning_content", None) or ""
        message["reasoning"] += getattr(delta, "reasoning", None) or ""
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call's first delta
                assert call.index == len(message["tool_calls"]) and call.type == "function"
                message["tool_calls"][call.index] = {
                    "id": call.id,
                    "name": call.function.name,
                    "arguments": "",
                }
            message["tool_calls"][call.index]["arguments"] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    message["tool_calls"] = list(message["tool_calls"].values())
    return message, finish


def calls_of(message) -> list[dict]:
    return [
        {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls
    ]


def test_tools_and_template_kwargs_reach_the_chat_template(server, client):
    body = {"messages": MESSAGES, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    tokens = post(server, "/tokenize", body).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 2048
    prompt = post(server, "/detokenize", {"tokens": tokens["tokens"]}).json()["prompt"]
    assert (
        prompt
        == f"<|tools|>{json.dumps(TOOLS)}\n<|user|>{MESSAGES[0]['content']}\n<|assistant|><think></think>"
    )
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=2,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == tokens["count"]  # the chat rendered the same prompt
    plain = post(server, "/tokenize", {"prompt": "def f(x):"}).json()
    assert post(server, "/detokenize", {"tokens": plain["tokens"]}).json() == {"prompt": "def f(x):"}
    assert httpx.get(f"{server.url}/version", headers={"Authorization": f"Bearer {KEY}"}).json()["version"]


def test_required_tool_choice_makes_a_call_whose_arguments_follow_its_schema(client):
    """One call (``parallel_tool_calls: false``): with parallel calls, this model never stops adding some."""
    request = dict(
        messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=120,
        parallel_tool_calls=False,
    )  # fmt: skip
    chat = client.chat.completions.create(model="tiny", **request)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = calls_of(choice.message)
    assert len(calls) == 1
    for call in calls:
        assert call["id"].startswith("chatcmpl-tool-")
        check_arguments(call["name"], call["arguments"])
    message, finish = streamed(client, **request)
    assert finish == "tool_calls" and message["content"] == ""
    assert [(c["name"], c["arguments"]) for c in message["tool_calls"]] == [
        (c["name"], c["arguments"]) for c in calls
    ]


def test_a_named_tool_choice_calls_that_function_with_valid_arguments(client):
    request = dict(
        messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )  # fmt: skip
    choice = client.chat.completions.create(model="tiny", **request).choices[0]
    assert choice.finish_reason == "tool_calls"
    ((call,),) = [calls_of(choice.message)]
    assert call["name"] == "get_time"
    check_arguments("get_time", call["arguments"])
    message, finish = streamed(client, **request)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in message["tool_calls"]] == [("get_time", call["arguments"])]


def test_auto_tool_choice_reads_the_reasoning_and_the_hermes_call_whole_and_streamed(client):
    request = dict(
        messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=120,
        extra_body={"structured_outputs": {"choice": [CALL_TEXT]}},  # the model writes this text
    )  # fmt: skip
    choice = client.chat.completions.create(model="tiny", **request).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "\nChecking."
    assert choice.message.reasoning_content == choice.message.reasoning == "Cold?"
    calls = calls_of(choice.message)
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", '{"city": "Oslo", "days": 2}')]
    message, finish = streamed(client, **request)
    assert finish == "tool_calls" and message["content"] == "\nChecking."
    assert message["reasoning_content"] == message["reasoning"] == "Cold?"
    assert [(c["name"], c["arguments"]) for c in message["tool_calls"]] == [
        ("get_weather", '{"city": "Oslo", "days": 2}')
    ]
    request["extra_body"]["chat_template_kwargs"] = {"enable_thinking": False}  # no reasoning to read
    off = client.chat.completions.create(model="tiny", **request).choices[0].message
    assert (
        off.content == "<think>Cold?</think>\nChecking." and getattr(off, "reasoning_content", None) is None
    )
    assert len(off.tool_calls) == 1


def test_by_default_a_structured_output_holds_once_the_reasoning_has_ended(engine):
    """vLLM's default: with a reasoning parser, the grammar waits for ``</think>``. This model never writes
    one, so its answer is the free one; with thinking off (the template closes it) the grammar holds."""
    config = ServerConfig(model_name="tiny", api_keys=(KEY,), reasoning_parser="qwen3")
    constrained = {"structured_outputs": {"choice": ["Oslo", "Lima"]}}
    with ThreadServer(create_app(lambda: engine, config)) as running:
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key=KEY, max_retries=0, timeout=120)

        def ask(**extra):
            return (
                client.chat.completions.create(
                    model="tiny", messages=MESSAGES, temperature=0, max_tokens=12, extra_body=extra
                )
                .choices[0]
                .message
            )

        free = ask()
        waiting = ask(**constrained)
        assert waiting.content == free.content and free.content not in ("Oslo", "Lima")
        off = ask(**constrained, chat_template_kwargs={"enable_thinking": False})
        assert off.content in ("Oslo", "Lima")


def test_the_grammar_starts_after_the_tokenizers_end_of_thinking_unless_the_prompt_closed_it(engine):
    end = tuple(engine.tokenizer.encode("</think>", add_special_tokens=False))
    assert grammar_start(engine.tokenizer, "<|user|>hi\n<|assistant|>") == end
    assert grammar_start(engine.tokenizer, "<|assistant|><think>") == end  # the template opened it
    assert grammar_start(engine.tokenizer, "<|assistant|><think></think>") == ()  # thinking off
    assert grammar_start(engine.tokenizer, "<think>a</think><|user|>b<|assistant|><think>") == end


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"tool_choice": "required", "response_format": {"type": "json_object"}},
         "tool_choice"),
        ("/v1/chat/completions", {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name"),
        ("/v1/chat/completions", {"tools": [{"type": "tool", "function": {"name": "f"}}]}, "tools[0].type"),
        ("/detokenize", {"tokens": [1, 1 << 20]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {}, "prompt"),
    ],
)  # fmt: skip
def test_bad_tool_requests_and_token_ids_are_400_in_openai_shape(server, path, body, param):
    if path.startswith("/v1/chat"):
        body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2} | body
    reply = post(server, path, body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_the_token_endpoints_need_the_api_key(server):
    for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version")):
        reply = httpx.request(method, f"{server.url}{path}", json={"prompt": "x", "tokens": [1]}, timeout=10)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--tool-call-parser", "nope"], "unknown --tool-call-parser 'nope'; choose one of hermes, "),
        (["--reasoning-parser", "r2"], "unknown --reasoning-parser 'r2'; choose one of deepseek_r1, "),
        (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    ],
)
def test_a_wrong_parser_flag_is_a_one_line_error(capsys, flags, message):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--port", "0", *flags])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ddtree: error: {message}") and err.count("\n") == 1
