"""What agent frameworks and eval harnesses send, end to end over a real server (uvicorn on loopback, in a
thread) with the ``openai`` client: a multi-turn loop that sends the returned message back, tool calls cut
by the length limit, ids in the parser's format, vLLM's serve flags and request fields, JSON modes, and
lm-eval's prompt scoring (``echo`` + ``logprobs``), which must equal HF's own forward (the oracle).

The built-in models write code-like text; a structured-output ``choice`` makes them write a reasoning and
a call where a test needs one.
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
import torch

from ddtree.cli import main
from ddtree.engine import Engine
from ddtree.server import ServerConfig, create_app
from tests.server_helpers import ThreadServer

# reads the reasoning of earlier answers (as Kimi's, GLM's and Qwen3's templates do)
TEMPLATE = (
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m['content'] if m['content'] is string else '' }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.id }}>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}"
)
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}, "days": {"type": "integer"}},
    "required": ["zone", "days"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]
ASK = [{"role": "user", "content": "What time is it in Paris?"}]
REASONED = "<think>Paris is CET.</think>It is noon."


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = Engine.from_pretrained(dtype=torch.float32, budget=16)
    engine.tokenizer.chat_template = TEMPLATE
    return engine


def served(engine: Engine, **config):
    return ThreadServer(create_app(lambda: engine, ServerConfig(model_name="tiny", **config)))


@pytest.fixture(scope="module")
def server(engine):
    with served(engine, reasoning_parser="qwen3", structured_outputs_in_reasoning=True) as running:
        yield running


@pytest.fixture(scope="module")
def kimi(engine):
    with served(engine, enable_auto_tool_choice=True, tool_call_parser="kimi_k2") as running:
        yield running


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_the_openai_loop_sends_the_returned_message_back_and_the_template_reads_its_reasoning(server):
    client = client_of(server)
    first = client.chat.completions.create(
        model="tiny", messages=ASK, max_tokens=64, temperature=0,
        extra_body={"structured_outputs": {"choice": [REASONED]}},
    )  # fmt: skip
    message = first.choices[0].message
    assert message.reasoning_content == "Paris is CET." and message.content == "It is noon."
    returned = message.model_dump()  # as the SDK's users send it: refusal, audio, annotations ... null
    assert {"refusal", "audio", "function_call", "reasoning_content"} <= set(returned)
    history = [*ASK, returned, {"role": "user", "content": "And in Oslo?"}]
    second = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length")
    # the earlier reasoning reached the template, under either name the server may have returned it
    for key in ("reasoning_content", "reasoning"):
        sent = [*ASK, {"role": "assistant", "content": "It is noon.", key: "Paris is CET."}]
        tokens = post(server, "/tokenize", {"messages": sent}).json()["tokens"]
        text = post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]
        assert "<think>Paris is CET.</think>It is noon." in text


def test_a_conversation_with_history_is_the_same_greedy_answer_with_and_without_speculation(server):
    history = [
        *ASK,
        {"role": "assistant", "content": "It is noon.", "reasoning_content": "CET.", "refusal": None},
        {"role": "user", "content": "def clock():"},
    ]
    texts = {
        method: post(
            server,
            "/v1/chat/completions",
            {"messages": history, "max_tokens": 24, "temperature": 0, "speculative": {"method": method}},
        ).json()["choices"][0]["message"]
        for method in ("ar", "ddtree")
    }
    assert texts["ar"] == texts["ddtree"]


@pytest.mark.parametrize("max_tokens", [3, 6, 10, 16, 24, 40])
def test_a_tool_call_cut_by_the_length_limit_is_length_never_tool_calls_with_broken_arguments(
    server, max_tokens
):
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        body = {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "max_tokens": max_tokens}
        answer = post(server, "/v1/chat/completions", body | {"temperature": 0}).json()["choices"][0]
        calls = answer["message"].get("tool_calls") or []
        if answer["finish_reason"] == "tool_calls":
            assert calls and all(isinstance(json.loads(c["function"]["arguments"]), dict) for c in calls)
        else:
            assert answer["finish_reason"] == "length", answer
            if max_tokens <= 6:  # too short for any whole call: the old server said "tool_calls" here
                assert not all(_parses(c["function"]["arguments"]) for c in calls) or not calls


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def test_kimi_ids_are_kimis_for_every_tool_choice_and_count_the_conversations_calls(kimi):
    earlier = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "functions.get_time:0", "type": "function",
             "function": {"name": "get_time", "arguments": '{"zone": "UTC", "days": 1}'}},
        ],
    }  # fmt: skip
    result = {"role": "tool", "tool_call_id": "functions.get_time:0", "content": "12:00"}
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        for history, index in ((ASK, 0), ([*ASK, earlier, result], 1)):
            body = {"messages": history, "tools": TOOLS, "tool_choice": choice, "max_tokens": 48}
            answer = post(kimi, "/v1/chat/completions", body | {"temperature": 0}).json()["choices"][0]
            calls = answer["message"]["tool_calls"]
            assert calls, answer
            assert calls[0]["id"] == f"functions.get_time:{index}", calls


def test_the_deprecated_functions_and_function_call_make_tool_calls(server):
    functions = [TOOLS[0]["function"]]
    body = {"messages": ASK, "functions": functions, "function_call": {"name": "get_time"}, "max_tokens": 48}
    answer = post(server, "/v1/chat/completions", body | {"temperature": 0}).json()["choices"][0]
    (call,) = answer["message"]["tool_calls"]
    assert call["function"]["name"] == "get_time" and _parses(call["function"]["arguments"])
    both = post(server, "/v1/chat/completions", body | {"tools": TOOLS})
    assert both.status_code == 400 and both.json()["error"]["param"] == "functions"


def test_reasoning_effort_and_thinking_switch_the_templates_thinking_as_enable_thinking_does(server):
    def prompt_tokens(**extra) -> int:
        body = {"messages": ASK, "max_tokens": 1} | extra
        reply = post(server, "/v1/chat/completions", body)
        assert reply.status_code == 200, reply.text
        return reply.json()["usage"]["prompt_tokens"]

    off = prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert off > prompt_tokens()  # the template closed the thinking
    assert prompt_tokens(reasoning_effort="none") == off
    assert prompt_tokens(thinking={"type": "disabled"}) == off
    assert prompt_tokens(thinking=False) == off
    assert prompt_tokens(reasoning_effort="high") == prompt_tokens()
    bad = post(server, "/v1/chat/completions", {"messages": ASK, "reasoning_effort": "extreme"})
    assert bad.status_code == 400 and "reasoning_effort" in bad.json()["error"]["param"]


def test_include_reasoning_false_leaves_the_reasoning_out(server):
    body = {"messages": ASK, "max_tokens": 64, "temperature": 0, "structured_outputs": {"choice": [REASONED]}}
    message = post(server, "/v1/chat/completions", body | {"include_reasoning": False}).json()["choices"][0]
    assert message["message"]["content"] == "It is noon."
    assert message["message"].get("reasoning_content") is None


NUMBERS = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "boolean"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}


def test_json_answers_have_no_runaway_whitespace_and_json_object_is_an_object(server):
    schema = {"type": "json_schema", "json_schema": {"name": "n", "schema": NUMBERS}}
    body = {"messages": ASK, "max_tokens": 40, "temperature": 0, "response_format": schema}
    answer = post(server, "/v1/chat/completions", body).json()["choices"][0]
    assert answer["finish_reason"] == "stop"
    assert re.fullmatch(r'\{"a": \d{1,2}, "b": (true|false)\}', answer["message"]["content"])
    for seed in range(3):
        body = {"messages": ASK, "max_tokens": 60, "seed": seed, "response_format": {"type": "json_object"}}
        answer = post(server, "/v1/chat/completions", body).json()["choices"][0]
        if answer["finish_reason"] == "stop":
            assert isinstance(json.loads(answer["message"]["content"], strict=False), dict)
        else:
            assert answer["message"]["content"].lstrip().startswith("{")  # an object, cut short


def test_echo_with_logprobs_scores_the_prompt_as_hfs_forward_does_lm_evals_request(server, engine):
    context, continuation = "def fibonacci(n):\n", "    return n"
    ids = engine.encode(context + continuation)
    ctxlen = len(engine.encode(context))
    body = {"prompt": ids, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    choice = post(server, "/v1/completions", body).json()["choices"][0]  # lm-eval's loglikelihood request
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1 and logprobs["token_logprobs"][0] is None
    assert logprobs["top_logprobs"][0] is None and choice["text"].startswith(engine.tokenizer.decode(ids))
    with torch.no_grad():
        ref = torch.log_softmax(engine.target(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    wanted = [float(ref[k - 1, ids[k]]) for k in range(ctxlen, len(ids))]
    got = logprobs["token_logprobs"][ctxlen:-1]  # lm-eval's slice: the continuation's tokens
    assert got == pytest.approx(wanted, abs=1e-4)
    greedy = [int(ref[k - 1].argmax()) == ids[k] for k in range(ctxlen, len(ids))]
    tops = logprobs["top_logprobs"][ctxlen:-1]
    tokens = logprobs["tokens"][ctxlen:-1]
    assert [max(t, key=t.get) == tok for t, tok in zip(tops, tokens, strict=True)] == greedy


def test_vllms_prompt_logprobs_and_a_streamed_echo(server, engine):
    prompt = "import os\nimport sys\n"
    ids = engine.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "prompt_logprobs": 2}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    scored = choice["prompt_logprobs"]
    assert len(scored) == len(ids) and scored[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(engine.target(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1)
    for k in range(1, len(ids)):
        entry = scored[k]
        assert entry[str(ids[k])]["logprob"] == pytest.approx(float(ref[k - 1, ids[k]]), abs=1e-4)
        ranked = sorted((v["rank"], int(t)) for t, v in entry.items() if v["rank"] is not None)
        assert [t for _, t in ranked][:2] == ref[k - 1].topk(2).indices.tolist()
    plain = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0}).json()
    assert "prompt_logprobs" not in plain["choices"][0] or plain["choices"][0]["prompt_logprobs"] is None
    client = client_of(server)
    stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, echo=True,
                                       stream=True)  # fmt: skip
    text = "".join(chunk.choices[0].text for chunk in stream)
    assert text == prompt + plain["choices"][0]["text"]


def test_generation_config_seed_and_chat_template_flags(engine, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "top_k": 5}))
    with served(engine, generation_config=str(tmp_path)) as greedy_default:
        body = {"prompt": "def f(x):", "max_tokens": 12}
        left_out = post(greedy_default, "/v1/completions", body).json()["choices"][0]["text"]
        explicit = post(greedy_default, "/v1/completions", body | {"temperature": 0}).json()
        assert left_out == explicit["choices"][0]["text"]
    texts, template = [], "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    for _ in range(2):
        with served(engine, seed=7, chat_template=template) as s:
            body = {"prompt": "def f(x):", "max_tokens": 12, "temperature": 1}
            texts.append([post(s, "/v1/completions", body).json()["choices"][0]["text"] for _ in range(2)])
            tokens = post(s, "/tokenize", {"messages": ASK, "add_generation_prompt": False}).json()["tokens"]
            assert post(s, "/detokenize", {"tokens": tokens}).json()["prompt"] == f"[{ASK[0]['content']}]"
    assert texts[0] == texts[1] and texts[0][0] != texts[0][1]  # the server's seed, a new seed per request
    engine.tokenizer.chat_template = TEMPLATE  # the server put its --chat-template on the shared tokenizer


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "a", "--target", "b"], "give the target model once"),
        (["serve", "--enforce-eager", "--compile"], "--enforce-eager and --compile"),
        (["serve", "--generation-config", "/nonexistent"], "generation_config.json"),
        (["serve", "--chat-template", "no-such-file"], "--chat-template"),
        (["serve", "--tokenizer", "/nonexistent"], "--tokenizer"),
        (["serve", "--seed", "-1"], "--seed"),
    ],
)
def test_vllms_serve_flags_are_checked_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--port", "0"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_generate_chat_applies_the_chat_template(capsys, tmp_path):
    main(["generate", "--chat", "hello", "--max-new-tokens", "4", "--temperature", "0"])
    chat = capsys.readouterr().out
    main(["generate", "hello", "--max-new-tokens", "4", "--temperature", "0"])
    plain = capsys.readouterr().out
    assert plain.startswith("hello") and not chat.startswith("hello") and chat.strip()


def test_langchains_structured_output_and_bound_tools(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool
    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]

    @tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        return "12:00"

    url = f"{server.url}/v1"
    llm = langchain_openai.ChatOpenAI(
        model="tiny", base_url=url, api_key="unused", temperature=0, max_tokens=48, max_retries=0
    )
    assert isinstance(llm.with_structured_output(Verdict).invoke("Is Oslo cold?"), Verdict)
    message = llm.bind_tools([get_time], tool_choice="required").invoke("Time in Paris?")
    (call,) = message.tool_calls[:1]
    assert call["name"] == "get_time" and call["args"]["zone"] in ("UTC", "CET")
