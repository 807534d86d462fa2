"""Large bodies are read off the event loop (issue 45, item 4): the same answers, and no stream stalls.

A body over ``LARGE_BODY_BYTES`` is decoded and validated in a parse process; the answers must be exactly
those of the same document sent small (read by FastAPI on the loop), errors included. On a live server, a
stream keeps its pace while a 14 MiB body is read: before, it got no chunk for as long as the body took to
parse (1.25 s for this one; 6.3 s for a list of 400,000 prompts).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from ddtree.engine import Engine
from ddtree.server import ServerConfig, create_app
from ddtree.server.body import LARGE_BODY_BYTES, BodyParser
from ddtree.server.protocol import CompletionRequest
from tests.conftest import save_models
from tests.server_helpers import ServerProcess

JSON = {"content-type": "application/json"}
COMPLETION = {"model": "tiny", "prompt": "def fib", "max_tokens": 6, "temperature": 0}
DOCUMENTS = [
    ("/v1/completions", json.dumps(COMPLETION)),
    ("/v1/completions", json.dumps(COMPLETION | {"prompt": list(range(1, 9)), "n": 2})),
    (
        "/v1/chat/completions",
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}),
    ),
    ("/tokenize", json.dumps({"prompt": "def fib(n):"})),
    ("/v1/completions", json.dumps(COMPLETION | {"top_k": "9"})),  # a wrong type
    ("/v1/completions", json.dumps(COMPLETION | {"bogus": 1})),  # an unknown field
    ("/v1/completions", json.dumps(COMPLETION | {"logit_bias": {"²": 1}})),
    ("/v1/completions", json.dumps({"max_tokens": 4})),  # a required field missing
    ("/v1/completions", json.dumps({"prompt": "a\ud800b"})),  # not Unicode text
    ("/v1/completions", "[1, 2]"),  # not an object
    ("/v1/completions", '{"prompt": "x"'),  # not JSON
    ("/v1/chat/completions", "[" * 5000 + "]" * 5000),  # nested too deep for json.loads
]


class CountingParser(BodyParser):
    def __init__(self) -> None:
        super().__init__()
        self.bodies = 0

    async def parse(self, model, body):
        self.bodies += 1
        return await super().parse(model, body)


class FailingParser(BodyParser):
    """A parse process that dies with every body."""

    async def parse(self, model, body):
        raise ConnectionResetError("the parse process died")


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    return Engine.from_pretrained(*save_models(tmp_path_factory.mktemp("large-body-models")), budget=16)


def client(engine: Engine, parser: BodyParser) -> TestClient:
    app = create_app(lambda: engine, ServerConfig(model_name="tiny"))
    app.state.body_parser = parser
    return TestClient(app, raise_server_exceptions=False)


def answers(http: TestClient, padding: int) -> list[tuple[int, object]]:
    """Each document's status and answer, sent with ``padding`` spaces after it (JSON whitespace)."""
    out = []
    for path, document in DOCUMENTS:
        response = http.post(path, content=document + " " * padding, headers=JSON)
        body = response.json()
        for volatile in ("id", "created"):
            body.pop(volatile, None)
        body.get("usage", {}).pop("prompt_tokens_details", None)  # the second time, the prompt is cached
        out.append((response.status_code, body))
    return out


@pytest.mark.parametrize("parser", [CountingParser, FailingParser])
def test_a_large_body_gets_the_answer_the_same_document_gets_small(engine, parser):
    with client(engine, parser()) as http:
        while http.get("/ready").status_code != 200:
            time.sleep(0.02)
        small = answers(http, 0)
        large = answers(http, LARGE_BODY_BYTES)
    assert [status for status, _ in small] == [200] * 4 + [400] * 8
    assert large == small
    if parser is CountingParser:
        assert http.app.state.body_parser.bodies == len(DOCUMENTS)


def test_a_stream_keeps_its_pace_while_a_14_mib_body_is_parsed(tmp_path):
    bias = {"prompt": "x", "max_tokens": 4, "logit_bias": {str(i): 1.0 for i in range(1_000_000)}}
    body = json.dumps(bias).encode()
    start = time.perf_counter()
    try:
        CompletionRequest.model_validate(json.loads(body))
    except ValueError:
        pass
    parse_seconds = time.perf_counter() - start  # what the loop would stall for, on this machine
    proc = ServerProcess(["--threads", "1", "--served-model-name", "tiny"], tmp_path / "server.log")
    try:
        proc.wait_ready()
        url = f"{proc.url}/v1/completions"
        warm = httpx.post(
            url, content=json.dumps(COMPLETION) + " " * LARGE_BODY_BYTES, headers=JSON, timeout=120
        )
        assert warm.status_code == 200, warm.text  # the parse process has started
        chunks: list[float] = []
        posted = threading.Event()

        def stream() -> None:
            request = {"prompt": "def fib", "max_tokens": 1500, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", url, json=request, timeout=120) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(time.perf_counter())
                    if posted.is_set():
                        return

        reader = threading.Thread(target=stream)
        reader.start()
        while len(chunks) < 10:
            time.sleep(0.01)
        sent = time.perf_counter()
        answer = httpx.post(url, content=body, headers=JSON, timeout=120)
        answered = time.perf_counter()
        posted.set()
        reader.join(60)
    finally:
        proc.close()
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "logit_bias"
    during = [t for t in chunks if sent <= t <= answered]
    gaps = [b - a for a, b in zip(chunks, chunks[1:], strict=False) if b >= sent and a <= answered]
    assert len(during) >= 2, (len(during), answered - sent)
    assert max(gaps) < parse_seconds / 2, (max(gaps), parse_seconds)
