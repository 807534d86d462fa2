"""API keys, request limits and CORS, on a real ``ddtree serve`` process driven by ``openai`` and ``httpx``.

One server for the module: keys from ``DDTREE_API_KEY`` (two, comma-separated), a separate metrics key,
one allowed CORS origin, a small work bound (the tiny model's context is 64 tokens) and the default body
limit (16 MiB). CORS refused by default is tested on the plain server of test_server_process.
"""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from ddtree.cli import build_parser
from ddtree.errors import DDTreeError
from ddtree.server.auth import api_keys, open_access_warning
from ddtree.server.run import serve
from tests.conftest import CONTEXT, save_models
from tests.server_helpers import ServerProcess, server_env

KEYS = ("key-one-7f3a9c", "key-two-51be20")
METRICS_KEY = "metrics-key-c0ffee"
WRONG = "wrong-key-d15ea5e"
ORIGIN = "https://app.example"
MAX_WORK = 1000
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target, drafter = save_models(tmp_path_factory.mktemp("security-models"))
    args = ["--target", target, "--drafter", drafter, "--budget", 16, "--served-model-name", "tiny",
            "--metrics-api-key", METRICS_KEY, "--allowed-origins", ORIGIN,
            "--max-tokens-per-request", MAX_WORK, "--access-log"]  # fmt: skip
    env = server_env(DDTREE_API_KEY=",".join(KEYS))
    proc = ServerProcess(args, tmp_path_factory.mktemp("security-log") / "server.log", env=env)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.close()


def keyed(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def openai_client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        line = next(line for line in status if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_v1_needs_one_of_the_keys_while_health_and_ready_stay_open(server):
    for key in KEYS:
        client = openai_client(server, key)
        assert client.completions.create(model="tiny", prompt="def", max_tokens=3).choices[0].text is not None
        assert client.chat.completions.create(model="tiny", **CHAT).choices[0].message.role == "assistant"
        assert [m.id for m in client.models.list()] == ["tiny"]
    wrong = openai_client(server, WRONG)
    calls = [
        lambda: wrong.completions.create(model="tiny", prompt="def", max_tokens=3),
        lambda: wrong.chat.completions.create(model="tiny", **CHAT),
        lambda: wrong.models.list(),
        lambda: wrong.models.retrieve("tiny"),
    ]
    for call in calls:
        with pytest.raises(openai.AuthenticationError) as refused:
            call()
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
        assert WRONG not in refused.value.response.text
    endpoints = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models")]
    for method, path in endpoints:
        for headers in [{}, {"Authorization": KEYS[0]}, {"Authorization": f"Basic {KEYS[0]}"}, keyed(WRONG)]:
            r = httpx.request(method, f"{server.url}{path}", json=CHAT, headers=headers)
            assert error_of(r, 401)["code"] == "invalid_api_key"
            assert r.headers["WWW-Authenticate"] == "Bearer"
            assert not any(secret in r.text for secret in (*KEYS, WRONG))
    for path in ("/health", "/ready"):
        assert httpx.get(f"{server.url}{path}").status_code == 200


def test_metrics_need_the_metrics_key_not_an_api_key(server):
    assert error_of(httpx.get(f"{server.url}/metrics"), 401)["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/metrics", headers=keyed(KEYS[0])).status_code == 401
    r = httpx.get(f"{server.url}/metrics", headers=keyed(METRICS_KEY))
    assert r.status_code == 200 and "ddtree_requests_total" in r.text
    refused = 'ddtree_requests_total{endpoint="/v1/completions",status="401"}'
    assert refused in r.text  # a refused request is still counted
    assert httpx.get(f"{server.url}/v1/models", headers=keyed(METRICS_KEY)).status_code == 401


def test_oversized_requests_are_refused_in_under_2_s_while_a_normal_request_completes(server):
    client = openai_client(server, KEYS[1])
    normal: list[str] = []
    done = threading.Event()

    def keep_generating() -> None:
        while not done.is_set():
            r = client.completions.create(model="tiny", prompt="def fib", max_tokens=8, temperature=0)
            normal.append(r.choices[0].finish_reason)

    worker = threading.Thread(target=keep_generating)
    before = resident_mb(server.proc.pid)
    worker.start()
    try:
        big = b"x" * (100 << 20)
        chunks = (big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20))
        oversized = [
            ("100 MB with Content-Length", {"content": big}, 413, "request_too_large"),
            ("100 MB chunked, no length", {"content": chunks}, 413, "request_too_large"),
            ("10 million characters", {"json": {"prompt": "a" * 10_000_000}}, 400, "context_length_exceeded"),
            ("a million token ids", {"json": {"prompt": [1] * 1_000_000}}, 400, "context_length_exceeded"),
        ]
        headers = keyed(KEYS[1]) | {"Content-Type": "application/json"}
        for what, body, status, code in oversized:
            start = time.monotonic()
            r = httpx.post(f"{server.url}/v1/completions", headers=headers, timeout=30, **body)
            elapsed = time.monotonic() - start
            assert error_of(r, status)["code"] == code, what
            assert elapsed < 2, f"{what}: {elapsed:.2f} s"
        grown = resident_mb(server.proc.pid) - before
        assert grown < 200, f"the server grew by {grown:.0f} MB"
    finally:
        done.set()
        worker.join(60)
    assert normal and set(normal) <= {"length", "stop"}


def test_work_is_bounded_by_n_times_prompts_times_max_tokens(server):
    url, headers = f"{server.url}/v1/completions", keyed()
    fits = {"prompt": ["def", "x"], "n": 2, "max_tokens": 4}  # 16 tokens
    assert httpx.post(url, json=fits, headers=headers, timeout=60).status_code == 200
    too_much = {"prompt": ["def", "x"], "n": 16, "max_tokens": 32}  # 1024 > 1000
    error = error_of(httpx.post(url, json=too_much, headers=headers), 400)
    assert error["code"] == "max_tokens_per_request_exceeded" and error["param"] == "max_tokens"
    assert "1024" in error["message"] and str(MAX_WORK) in error["message"]


def test_chat_is_held_to_the_same_limits(server):
    url, headers = f"{server.url}/v1/chat/completions", keyed()
    unbounded = {"messages": CHAT["messages"], "n": 16}  # no max_tokens: the rest of the context each
    assert 16 * (CONTEXT - 1) > MAX_WORK
    error = error_of(httpx.post(url, json=unbounded, headers=headers), 400)
    assert error["code"] == "max_tokens_per_request_exceeded"
    long = {"messages": [{"role": "user", "content": "a" * 500_000}] * 20, "max_tokens": 4}  # 10 M chars
    start = time.monotonic()
    error = error_of(httpx.post(url, json=long, headers=headers, timeout=30), 400)
    assert time.monotonic() - start < 2
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    many = {"messages": [{"role": "user", "content": ""}] * 2049, "max_tokens": 4}
    assert error_of(httpx.post(url, json=many, headers=headers), 400)["param"] == "messages"
    fits = {"messages": [{"role": "user", "content": "hi"}] * 2048, "max_tokens": 4}
    error = error_of(httpx.post(url, json=fits, headers=headers, timeout=60), 400)  # 2048 fit the schema,
    assert error["code"] == "context_length_exceeded"  # not the tiny context


def test_cors_preflight_is_answered_for_the_configured_origin_only(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(f"{server.url}/v1/chat/completions", headers=preflight | {"Origin": ORIGIN})
    assert allowed.status_code == 200
    assert allowed.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "authorization" in allowed.headers["Access-Control-Allow-Headers"].lower()
    other = httpx.options(
        f"{server.url}/v1/chat/completions", headers=preflight | {"Origin": "https://evil.example"}
    )
    assert other.status_code >= 400 and "Access-Control-Allow-Origin" not in other.headers
    answer = httpx.post(
        f"{server.url}/v1/chat/completions", json=CHAT, headers=keyed() | {"Origin": ORIGIN}, timeout=60
    )
    assert answer.status_code == 200 and answer.headers["Access-Control-Allow-Origin"] == ORIGIN


def test_no_key_appears_in_the_log(server):
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers=keyed(WRONG))
    log = server.log()
    assert "POST /v1/completions" in log  # the access log is on: requests are logged, their keys are not
    assert not any(secret in log for secret in (*KEYS, METRICS_KEY, WRONG))
    assert "no API key" not in log and "Traceback" not in log


def test_keys_come_from_repeated_flags_or_else_the_comma_separated_environment_variable():
    parse = build_parser().parse_args
    args = parse(["serve", "--api-key", "a", "b", "--api-key", "c"])
    assert api_keys(args.api_keys, {"DDTREE_API_KEY": "env"}) == ("a", "b", "c")
    args = parse(["serve"])
    assert api_keys(args.api_keys, {"DDTREE_API_KEY": " d, e ,,"}) == ("d", "e")
    assert api_keys(args.api_keys, {}) == () and api_keys(args.api_keys, {"DDTREE_API_KEY": ""}) == ()


def test_without_a_key_only_a_server_beyond_loopback_warns():
    assert open_access_warning("0.0.0.0", 8000, ()) is not None
    assert "10.1.2.3:80" in open_access_warning("10.1.2.3", 80, ())
    assert open_access_warning("0.0.0.0", 8000, ("k",)) is None
    for loopback in ("127.0.0.1", "::1", "localhost"):
        assert open_access_warning(loopback, 8000, ()) is None


@pytest.mark.parametrize("flag", ["--max-request-bytes", "--max-tokens-per-request"])
def test_limits_below_one_are_refused_before_binding(flag):
    args = build_parser().parse_args(["serve", "--port", "1", flag, "0"])  # port 1 would fail to bind
    with pytest.raises(DDTreeError, match=f"{flag} must be >= 1"):
        serve(args, lambda _: None)
