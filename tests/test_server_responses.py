"""``/v1/responses`` over a real server (uvicorn on loopback, in a thread) with the ``openai`` client and
openai-agents' default model path (its Responses model): output items, the typed streaming events, function
tools and their outputs sent back as input items, and greedy ddtree == ar through it.

The built-in models write code-like text: a call comes from ``tool_choice`` ``"required"`` (the grammar), a
short final answer from a JSON schema in ``text.format``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import httpx
import openai
import pytest
import torch

from ddtree.engine import Engine
from ddtree.server import ServerConfig, create_app
from tests.server_helpers import ThreadServer

TEMPLATE = (
    "{% if tools %}<|tools|>{{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] or '' }}"
    "{% for c in m.tool_calls or [] %}<call {{ c.id }} {{ c.function.arguments }}>{% endfor %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOL = {"type": "function", "name": "get_time", "description": "The time in a zone", "parameters": ZONE}
VERDICT = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine() -> Engine:
    engine = Engine.from_pretrained(dtype=torch.float32, budget=16)
    engine.tokenizer.chat_template = TEMPLATE
    return engine


@pytest.fixture(scope="module")
def server(engine):
    config = ServerConfig(model_name="tiny", enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ThreadServer(create_app(lambda: engine, config)) as running:
        yield running


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_text_input_answers_with_a_message_item_and_the_chat_endpoints_text(server, client):
    response = client.responses.create(
        model="tiny", input="def fibonacci(n):", instructions="Write Python.", max_output_tokens=16,
        temperature=0,
    )  # fmt: skip
    assert response.object == "response" and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.output_text == item.content[0].text
    assert response.usage.output_tokens == 16 and response.usage.input_tokens > 0
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "messages": [{"role": "system", "content": "Write Python."},
                     {"role": "user", "content": "def fibonacci(n):"}],
        "max_tokens": 16, "temperature": 0}, timeout=120).json()  # fmt: skip
    assert chat["choices"][0]["message"]["content"] == response.output_text


def test_greedy_ddtree_equals_ar_through_responses(client):
    texts = {
        method: client.responses.create(
            model="tiny",
            input="import os\n",
            max_output_tokens=24,
            temperature=0,
            extra_body={"speculative": {"method": method}},
        ).output_text  # fmt: skip
        for method in ("ar", "ddtree")
    }
    assert texts["ar"] == texts["ddtree"] and texts["ar"]


def test_the_stream_is_typed_events_that_add_up_to_the_final_response(client):
    events = list(client.responses.create(model="tiny", input="import sys\n", max_output_tokens=12,
                                          temperature=0, stream=True))  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text and "response.output_item.done" in kinds
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas


def test_a_function_call_and_its_output_make_a_round_trip(client):
    # one call: with parallel calls the random models go on to a second one until the length limit
    forced = {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False,
              "max_output_tokens": 48, "temperature": 0}  # fmt: skip
    first = client.responses.create(model="tiny", input="Time in Paris?", **forced)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and calls and calls[0].name == "get_time"
    assert json.loads(calls[0].arguments)["zone"] in ("UTC", "CET")
    history = [{"role": "user", "content": "Time in Paris?"}, *[c.model_dump() for c in first.output],
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "12:00"}]  # fmt: skip
    second = client.responses.create(
        model="tiny", input=history, tools=[TOOL], max_output_tokens=32, temperature=0,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}},
    )  # fmt: skip
    assert second.status == "completed" and json.loads(second.output_text)["answer"] in ("yes", "no")
    streamed = list(client.responses.create(model="tiny", input="Time in Oslo?", stream=True, **forced))
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    (call,) = [i for i in streamed[-1].response.output if i.type == "function_call"][:1]
    assert arguments == call.arguments and json.loads(arguments)["zone"] in ("UTC", "CET")


def test_openai_agents_default_runner_makes_a_tool_round_trip(server):
    agents = pytest.importorskip("agents")
    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: Literal["yes", "no"]

    called = []

    @agents.function_tool
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        called.append(zone)
        return "12:00"

    model = agents.OpenAIResponsesModel(
        "tiny", openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    )
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                    max_tokens=48)  # fmt: skip
    agent = agents.Agent(
        name="clock", instructions="Answer with the tool.", tools=[get_time], output_type=Verdict,
        model=model, model_settings=settings,
    )  # fmt: skip
    agents.set_tracing_disabled(True)
    result = asyncio.run(agents.Runner.run(agent, "Time in Paris?"))
    assert called and isinstance(result.final_output, Verdict)
    kinds = [item.type for item in result.new_items]
    assert "tool_call_item" in kinds and "tool_call_output_item" in kinds


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": []}, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "computer_call", "id": "x"}]}, "input"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ],
)
def test_what_the_server_cannot_do_is_a_400_naming_the_field(server, body, param):
    reply = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"].startswith(param) and len(error["message"].splitlines()) == 1, error
