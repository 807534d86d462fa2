"""Queue limits, disconnects and timeouts, held still by an engine whose rounds wait for the test.

The server runs in this process (uvicorn on a thread, real sockets on 127.0.0.1) so the test can gate
the engine: each round waits for a permit, so "one request running, two waiting" is a state the test
sets up and inspects through ``/metrics``, not a race.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from ddtree.engine import Engine
from ddtree.request.params import SamplingParams
from ddtree.server import ServerConfig, create_app
from tests.conftest import tiny_models
from tests.server_helpers import ThreadServer, metric, scrape, sse_events


class GatedEngine:
    """A real engine whose decode rounds take one permit per step; everything else passes through.

    A step that only admits (nothing running yet) passes freely, so a request reaches the batch at once.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.permits = threading.Semaphore(0)
        self.rounds = 0
        self.aborted = threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def open(self) -> None:
        self.permits.release(1_000_000)

    def step(self):
        if self.engine.num_running:
            self.permits.acquire()
            self.rounds += 1
        return self.engine.step()

    def abort(self, request_id: str) -> bool:
        self.aborted.set()
        return self.engine.abort(request_id)


@pytest.fixture(scope="module")
def engine() -> Engine:
    """Batches of one, so "one request running, the rest waiting" is what the tests set up."""
    tokenizer, target, drafter = tiny_models()
    return Engine(target, drafter, tokenizer, budget=16, max_batch_size=1)


@pytest.fixture
def gated(engine):
    gate = GatedEngine(engine)
    yield gate
    gate.open()  # never leave the engine thread blocked


def serve(gated: GatedEngine, **config) -> ThreadServer:
    return ThreadServer(create_app(lambda: gated, ServerConfig(model_name="tiny", **config)))


def wait_for(url: str, name: str, value: float, timeout: float = 30, **labels: str) -> None:
    deadline = time.monotonic() + timeout
    while metric(scrape(url), name, **labels) != value:
        assert time.monotonic() < deadline, f"{name}{labels} never reached {value}"
        time.sleep(0.02)


BODY = {"model": "tiny", "prompt": "def fib", "max_tokens": 8, "temperature": 0}


def test_a_full_queue_answers_429_with_retry_after_at_once(gated):
    with serve(gated, max_queue=2) as server, ThreadPoolExecutor(3) as pool:

        def post() -> httpx.Response:
            return httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=60)

        running = pool.submit(post)
        wait_for(server.url, "ddtree_requests_running", 1)
        waiting = [pool.submit(post) for _ in range(2)]
        wait_for(server.url, "ddtree_queue_depth", 2)
        start = time.monotonic()
        refused = post()
        assert time.monotonic() - start < 5
        assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 1
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and set(error) == {"message", "type", "param", "code"}
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        gated.open()
        assert [f.result().status_code for f in [running, *waiting]] == [200] * 3
        samples = scrape(server.url)
        assert metric(samples, "ddtree_requests_total", endpoint="/v1/completions", status="429") == 2
        assert metric(samples, "ddtree_queue_depth") == 0


def test_a_disconnected_stream_stops_its_generation_and_frees_its_slot(gated):
    gated.permits.release(2)
    with serve(gated, max_queue=1) as server:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
                "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            first = next(line for line in r.iter_lines() if line.startswith("data: "))
            assert '"role": "assistant"' in first
        wait_for(server.url, "ddtree_requests_cancelled_total", 1, reason="disconnect")
        gated.open()
        wait_for(server.url, "ddtree_requests_running", 0)
        assert gated.aborted.wait(10)  # the engine's request was aborted...
        assert gated.rounds < 40  # ...long before max_tokens
        samples = scrape(server.url)
        assert metric(samples, "ddtree_generation_tokens_total") < 40
        assert metric(samples, "ddtree_queue_depth") == 0
        again = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=30)
        assert again.status_code == 200  # the slot is free


def test_a_request_past_its_timeout_gets_504_and_frees_the_engine(gated):
    with serve(gated, request_timeout=0.5) as server:
        late = httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=30)
        assert late.status_code == 504 and late.json()["error"]["code"] == "request_timeout"
        streamed = httpx.post(f"{server.url}/v1/completions", json=BODY | {"stream": True}, timeout=30)
        assert streamed.status_code == 504  # still queued behind the first: no stream was started
        assert metric(scrape(server.url), "ddtree_requests_cancelled_total", reason="timeout") == 2
        gated.open()
        wait_for(server.url, "ddtree_requests_running", 0)
        assert httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=30).status_code == 200


def test_max_queue_0_serves_one_request_at_a_time_and_refuses_the_rest(gated):
    with serve(gated, max_queue=0) as server, ThreadPoolExecutor(1) as pool:
        running = pool.submit(httpx.post, f"{server.url}/v1/completions", json=BODY, timeout=60)
        wait_for(server.url, "ddtree_requests_running", 1)
        assert httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=30).status_code == 429
        gated.open()
        assert running.result().status_code == 200
        assert httpx.post(f"{server.url}/v1/completions", json=BODY, timeout=30).status_code == 200


class FaultyEngine:
    """A real engine with one internal fault: the second delta of the request for ``POISON`` carries
    logprobs that are not logprobs, so turning that request's output into pieces raises on the engine
    thread. (The engine refuses at ``add_request`` whatever cannot fit the context, so no request can fail
    mid-generation through the API: a fault like this one is the only way to make one.)"""

    POISON = [5, 6, 7]

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.poisoned: dict[str, int] = {}  # request id -> deltas seen

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def add_request(self, prompt, params=None, **options) -> str:
        request_id = self.engine.add_request(prompt, params, **options)
        if prompt == self.POISON:
            self.poisoned[request_id] = 0
        return request_id

    def step(self):
        deltas = self.engine.step()
        for delta in deltas:
            if delta.request_id in self.poisoned:
                self.poisoned[delta.request_id] += 1
                if self.poisoned[delta.request_id] == 2:
                    delta.logprobs = [None] * len(delta.token_ids)
        return deltas


def test_a_request_that_fails_mid_generation_fails_alone_with_an_error_event(engine):
    tokenizer, target, drafter = tiny_models()
    batched = Engine(target, drafter, tokenizer, budget=16, max_batch_size=4)
    prompts = ["def fib", "import os", "x = 1"]
    params = SamplingParams(max_new_tokens=12, logprobs=1, ignore_eos=True)
    expected = [batched.generate(p, params).text for p in prompts]
    faulty = FaultyEngine(batched)
    body = {
        "model": "tiny",
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
        "stream": True,
    }
    with ThreadServer(create_app(lambda: faulty, ServerConfig(model_name="tiny"))) as server:

        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
                posts = [
                    http.post("/v1/completions", json=body | {"prompt": p}) for p in [*prompts, faulty.POISON]
                ]
                return await asyncio.gather(*posts)

        *companions, failed = asyncio.run(main())
        events = sse_events(failed.text.splitlines())
        assert failed.status_code == 200 and events[-1] == "[DONE]"
        assert events[-2]["error"]["type"] == "server_error"  # after the pieces it had sent
        assert any(e.get("choices") for e in events[:-2])
        for answer, text in zip(companions, expected, strict=True):
            events = sse_events(answer.text.splitlines())
            assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
            assert "".join(e["choices"][0]["text"] for e in events[:-1]) == text
            assert events[-2]["choices"][0]["finish_reason"] == "length"
        samples = scrape(server.url)
        assert metric(samples, "ddtree_num_requests_running") == 0 and batched.num_running == 0
        assert metric(samples, "ddtree_requests_running") == 0
