"""``ddtree serve`` as a real process on loopback, driven by real clients (``openai``, ``httpx``)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from ddtree.engine import Engine
from ddtree.request.params import SamplingParams
from ddtree.server.chat import plain_prompt
from tests.conftest import save_models
from tests.server_helpers import ServerProcess, metric, scrape, server_env, sse_events
from tests.test_engine_greedy import round_spans

PROMPTS = ["def fib", "import os", "return n", "    if n < 2:", "fibonacci(", "class A:", "x = 1", "# note"]
BUDGET = 16
MAX_QUEUE = 8


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("server-models"))


@pytest.fixture(scope="module")
def engine(model_dirs) -> Engine:
    """The same checkpoints loaded in the test process: what the server must reproduce."""
    return Engine.from_pretrained(*model_dirs, budget=BUDGET)


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    target, drafter = model_dirs
    args = ["--target", target, "--drafter", drafter, "--budget", BUDGET, "--max-queue", MAX_QUEUE,
            "--served-model-name", "tiny"]  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("server-log") / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.close()


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_completions_equal_the_engines_greedy_output(client, engine):
    for prompt in PROMPTS[:4]:
        expected = engine.generate(prompt, SamplingParams(max_new_tokens=20))
        whole = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert whole.choices[0].text == expected.text
        assert whole.choices[0].finish_reason == expected.finish_reason
        assert whole.usage.completion_tokens == len(expected.token_ids)
        assert whole.usage.prompt_tokens == len(engine.encode(prompt))
        stats = whole.to_dict()["ddtree"]
        assert stats["method"] == "ddtree" and stats["budget"] == BUDGET
        assert stats["acceptance_lengths"] == expected.stats.acceptance_lengths
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)


def test_openai_chat_equals_the_engine_on_the_plain_fallback_prompt(client, engine):
    messages = [
        {"role": "system", "content": "def"},
        {"role": "user", "content": "fib"},
    ]
    expected = engine.generate(plain_prompt(messages), SamplingParams(max_new_tokens=12))
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.choices[0].finish_reason == expected.finish_reason
    assert whole.usage.prompt_tokens == len(engine.encode(plain_prompt(messages)))
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_completion_tokens=12, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason
    assert chunks[-1].to_dict()["ddtree"]["rounds"] == expected.stats.rounds


def test_seeded_sampling_repeats_and_each_choice_uses_seed_plus_its_index(client, engine):
    request = dict(model="tiny", prompt="def fib", max_tokens=12, temperature=0.9, top_p=0.95, seed=7, n=3)
    first = [c.text for c in client.completions.create(**request).choices]
    second = [c.text for c in client.completions.create(**request).choices]
    assert first == second
    assert len(set(first)) > 1  # independent choices, not one sample three times
    for i, text in enumerate(first):
        params = SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i, max_new_tokens=12)
        assert engine.generate("def fib", params).text == text
    extension = client.completions.create(**request, extra_body={"top_k": 5, "min_p": 0.05})
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=5, min_p=0.05, seed=7, max_new_tokens=12)
    assert extension.choices[0].text == engine.generate("def fib", params).text


def test_stop_strings_never_leak_even_inside_one_accepted_block(client, engine):
    """As tests/test_stop_strings.py, over HTTP: whole answers and every streamed chunk."""
    wide = {"speculative": {"budget": 256}, "ignore_eos": True}
    full = engine.generate("def fib", SamplingParams(max_new_tokens=40, ignore_eos=True), budget=256)
    spans = round_spans(full)
    inside_block = 0
    for begin in range(2, len(full.text) - 3, 3):
        stop = full.text[begin : begin + 3]
        cut = full.text.index(stop)
        request = dict(
            model="tiny", prompt="def fib", max_tokens=40, temperature=0, stop=[stop], extra_body=wide
        )
        whole = client.completions.create(**request)
        assert whole.choices[0].text == full.text[:cut]
        assert whole.choices[0].finish_reason == "stop"
        chunks = [c.choices[0].text for c in client.completions.create(**request, stream=True)]
        assert "".join(chunks) == full.text[:cut]
        assert all(stop not in c for c in chunks)
        n = next(
            k
            for k in range(1, len(full.token_ids) + 1)
            if stop in engine.tokenizer.decode(full.token_ids[:k])
        )
        inside_block += any(b < n < e for b, e in spans)
    assert inside_block >= 1


def test_logprobs_are_the_engines(client, engine):
    expected = engine.generate("def fib", SamplingParams(max_new_tokens=10, logprobs=3, ignore_eos=True))
    whole = client.completions.create(
        model="tiny",
        prompt="def fib",
        max_tokens=10,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = whole.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in expected.logprobs], abs=1e-5)
    assert len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=2, stream=True,
    )  # fmt: skip
    content = [t for c in chat if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    reference = engine.generate(
        plain_prompt([{"role": "user", "content": "hi"}]), SamplingParams(max_new_tokens=6, logprobs=2)
    )
    assert [t.logprob for t in content] == pytest.approx([t.logprob for t in reference.logprobs], abs=1e-5)
    for token in content:
        assert len(token.top_logprobs) == 2 and token.top_logprobs[0].logprob >= token.logprob - 1e-6
        assert bytes(token.bytes).decode("utf-8", errors="replace") == token.token


def test_speculative_extension_picks_the_method_per_request(client, engine):
    greedy = engine.generate("import os", SamplingParams(max_new_tokens=12)).text
    for option, method in [(False, "ar"), ({"method": "dflash"}, "dflash"), ({"budget": 4}, "ddtree")]:
        r = client.completions.create(
            model="tiny", prompt="import os", max_tokens=12, temperature=0, extra_body={"speculative": option}
        )
        assert r.choices[0].text == greedy  # lossless whatever the method
        stats = r.to_dict()["ddtree"]
        assert stats["method"] == method
        if method == "ar":
            assert set(stats["acceptance_lengths"]) == {1}
    assert (
        client.completions.create(
            model="tiny", prompt="x", max_tokens=2, extra_body={"speculative": {"budget": 4}}
        ).to_dict()["ddtree"]["budget"]
        == 4
    )


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError) as not_found:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert not_found.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny", prompt="x", max_tokens=10_000)
    assert bad.value.code == "context_length_exceeded" and bad.value.param == "max_tokens"
    assert [m.id for m in client.models.list()] == ["tiny"]


def test_fields_that_cannot_change_the_output_are_ignored_and_logged_once(server, client, engine):
    expected = engine.generate(
        plain_prompt([{"role": "user", "content": "def"}]), SamplingParams(max_new_tokens=6)
    )
    for _ in range(2):
        chat = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "def"}], max_tokens=6, temperature=0,
            store=False, metadata={"team": "a"}, user="u1", service_tier="auto",
        )  # fmt: skip
        assert chat.choices[0].message.content == expected.text
    done = client.completions.create(
        model="tiny", prompt="def", max_tokens=2, user="u2",
        extra_body={"store": False, "metadata": {"k": "v"}, "repetition_penalty": 1.0},  # 1.0: neutral
    )  # fmt: skip
    assert done.choices[0].finish_reason in ("stop", "length")
    log = server.log()
    assert log.count("ignoring the request field 'store'") == 1
    assert log.count("ignoring the request field 'metadata'") == 1


def test_penalties_reach_the_engine_as_its_sampling_parameters(client, engine):
    params = SamplingParams(
        max_new_tokens=12, frequency_penalty=0.5, presence_penalty=0.2, repetition_penalty=1.3,
        logit_bias={5: 2.0}, min_tokens=10, bad_words=("fib",),
    )  # fmt: skip
    expected = engine.generate("def fib", params)
    assert expected.token_ids != engine.generate("def fib", SamplingParams(max_new_tokens=12)).token_ids
    done = client.completions.create(
        model="tiny", prompt="def fib", max_tokens=12, temperature=0, frequency_penalty=0.5,
        presence_penalty=0.2, logit_bias={"5": 2.0},
        extra_body={"repetition_penalty": 1.3, "min_tokens": 10, "bad_words": ["fib"]},
    )  # fmt: skip
    assert done.choices[0].text == expected.text


def test_tool_results_are_accepted_as_a_tool_line_of_the_conversation(client, engine):
    messages = [
        {"role": "user", "content": "def"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "fib"},
    ]  # fmt: skip
    prompt = "User: def\nAssistant: \nTool: fib\nAssistant:"
    expected = engine.generate(prompt, SamplingParams(max_new_tokens=6))
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == expected.text
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": None}], max_tokens=2
        )
    assert bad.value.param == "messages[0].content"


def test_metrics_parse_and_move_as_requests_complete(server, client):
    before = scrape(server.url)
    r = client.completions.create(model="tiny", prompt="def fib", max_tokens=9, temperature=0)
    after = scrape(server.url)
    ok = {"endpoint": "/v1/completions", "status": "200"}
    assert metric(after, "ddtree_requests_total", **ok) == metric(before, "ddtree_requests_total", **ok) + 1
    grew = {
        "ddtree_prompt_tokens_total": r.usage.prompt_tokens,
        "ddtree_generation_tokens_total": r.usage.completion_tokens,
    }
    for name, amount in grew.items():
        assert metric(after, name) == metric(before, name) + amount
    rounds = r.to_dict()["ddtree"]["rounds"]
    assert metric(after, "ddtree_spec_decode_rounds_total", method="ddtree") == pytest.approx(
        metric(before, "ddtree_spec_decode_rounds_total", method="ddtree") + rounds
    )
    count = ("ddtree_request_duration_seconds_count", {"endpoint": "/v1/completions"})
    assert metric(after, count[0], **count[1]) == metric(before, count[0], **count[1]) + 1
    assert metric(after, "ddtree_spec_decode_mean_acceptance_length", method="ddtree") >= 1.0
    assert metric(after, "ddtree_queue_depth") == 0 and metric(after, "ddtree_requests_running") == 0


def test_64_concurrent_clients_get_a_correct_answer_or_a_429(server, engine):
    expected = {p: engine.generate(p, SamplingParams(max_new_tokens=8)).text for p in PROMPTS}
    clients, per_client = 64, 3
    before = scrape(server.url)

    async def one(http: httpx.AsyncClient, i: int, k: int) -> str:
        prompt = PROMPTS[(i + k) % len(PROMPTS)]
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "stream": (i + k) % 2 == 1,
        }
        r = await http.post("/v1/completions", json=body)
        if r.status_code == 429:
            assert r.headers["Retry-After"].isdigit() and r.json()["error"]["code"] == "queue_full"
            return "429"
        assert r.status_code == 200, r.text
        if body["stream"]:
            events = sse_events(r.text.splitlines())
            assert events[-1] == "[DONE]"
            text = "".join(e["choices"][0]["text"] for e in events[:-1])
        else:
            text = r.json()["choices"][0]["text"]
        assert text == expected[prompt]
        return "ok"

    async def client_loop(http: httpx.AsyncClient, i: int) -> list[str]:
        return [await one(http, i, k) for k in range(per_client)]

    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=120) as http:
            results = await asyncio.gather(*(client_loop(http, i) for i in range(clients)))
        return [r for rs in results for r in rs]

    outcomes = asyncio.run(main())
    assert len(outcomes) == clients * per_client  # none lost
    assert outcomes.count("ok") > 0 and outcomes.count("ok") + outcomes.count("429") == len(outcomes)
    after = scrape(server.url)
    answered = {
        status: metric(after, "ddtree_requests_total", endpoint="/v1/completions", status=status)
        - metric(before, "ddtree_requests_total", endpoint="/v1/completions", status=status)
        for status in ("200", "429")
    }
    assert answered == {"200": outcomes.count("ok"), "429": outcomes.count("429")}
    answers = [dict(labels) for name, labels in after if name == "ddtree_requests_total"]
    assert not [a for a in answers if a["status"].startswith("5") and a["endpoint"] != "/ready"]
    assert metric(after, "ddtree_queue_depth") == 0 and metric(after, "ddtree_requests_running") == 0


def test_cors_is_off_by_default_and_no_key_is_needed(server):
    origin = {"Origin": "https://app.example"}
    preflight = httpx.options(
        f"{server.url}/v1/completions", headers=origin | {"Access-Control-Request-Method": "POST"}
    )
    assert preflight.status_code >= 400 and "Access-Control-Allow-Origin" not in preflight.headers
    answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, headers=origin)
    assert answer.status_code == 200 and "Access-Control-Allow-Origin" not in answer.headers
    assert "no API key" not in server.log()  # loopback: no warning


def test_a_second_server_on_the_same_port_fails_at_once(server, model_dirs):
    port = server.url.rsplit(":", 1)[1]
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "serve", "--target", model_dirs[0], "--drafter", model_dirs[1],
         "--port", port],
        capture_output=True, text=True, timeout=120, env=server_env(DDTREE_TEST_LOAD_DELAY="300"),
    )  # fmt: skip
    assert run.returncode == 2
    assert "already in use" in run.stderr and "Traceback" not in run.stderr
    assert time.monotonic() - start < 60  # it never waited for the (300 s) load
    assert httpx.get(f"{server.url}/health").status_code == 200  # the first one is untouched


def test_flags_and_models_that_cannot_work_exit_2(model_dirs, tmp_path):
    target, _ = model_dirs
    run = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "serve", "--target", "/nonexistent", "--port", "0"],
        capture_output=True, text=True, timeout=120, env=server_env(),
    )  # fmt: skip
    assert run.returncode == 2 and "does not exist" in run.stderr and "listening" not in run.stderr
    bad = ServerProcess(["--target", target, "--drafter", target], tmp_path / "bad.log")  # not a drafter
    assert bad.wait(120) == 2
    assert "not a DFlash checkpoint" in bad.log()


def wait_running(url: str, requests: int, timeout: float = 30) -> None:
    """Until the server reports ``requests`` HTTP requests running (they have rows in the engine)."""
    deadline = time.monotonic() + timeout
    while metric(scrape(url), "ddtree_requests_running") != requests:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_ready_is_503_while_loading_and_sigterm_lets_the_request_in_flight_finish(model_dirs, tmp_path):
    target, drafter = model_dirs
    proc = ServerProcess(
        ["--target", target, "--drafter", drafter, "--budget", BUDGET, "--shutdown-timeout", 120],
        tmp_path / "slow.log",
        env=server_env(DDTREE_TEST_LOAD_DELAY="3"),
    )
    try:
        health = httpx.get(f"{proc.url}/health")
        assert health.status_code == 200 and health.json()["state"] == "loading"
        ready = httpx.get(f"{proc.url}/ready")
        assert ready.status_code == 503 and ready.headers["Retry-After"]
        body = ready.json()
        assert body["error"]["code"] == "model_loading" and body["error"]["type"] == "service_unavailable"
        assert body["pid"] == proc.proc.pid == health.json()["pid"]
        assert body["instance_id"] == health.json()["instance_id"] and body["started_at"]
        early = httpx.post(f"{proc.url}/v1/completions", json={"prompt": "x"})
        assert early.status_code == 503 and early.json()["error"]["code"] == "model_loading"
        identity = proc.wait_ready()
        assert identity["instance_id"] == body["instance_id"] and identity["state"] == "ready"

        result: dict = {}
        long = {"prompt": "def fib", "max_tokens": 48, "n": 16, "temperature": 0, "ignore_eos": True}
        worker = threading.Thread(
            target=lambda: result.update(r=httpx.post(f"{proc.url}/v1/completions", json=long, timeout=120))
        )
        worker.start()
        wait_running(proc.url, 1)
        proc.terminate()
        host, port = proc.url.removeprefix("http://").split(":")
        refused = False
        deadline = time.monotonic() + 10
        while not refused and time.monotonic() < deadline:
            try:
                socket.create_connection((host, int(port)), timeout=1).close()
                time.sleep(0.02)
            except OSError:
                refused = True
        assert refused  # stopped accepting
        worker.join(120)
        answer = result["r"]
        assert answer.status_code == 200, answer.text
        assert [c["finish_reason"] for c in answer.json()["choices"]] == ["length"] * 16
        assert proc.wait(60) == 0
    finally:
        proc.close()
    assert "Traceback" not in proc.log()


def test_past_the_shutdown_timeout_open_requests_end_the_openai_way_and_the_exit_code_says_so(
    model_dirs, tmp_path
):
    target, drafter = model_dirs
    proc = ServerProcess(
        ["--target", target, "--drafter", drafter, "--shutdown-timeout", 1, "--threads", 1],
        tmp_path / "cut.log",
        env=server_env(DDTREE_TEST_STEP_DELAY="0.1", OMP_NUM_THREADS="2"),
    )
    try:
        proc.wait_ready()
        assert "1 torch threads" in proc.log()  # --threads reached torch on the engine thread
        # One token per step (plain decoding), a step every 0.1 s: each request needs about 5 s.
        long = {
            "prompt": "def fib",
            "max_tokens": 50,
            "temperature": 0,
            "ignore_eos": True,
            "speculative": False,
        }
        events: list = []
        whole: dict = {}

        def stream() -> None:
            with httpx.stream("POST", f"{proc.url}/v1/completions", json=long | {"stream": True},
                              timeout=60) as r:  # fmt: skip
                events.extend(sse_events(r.iter_lines()))

        threads = [
            threading.Thread(target=stream),
            threading.Thread(
                target=lambda: whole.update(r=httpx.post(f"{proc.url}/v1/completions", json=long, timeout=60))
            ),
        ]
        for t in threads:
            t.start()
        wait_running(proc.url, 2)
        proc.terminate()
        for t in threads:
            t.join(60)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "shutting_down", events[-3:]
        assert any("choices" in e for e in events[:-2])  # it was cut mid-stream
        answer = whole["r"]
        assert answer.status_code == 503 and answer.headers["content-type"] == "application/json"
        assert answer.json()["error"]["code"] == "shutting_down"
        assert proc.wait(60) == 1
    finally:
        proc.close()
    log = proc.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log
    assert "2 request(s) did not finish within --shutdown-timeout 1 s" in log
