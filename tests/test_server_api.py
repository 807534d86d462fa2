"""The HTTP API in process (Starlette's TestClient runs the app and its lifespan): shapes and errors."""

from __future__ import annotations

import json
import logging
import re
import threading
import time

import pytest
from fastapi.testclient import TestClient

from ddtree.engine import Engine
from ddtree.request.params import SamplingParams, StructuredOutputs
from ddtree.server import ServerConfig, create_app
from ddtree.server.chat import plain_prompt
from ddtree.server.tokens import TokenNames
from tests.conftest import save_models
from tests.server_helpers import sse_events

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("api-models"))


@pytest.fixture(scope="module")
def engine(model_dirs) -> Engine:
    return Engine.from_pretrained(*model_dirs, budget=16)


def start(factory, **config) -> TestClient:
    client = TestClient(create_app(factory, ServerConfig(model_name="tiny", **config)))
    client.__enter__()
    return client


@pytest.fixture(scope="module")
def http(engine):
    client = start(lambda: engine)
    wait_until_ready(client)
    yield client
    client.__exit__(None, None, None)


def wait_until_ready(client: TestClient, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while client.get("/ready").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


COMPLETION = {"model": "tiny", "prompt": "def", "max_tokens": 4}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


C, CH = "/v1/completions", "/v1/chat/completions"

# fmt: off
BAD_REQUESTS = [
    (C, "{not json", None, "invalid_json"),
    (C, "[1, 2]", None, None),
    (C, '"text"', None, None),
    (C, {"model": "tiny"}, "prompt", "missing_required_parameter"),
    (C, COMPLETION | {"max_tokens": "4"}, "max_tokens", None),
    (C, COMPLETION | {"max_tokens": 4.0}, "max_tokens", None),
    (C, COMPLETION | {"stream": "yes"}, "stream", None),
    (C, COMPLETION | {"bogus": 1}, "bogus", "unknown_parameter"),
    (C, COMPLETION | {"temperature": -1}, "temperature", None),
    (C, COMPLETION | {"top_p": 0}, "top_p", None),
    (C, COMPLETION | {"n": 0}, "n", None),
    (C, COMPLETION | {"logprobs": 21}, "logprobs", None),
    (C, COMPLETION | {"max_tokens": 0}, "max_tokens", None),
    (C, COMPLETION | {"stop": [""]}, "stop[0]", None),
    (C, COMPLETION | {"prompt": ""}, "prompt", None),
    (C, COMPLETION | {"prompt": []}, "prompt", None),
    (C, COMPLETION | {"prompt": [[1], []]}, "prompt", None),
    (C, COMPLETION | {"prompt": [10_000]}, "prompt", None),
    (C, COMPLETION | {"prompt": "def " * 80}, "prompt", "context_length_exceeded"),
    (C, COMPLETION | {"speculative": {"budget": 4096}}, "speculative.budget", "budget_exceeds_server_limit"),
    (C, COMPLETION | {"max_tokens": 100}, "max_tokens", "context_length_exceeded"),
    (C, COMPLETION | {"max_tokens": 100, "stream": True}, "max_tokens", "context_length_exceeded"),
    (C, COMPLETION | {"presence_penalty": 2.5}, "presence_penalty", None),
    (C, COMPLETION | {"repetition_penalty": 0}, "repetition_penalty", None),
    (C, COMPLETION | {"logit_bias": {"a": 1.0}}, "logit_bias", None),
    (C, COMPLETION | {"logit_bias": {"5": 101.0}}, "logit_bias", None),
    (C, COMPLETION | {"logit_bias": {"99999999": 1.0}}, "logit_bias", None),
    (C, COMPLETION | {"min_tokens": 9, "max_tokens": 4}, "min_tokens", None),
    (C, COMPLETION | {"bad_words": [""]}, "bad_words[0]", None),
    (C, COMPLETION | {"stream_options": {"include_usage": True}}, "stream_options", None),
    (C, COMPLETION | {"speculative": {"method": "beam"}}, "speculative.method", None),
    (C, COMPLETION | {"speculative": {"budget": 0}}, "speculative.budget", None),
    (C, COMPLETION | {"speculative": {"budget": "big"}}, "speculative.budget", None),
    (C, COMPLETION | {"seed": 1 << 70}, "seed", None),
    (CH, CHAT | {"messages": []}, "messages", None),
    (CH, CHAT | {"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", None),
    (CH, CHAT | {"messages": [{"role": "tool", "content": None}]}, "messages[0].content", None),
    (CH, CHAT | {"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls",
     None),
    (CH, CHAT | {"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    (CH, CHAT | {"top_logprobs": 2}, "top_logprobs", None),
    (CH, CHAT | {"tools": [{"type": "function"}]}, "tools[0].function", "missing_required_parameter"),
    (CH, CHAT | {"tools": [TOOL]}, "tool_choice", None),  # "auto" needs --enable-auto-tool-choice
    (CH, CHAT | {"tool_choice": "required"}, "tool_choice", None),
    (CH, CHAT | {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice", None),
    (CH, CHAT | {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs", None),
    (CH, CHAT | {"response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format.json_schema.name", "missing_required_parameter"),
    (CH, CHAT | {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     None),
    (CH, CHAT | {"response_format": {"type": "xml"}}, "response_format.type", None),
    (CH, CHAT | {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format", None),
    (C, COMPLETION | {"structured_outputs": {}}, "structured_outputs", None),
    (C, COMPLETION | {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", None),
    (C, COMPLETION | {"structured_outputs": {"regex": "(unclosed"}}, None, None),
]
# fmt: on


@pytest.mark.parametrize(("path", "body", "param", "code"), BAD_REQUESTS)
def test_client_mistakes_are_400_with_the_openai_error_shape(http, path, body, param, code):
    if isinstance(body, str):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    error = error_of(r, 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param and error["code"] == code, error


def test_unknown_model_route_and_method_are_404_and_405(http):
    error = error_of(http.post("/v1/completions", json=COMPLETION | {"model": "gpt-4"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error_of(http.get("/v1/models/gpt-4"), 404)["code"] == "model_not_found"
    assert error_of(http.get("/v2/nothing"), 404)["code"] == "not_found"
    assert error_of(http.get("/v1/completions"), 405)["code"] == "method_not_allowed"
    assert error_of(http.post("/v1/completions", content=b"\xff\xfe"), 400)


def test_models_health_and_identity(http):
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["max_model_len"] == 64
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    health, ready = http.get("/health").json(), http.get("/ready").json()
    assert health["status"] == "ok" and health["state"] == ready["state"] == "ready"
    assert health["instance_id"] == ready["instance_id"] and len(health["instance_id"]) == 32
    assert isinstance(health["pid"], int) and health["started_at"].endswith("+00:00")


def test_completion_stream_chunks_usage_and_stats(http, engine):
    body = COMPLETION | {
        "temperature": 0,
        "max_tokens": 10,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text.splitlines())
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert all(c["object"] == "text_completion" and c["usage"] is None for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 10
    expected = engine.generate("def", SamplingParams(max_new_tokens=10))
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.text
    finishing = [c for c in chunks if c["choices"][0]["finish_reason"]]
    assert (
        len(finishing) == 1
        and finishing[0]["ddtree"]["acceptance_lengths"] == expected.stats.acceptance_lengths
    )


def test_speculative_budget_auto_is_chosen_per_round_and_reported(http):
    body = COMPLETION | {
        "max_tokens": 12,
        "temperature": 0,
        "speculative": {"method": "ddtree", "budget": "auto"},
    }
    r = http.post(C, json=body)
    assert r.status_code == 200, r.text
    stats = r.json()["ddtree"]
    assert stats["budget"] == "auto" and len(stats["drafted_nodes"]) == stats["rounds"]
    assert isinstance(stats["auto"]["drafting"], bool) and stats["auto"]["reason"]
    assert stats["auto"]["draft_ms"] > 0 and stats["auto"]["plain_round_ms"] > 0  # the measured costs
    plain = http.post(C, json=COMPLETION | {"max_tokens": 12, "temperature": 0, "speculative": False}).json()
    assert r.json()["choices"][0]["text"] == plain["choices"][0]["text"]  # greedy: lossless either way
    assert "auto" not in plain["ddtree"]  # plain decoding chose nothing
    metrics = http.get("/metrics").text
    assert "ddtree_auto_drafting " in metrics and 'ddtree_auto_cost_seconds{part="draft"}' in metrics
    drafted = [
        line for line in metrics.splitlines() if line.startswith("ddtree_spec_decode_drafted_tokens_total")
    ]
    assert sum(float(line.split()[-1]) for line in drafted) >= sum(stats["drafted_nodes"])


def test_lossless_responses_name_no_thresholds_and_lossy_ones_name_both(http, model_dirs):
    body = COMPLETION | {"temperature": 1, "seed": 0, "n": 2}
    assert not any(k.startswith("accept_threshold") for k in http.post(C, json=body).json()["ddtree"])
    lossy = Engine.from_pretrained(
        *model_dirs, budget=16, accept_threshold_single=0.0, accept_threshold_acc=0.5
    )
    client = start(lambda: lossy)
    try:
        wait_until_ready(client)
        whole = client.post(C, json=body).json()["ddtree"]
        stream = client.post(CH, json=CHAT | {"stream": True, "stream_options": {"include_usage": True}})
        stats = [e["ddtree"] for e in sse_events(stream.text.splitlines())[:-1] if e.get("ddtree")]
    finally:
        client.__exit__(None, None, None)
    assert len(stats) == 2  # the finishing chunk and the usage chunk
    for s in [whole, *stats]:
        assert s["accept_threshold_single"] == 0.0 and s["accept_threshold_acc"] == 0.5


def test_tools_without_a_tool_parser_are_refused_unless_tool_choice_is_none(http):
    auto = error_of(http.post(CH, json=CHAT | {"tools": [TOOL]}), 400)
    assert (
        auto["message"]
        == '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
    )
    assert http.post(CH, json=CHAT | {"tools": [], "response_format": {"type": "text"}}).status_code == 200
    assert http.post(CH, json=CHAT | {"tools": [TOOL], "tool_choice": "none"}).status_code == 200


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (
            CH,
            {"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}},
        ),
        (CH, {"structured_outputs": {"json": SCHEMA}}),
        (C, {"structured_outputs": {"json": json.dumps(SCHEMA)}}),
        (CH, {"response_format": {"type": "json_object"}}),
        (C, {"structured_outputs": {"choice": ["red", "green", "blue"]}}),
        (C, {"structured_outputs": {"regex": "[a-c]{2}-[0-9]{3}"}}),
    ],
)
def test_structured_outputs_constrain_the_answer_and_equal_the_engines_constrained_decoding(
    http, engine, path, extra
):
    body = (CHAT if path == CH else COMPLETION) | {"max_tokens": 40, "temperature": 0} | extra
    reply = http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    text = choice["message"]["content"] if path == CH else choice["text"]
    if choice["finish_reason"] == "stop":  # a JSON answer may also spend its tokens on whitespace
        if "response_format" in extra and extra["response_format"]["type"] == "json_object":
            assert isinstance(json.loads(text), dict)
        elif "choice" in extra.get("structured_outputs", {}):
            assert text in ("red", "green", "blue")
        elif "regex" in extra.get("structured_outputs", {}):
            assert re.fullmatch("[a-c]{2}-[0-9]{3}", text)
        else:
            # strict=False: xgrammar 0.2.9's maxLength strings admit control characters (its class is
            # [^"\\\r\n]), which the random built-in pair writes once whitespace cannot fill its tokens
            value = json.loads(text, strict=False)
            assert set(value) == {"name", "n"} and isinstance(value["n"], int)
    if path == C:  # the same tokens as the engine's own constrained decoding
        spec = extra["structured_outputs"]
        structured = StructuredOutputs(  # JSON as the server's default --disable-any-whitespace writes it
            json=StructuredOutputs.of_schema(spec["json"]).json if "json" in spec else None,
            disable_any_whitespace="json" in spec,
            regex=spec.get("regex"),
            choice=tuple(spec["choice"]) if "choice" in spec else None,
        )
        params = SamplingParams(max_new_tokens=40, structured_outputs=structured)
        assert text == engine.generate("def", params).text


def test_a_constraint_that_does_not_compile_is_a_400_before_anything_runs(http):
    bad = error_of(http.post(C, json=COMPLETION | {"structured_outputs": {"regex": "(unclosed"}}), 400)
    assert bad["message"].startswith("invalid structured-output regex") and "\n" not in bad["message"]
    assert http.post(C, json=COMPLETION).status_code == 200  # the server goes on


def test_batched_prompts_times_n_choices_are_indexed_prompt_major(http, engine):
    body = COMPLETION | {"prompt": ["def", "import"], "n": 2, "temperature": 0, "max_tokens": 6}
    choices = http.post("/v1/completions", json=body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for c, prompt in zip(choices, ["def", "def", "import", "import"], strict=True):
        assert c["text"] == engine.generate(prompt, SamplingParams(max_new_tokens=6)).text
    ids = engine.encode("def")
    by_ids = http.post(
        "/v1/completions", json=COMPLETION | {"prompt": ids, "temperature": 0, "max_tokens": 6}
    )
    assert by_ids.json()["choices"][0]["text"] == choices[0]["text"]


def test_chat_defaults_to_the_rest_of_the_context_and_accepts_text_parts(http, engine):
    parts = {"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}
    r = http.post("/v1/chat/completions", json={"messages": [parts], "temperature": 0, "ignore_eos": True})
    answer = r.json()
    prompt = plain_prompt([{"role": "user", "content": "hi"}])
    room = 64 - len(engine.encode(prompt))
    assert answer["usage"]["completion_tokens"] == room and answer["choices"][0]["finish_reason"] == "length"
    assert answer["model"] == "tiny" and answer["object"] == "chat.completion"


def test_plain_fallback_prompt_format():
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "developer", "content": "Only numbers."},
        {"role": "user", "content": "2 + 2?"},
    ]
    expected = (
        "System: Be terse.\nUser: Hi\nAssistant: Hello.\nSystem: Only numbers.\nUser: 2 + 2?\nAssistant:"
    )
    assert plain_prompt(messages) == expected


def test_a_tokenizer_chat_template_is_used_when_there_is_one(tmp_path):
    target, drafter = save_models(tmp_path, chat_template=TEMPLATE)
    engine = Engine.from_pretrained(target, drafter, budget=16)
    client = start(lambda: engine)
    try:
        wait_until_ready(client)
        messages = [{"role": "user", "content": "def"}]
        rendered = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered == "<|user|>def\n<|assistant|>"
        expected = engine.generate(rendered, SamplingParams(max_new_tokens=8))
        r = client.post(
            "/v1/chat/completions", json={"messages": messages, "temperature": 0, "max_tokens": 8}
        )
        assert r.json()["choices"][0]["message"]["content"] == expected.text
        assert r.json()["usage"]["prompt_tokens"] == len(engine.encode(rendered))
    finally:
        client.__exit__(None, None, None)


def test_generation_answers_503_until_the_engine_is_loaded_and_warm(engine):
    loaded = threading.Event()

    def slow_factory():
        loaded.wait(30)
        return engine

    client = start(slow_factory)
    try:
        assert client.get("/health").json()["state"] == "loading"
        not_ready = client.get("/ready")
        assert not_ready.status_code == 503 and not_ready.json()["error"]["code"] == "model_loading"
        assert error_of(client.post("/v1/completions", json=COMPLETION), 503)["code"] == "model_loading"
        assert error_of(client.post("/v1/completions", json={"prompt": 5}), 400)  # validation comes first
        loaded.set()
        wait_until_ready(client)
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    finally:
        loaded.set()
        client.__exit__(None, None, None)


def test_a_compiled_engine_is_ready_after_its_compile_and_logs_its_seconds_once():
    """A real ``Engine(compile=True)`` (one verify shape): /ready says 503 until its constructor has
    compiled, then requests are served and the compile seconds are logged once."""
    compiling = threading.Event()  # held until the first /ready check: the factory has not returned yet
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ddtree.server")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    def compiling_factory():
        compiling.wait(30)
        return Engine.from_pretrained(max_batch_size=1, compile=True, batch_buckets=[1], node_buckets=[17])

    client = start(compiling_factory)
    try:
        assert client.get("/ready").status_code == 503
        compiling.set()
        wait_until_ready(client, timeout=300)  # compiling two graphs on a cold cache
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200
    finally:
        compiling.set()
        client.__exit__(None, None, None)
        logger.removeHandler(handler)
        logger.setLevel(level)
    compiled = [r.getMessage() for r in records if "compiled" in r.getMessage()]
    assert len(compiled) == 1, compiled
    # One span bucket: the whole block table, 2048 context + 16 drafter columns in 16-token blocks.
    assert re.fullmatch(
        r"engine compiled in \d+\.\d s: batch buckets 1, node buckets 17, span buckets 2064, attention sdpa",
        compiled[0],
    )


def test_a_failed_load_is_reported_and_handed_to_the_caller(tmp_path):
    failures = []

    def broken():
        raise OSError("disk on fire")

    client = TestClient(create_app(broken, ServerConfig(), on_load_failed=failures.append))
    with client:
        for _ in range(200):
            if failures:
                break
            time.sleep(0.01)
        error = error_of(client.post("/v1/completions", json={"prompt": "x"}), 503)
        assert error["code"] == "model_load_failed" and "disk on fire" in error["message"]
        assert client.get("/health").status_code == 200
    assert isinstance(failures[0], OSError)


def test_token_names_are_the_tokens_utf8_bytes(engine):
    names = TokenNames(engine.tokenizer)
    assert names.byte_level
    tokenizer = engine.tokenizer
    for token_id in range(len(tokenizer)):
        text, raw = names.lookup(token_id)
        if token_id in tokenizer.all_special_ids:
            assert text == tokenizer.convert_ids_to_tokens(token_id)
            continue
        assert bytes(raw).decode("utf-8", errors="replace") == text
        assert bytes(raw).decode("utf-8", errors="replace") == tokenizer.decode([token_id])


class ThreadRecordingTokenizer:
    """The tokenizer, with the name of the thread behind every tokenizing or detokenizing call."""

    SPIED = {"encode", "decode", "batch_decode", "tokenize", "apply_chat_template", "convert_ids_to_tokens",
             "convert_tokens_to_ids", "backend_tokenizer", "__call__"}  # fmt: skip

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str):
        if name in self.SPIED:
            self.calls.append((threading.current_thread().name, name))
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)


def test_the_engine_thread_never_tokenizes_or_detokenizes(engine):
    spy = ThreadRecordingTokenizer(engine.tokenizer)
    spied = Engine(engine.target, engine.runner.drafter, spy, budget=16)
    client = start(lambda: spied)
    try:
        wait_until_ready(client)
        spy.calls.clear()  # loading looked at the vocabulary once; from here on, only requests
        full = client.post(
            C, json=COMPLETION | {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
        ).json()
        text = full["choices"][0]["text"]
        stop = text[3:6]
        bodies = [
            (C, COMPLETION | {"max_tokens": 12, "n": 2, "logprobs": 2, "stop": [stop], "ignore_eos": True}),
            (C, COMPLETION | {"max_tokens": 12, "stream": True, "stop": stop, "temperature": 0}),
            (CH, CHAT | {"max_tokens": 6, "stream": True, "logprobs": True, "top_logprobs": 1}),
        ]
        for path, body in bodies:
            assert client.post(path, json=body).status_code == 200
    finally:
        client.__exit__(None, None, None)
    threads = {thread for thread, _ in spy.calls}
    assert "ddtree-engine" not in threads, [c for c in spy.calls if c[0] == "ddtree-engine"]
    assert {"encode", "convert_ids_to_tokens", "backend_tokenizer"} <= {name for _, name in spy.calls}


def test_a_stop_string_found_on_the_api_side_aborts_the_row_in_the_engine_within_one_step(engine):
    steps: list[dict[str, int]] = []  # per step: request id -> tokens its delta carried
    aborted_at: dict[str, int] = {}  # request id -> steps run before its abort

    class Recording:
        def __getattr__(self, name: str):
            return getattr(engine, name)

        def step(self):
            deltas = engine.step()
            steps.append({d.request_id: len(d.token_ids) for d in deltas})
            return deltas

        def abort(self, request_id: str) -> bool:
            aborted_at[request_id] = len(steps)
            return engine.abort(request_id)

    client = start(lambda: Recording())
    try:
        wait_until_ready(client)
        body = COMPLETION | {"max_tokens": 40, "temperature": 0, "ignore_eos": True}
        text = client.post(C, json=body).json()["choices"][0]["text"]
        stop = text[len(text) // 2 : len(text) // 2 + 3]
        steps.clear()
        cut = client.post(C, json=body | {"stop": [stop]}).json()["choices"][0]
    finally:
        client.__exit__(None, None, None)
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)]
    ((request_id, at),) = aborted_at.items()
    last_delta = max(i for i, ids in enumerate(steps) if request_id in ids)
    assert at - (last_delta + 1) <= 1  # the abort came at most one step after the delta with the stop
    assert engine.num_running == 0


def metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def metrics_caught_up(http, engine: Engine, timeout: float = 10) -> str:
    """/metrics once its prefix-cache counters hold the engine's totals (they follow each server step)."""
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        totals = (engine.blocks.queried_tokens, engine.blocks.hit_tokens)
        names = ("ddtree_prefix_cache_queries_total", "ddtree_prefix_cache_hits_total")
        if tuple(metric(text, n) for n in names) == totals:
            return text
        assert time.monotonic() < deadline, "the prefix-cache counters never reached the engine's totals"
        time.sleep(0.02)


def test_prefix_cache_hits_show_in_usage_and_metrics_and_salts_keep_tenants_apart(http, engine):
    """OpenAI's ``usage.prompt_tokens_details.cached_tokens`` and vLLM's token counters: a repeated prompt
    of three blocks hits two (its last token is computed again); another ``cache_salt`` hits none."""
    prompt = list(range(3, 3 + 48))  # 48 token ids: 3 blocks of 16
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    # The counters follow the engine after each of the server's steps; this module's tests also run the
    # engine directly, so one request first brings them up to date.
    http.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 1})
    before = metrics_caught_up(http, engine)
    cached = []
    for salt in (None, None, "tenant-b", "tenant-b"):
        answer = http.post("/v1/completions", json=body | ({"cache_salt": salt} if salt else {})).json()
        assert answer["usage"]["prompt_tokens"] == 48
        cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached == [0, 32, 0, 32]
    after = metrics_caught_up(http, engine)
    queries = "ddtree_prefix_cache_queries_total"
    assert metric(after, queries) - metric(before, queries) == 4 * 48
    hits = "ddtree_prefix_cache_hits_total"
    assert metric(after, hits) - metric(before, hits) == 2 * 32
    chat = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "cache_salt": ""},
    )
    assert error_of(chat, 400)["param"] == "cache_salt"
