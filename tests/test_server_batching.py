"""Continuous batching, on real ``ddtree serve`` processes driven over loopback by real clients.

The module's server runs batches of up to 16 with 64 more waiting; its engine thread sleeps 10 ms before
each step (``DDTREE_TEST_STEP_DELAY``) so requests overlap long enough to be seen side by side.
"""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from tests.conftest import save_models
from tests.server_helpers import metric, scrape, server_env, serving, sse_events

PROMPTS = ["def fib", "import os", "return n", "    if n < 2:", "fibonacci(", "class A:", "x = 1", "# note"]
STEP_DELAY = "0.01"


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("batching-models"))


def start_server(model_dirs, log, *flags, step_delay: str = STEP_DELAY):
    """A ready server on the tiny models for a ``with`` block, its steps ``step_delay`` seconds apart."""
    target, drafter = model_dirs
    args = ["--target", target, "--drafter", drafter, "--budget", 16, "--served-model-name", "tiny", *flags]
    return serving(args, log, env=server_env(DDTREE_TEST_STEP_DELAY=step_delay))


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    log = tmp_path_factory.mktemp("batching-log") / "server.log"
    with start_server(model_dirs, log, "--max-batch-size", 16, "--max-queue", 64) as proc:
        yield proc


def body(prompt: str, max_tokens: int, **extra) -> dict:
    return {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    } | extra


async def stream_text(http: httpx.AsyncClient, request: dict) -> tuple[int, str, list]:
    """(status, the streamed text, every event); a 4xx body comes back as its single event."""
    r = await http.post("/v1/completions", json=request)
    if r.status_code != 200:
        return r.status_code, "", [r.json()]
    events = sse_events(r.text.splitlines())
    text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))
    return 200, text, events


def run_concurrently(url: str, requests: list[dict]) -> list[tuple[int, str, list]]:
    async def main():
        limits = httpx.Limits(max_connections=len(requests))
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(stream_text(http, r) for r in requests))

    return asyncio.run(main())


def one_at_a_time(url: str, requests: list[dict]) -> list[str]:
    out = []
    for request in requests:
        status, text, events = run_concurrently(url, [request])[0]
        assert status == 200 and events[-1] == "[DONE]"
        out.append(text)
    return out


def five_hundreds(samples: dict) -> list[dict]:
    """Every 5xx answer but /ready's 503 while the model loaded."""
    answers = [dict(labels) for name, labels in samples if name == "ddtree_requests_total"]
    return [a for a in answers if a["status"].startswith("5") and a["endpoint"] != "/ready"]


def test_64_concurrent_streams_all_answer_200_and_equal_the_same_requests_sent_one_at_a_time(server):
    distinct = [body(p, n) for p in PROMPTS for n in (6, 20)]  # 16 requests, finishing at different steps
    alone = one_at_a_time(server.url, distinct)
    before = scrape(server.url)
    requests = distinct * 4
    results = run_concurrently(server.url, requests)
    assert len(results) == 64  # none lost
    for (status, text, events), expected in zip(results, alone * 4, strict=True):
        assert status == 200, events
        assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1] if isinstance(e, dict))
        assert text == expected
    after = scrape(server.url)
    ok = {"endpoint": "/v1/completions", "status": "200"}
    assert metric(after, "ddtree_requests_total", **ok) - metric(before, "ddtree_requests_total", **ok) == 64
    assert not five_hundreds(after)
    # They ran side by side: some step advanced a full batch of 16 rows, and none more than that.
    full = metric(after, "ddtree_step_rows_bucket", le="16.0") - metric(
        after, "ddtree_step_rows_bucket", le="8.0"
    )
    assert full > 0
    assert metric(after, "ddtree_step_rows_bucket", le="16.0") == metric(after, "ddtree_step_rows_count")
    assert metric(after, "ddtree_num_requests_running") == metric(after, "ddtree_num_requests_waiting") == 0


def test_a_request_past_the_context_fails_alone_with_a_400_while_its_companions_complete(server):
    companions = [body(p, 20) for p in PROMPTS]
    alone = one_at_a_time(server.url, companions)
    overflow = body("def fib", 100)  # the tiny model's context is 64 tokens
    chat_overflow = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    requests = companions[:4] + [overflow] + companions[4:]

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            chat = http.post("/v1/chat/completions", json=chat_overflow)
            return await asyncio.gather(chat, *(stream_text(http, r) for r in requests))

    chat, *results = asyncio.run(main())
    failed = results.pop(4)
    assert failed[0] == 400 and failed[2][0]["error"]["code"] == "context_length_exceeded"
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "context_length_exceeded"
    assert [r[0] for r in results] == [200] * len(companions)
    assert [r[1] for r in results] == alone
    assert all(r[2][-1] == "[DONE]" for r in results)
    assert not five_hundreds(scrape(server.url))


def rows_steps(samples: dict, rows: int) -> float:
    """Steps so far that advanced exactly ``rows`` rows (a power of two: a bucket's upper bound)."""
    below = metric(samples, "ddtree_step_rows_bucket", le=f"{rows // 2:.1f}") if rows > 1 else 0.0
    return metric(samples, "ddtree_step_rows_bucket", le=f"{rows:.1f}") - below


def test_a_client_that_disconnects_mid_stream_frees_its_row_within_one_step(model_dirs, tmp_path):
    """Steps of 100 ms here, so the test sees the disconnect within the step under way."""
    with start_server(model_dirs, tmp_path / "disconnect.log", step_delay="0.1") as proc:
        check_a_disconnect_frees_its_row_within_one_step(proc.url)


def check_a_disconnect_frees_its_row_within_one_step(url: str) -> None:
    long = body("def fib", 20, ignore_eos=True)
    companion: dict = {}
    thread = threading.Thread(
        target=lambda: companion.update(
            r=httpx.post(f"{url}/v1/completions", json=long | {"stream": False}, timeout=60)
        )
    )
    before = scrape(url)
    with httpx.stream("POST", f"{url}/v1/completions", json=long, timeout=60) as r:
        thread.start()
        deadline = time.monotonic() + 30
        while metric(scrape(url), "ddtree_num_requests_running") != 2:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert any(line.startswith("data: ") for line in r.iter_lines())
    while metric(noticed := scrape(url), "ddtree_requests_cancelled_total", reason="disconnect") == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    # The server has queued the abort: the step under way may still carry both rows, no later one does.
    while metric(scrape(url), "ddtree_num_requests_running") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    thread.join(60)
    assert companion["r"].status_code == 200
    assert companion["r"].json()["usage"]["completion_tokens"] == 20  # the companion went on to the end
    done = scrape(url)
    assert rows_steps(done, 2) - rows_steps(noticed, 2) <= 1
    assert metric(done, "ddtree_num_requests_running") == 0
    dropped = (
        metric(done, "ddtree_generation_tokens_total") - metric(before, "ddtree_generation_tokens_total") - 20
    )
    assert dropped < 10  # the dropped stream stopped long before its 20 tokens


def test_sigterm_with_a_full_batch_and_a_queue_completes_every_request_and_exits_0(model_dirs, tmp_path):
    flags = ["--max-batch-size", 4, "--max-queue", 4, "--shutdown-timeout", 60]
    with start_server(model_dirs, tmp_path / "drain.log", *flags, step_delay="0.02") as proc:
        requests = [body(p, 30, ignore_eos=True) for p in PROMPTS]  # 4 running, 4 waiting
        results: list = []
        client = threading.Thread(target=lambda: results.extend(run_concurrently(proc.url, requests)))
        client.start()
        deadline = time.monotonic() + 30
        while True:
            samples = scrape(proc.url)
            if (
                metric(samples, "ddtree_num_requests_running") == 4
                and metric(samples, "ddtree_queue_depth") == 4
            ):
                break
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.terminate()
        client.join(120)
        assert [status for status, _, _ in results] == [200] * 8
        for _, _, events in results:
            assert events[-1] == "[DONE]"
            assert [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]][-1] == "length"
        assert proc.wait(60) == 0
    assert "Traceback" not in proc.log()
