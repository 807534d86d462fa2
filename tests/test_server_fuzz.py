"""Property-based fuzzing of every endpoint (hypothesis): whatever a client sends, the answer is never a 5xx.

Bodies are built field by field from the request schema, each field either plausible or any JSON value
(NaN and infinities included), plus unknown fields, arbitrary JSON documents, raw bytes and odd
methods and paths. The app runs in process with the real tiny engine, so sampling values that reach the
engine are exercised too. Every test runs twice: on an open app, and on one that needs an API key (the
client sends it, except where a test draws the Authorization header itself). Derandomized, so CI runs
the same few hundred examples every time.
"""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree.engine import Engine
from ddtree.server import ServerConfig, create_app
from tests.conftest import save_models


def fuzz(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def maybe(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly a plausible value, sometimes any JSON at all."""
    return st.one_of(valid, valid, valid, json_values)


SPECULATIVE = st.booleans() | st.fixed_dictionaries(
    {},
    optional={
        "method": st.sampled_from(["ddtree", "dflash", "ar", "medusa"]),
        "budget": st.integers(-1, 300),
        "topk": st.integers(-1, 40),
    },
)
COMMON = {
    "model": st.sampled_from(["tiny", "tiny", "gpt-4", ""]),
    "max_tokens": st.integers(-1, 70),
    "temperature": st.floats(-1, 3) | st.sampled_from([0.0, 1e-300, 1e-6, 1e-5, 1e300]),
    "top_p": st.floats(-0.5, 1.5) | st.sampled_from([1e-300, 1.0]),
    "top_k": st.integers(-3, 400),
    "min_p": st.floats(-0.5, 1.5),
    "n": st.integers(-1, 3),
    "seed": st.integers(-(2**64), 2**65),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "speculative": SPECULATIVE,
    "presence_penalty": st.floats(-1, 1),
    "logit_bias": st.dictionaries(st.text(max_size=3), st.floats(-5, 5), max_size=2),
    "user": st.text(max_size=5),
}
PROMPT = st.one_of(
    st.text(max_size=24),
    st.lists(st.integers(-3, 400), max_size=8),
    st.lists(st.text(max_size=8), max_size=3),
    st.lists(st.lists(st.integers(0, 300), max_size=5), max_size=3),
)
MESSAGE = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
    optional={
        "content": maybe(
            st.text(max_size=16)
            | st.lists(
                st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=8)}), max_size=2
            )
        ),
        "name": st.text(max_size=4),
    },
)
EXTRA = st.dictionaries(
    st.sampled_from(["bogus", "functions", "suffix", "best_of", "echo"]), json_values, max_size=1
)


def body(required: dict, optional: dict) -> st.SearchStrategy[dict]:
    fields = st.fixed_dictionaries(
        {k: maybe(v) for k, v in required.items()}, optional={k: maybe(v) for k, v in optional.items()}
    )
    return st.tuples(fields, EXTRA).map(lambda t: t[0] | t[1])


COMPLETIONS = body(
    {"prompt": PROMPT},
    COMMON | {"logprobs": st.integers(-1, 22), "echo": st.booleans(), "best_of": st.integers(0, 3)},
)
CHATS = body(
    {"messages": st.lists(MESSAGE, max_size=3)},
    COMMON
    | {
        "logprobs": st.booleans(),
        "top_logprobs": st.integers(-1, 22),
        "max_completion_tokens": st.integers(-1, 70),
        "tools": st.lists(st.just({"type": "function"}), max_size=1),
        "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    },
)

# Plausible requests: every field valid on its own (edge values included), so most reach the engine.
VOCAB = 290
VALID = {
    "model": st.just("tiny"),
    "max_tokens": st.integers(1, 24),
    "temperature": st.floats(0, 2) | st.sampled_from([0.0, 1e-300, 1e-6, 1e-5, 50.0, 1e300]),
    "top_p": st.floats(1e-9, 1) | st.just(1e-300),
    "top_k": st.integers(-1, 400),
    "min_p": st.floats(0, 1),
    "n": st.integers(1, 3),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "speculative": st.booleans()
    | st.fixed_dictionaries(
        {},
        optional={
            "method": st.sampled_from(["ddtree", "dflash", "ar"]),
            "budget": st.integers(1, 300),
            "topk": st.integers(1, 40),
        },
    ),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100), max_size=2),
    "min_tokens": st.integers(0, 2),
    "user": st.text(max_size=5),
}
VALID_PROMPT = st.one_of(
    st.text(min_size=1, max_size=24),
    st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8),
    st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=2),
    st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5), min_size=1, max_size=2),
)
VALID_MESSAGE = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "developer", "user", "assistant"]),
        "content": st.text(max_size=12)
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=6)}), max_size=2),
    }
)
VALID_COMPLETIONS = st.fixed_dictionaries(
    {"prompt": VALID_PROMPT}, optional=VALID | {"logprobs": st.integers(0, 20)}
)
VALID_CHATS = st.fixed_dictionaries(
    {"messages": st.lists(VALID_MESSAGE, min_size=1, max_size=2)},
    optional=VALID | {"logprobs": st.just(True), "top_logprobs": st.integers(0, 20)},
)


KEY = "fuzz-key"
AUTHORIZATION = st.sampled_from(
    [f"Bearer {KEY}", f"Bearer {KEY}", f"bearer {KEY}", "Bearer wrong", "Basic x", ""]
)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    return Engine.from_pretrained(*save_models(tmp_path_factory.mktemp("fuzz-models")), budget=16)


@pytest.fixture(scope="module", params=["open", "keyed"])
def http(engine, request):
    keys = (KEY,) if request.param == "keyed" else ()
    app = create_app(lambda: engine, ServerConfig(model_name="tiny", api_keys=keys))
    headers = {"Authorization": f"Bearer {KEY}"} if keys else {}
    with TestClient(app, raise_server_exceptions=False, headers=headers) as c:
        deadline = time.monotonic() + 60
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, c.get("/ready").text
            time.sleep(0.02)
        yield c


def post(http: TestClient, path: str, document) -> object:
    """JSON as Python writes it: NaN and Infinity included, which strict encoders refuse to send."""
    return http.post(path, content=json.dumps(document), headers={"content-type": "application/json"})


def check(response, request_body=None) -> None:
    """No 5xx; errors in OpenAI's shape; successes well formed."""
    assert response.status_code < 500, (request_body, response.text)
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        return
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert not any("error" in json.loads(e) for e in events[:-1]), (request_body, events)
        return
    answer = response.json()
    if isinstance(answer, dict) and "choices" in answer:
        assert all(c["finish_reason"] in ("stop", "length") for c in answer["choices"])
        assert (
            answer["usage"]["total_tokens"]
            == answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        )


@fuzz(60)
@given(request_body=VALID_COMPLETIONS)
def test_fuzz_plausible_completions(http, request_body):
    check(post(http, "/v1/completions", request_body), request_body)


@fuzz(50)
@given(request_body=VALID_CHATS)
def test_fuzz_plausible_chat_completions(http, request_body):
    check(post(http, "/v1/chat/completions", request_body), request_body)


@fuzz(60)
@given(request_body=COMPLETIONS)
def test_fuzz_hostile_completions(http, request_body):
    check(post(http, "/v1/completions", request_body), request_body)


@fuzz(60)
@given(request_body=CHATS)
def test_fuzz_hostile_chat_completions(http, request_body):
    check(post(http, "/v1/chat/completions", request_body), request_body)


@fuzz(60)
@given(
    path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"]),
    document=json_values,
    raw=st.binary(max_size=40),
    content_type=st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"]),
    authorization=AUTHORIZATION,
)
def test_fuzz_arbitrary_documents_and_bytes(http, path, document, raw, content_type, authorization):
    check(post(http, path, document), document)
    headers = {"content-type": content_type, "authorization": authorization}
    response = http.post(path, content=raw, headers=headers)
    check(response, raw)
    keyed = "authorization" in http.headers
    if keyed and path.startswith("/v1") and authorization.lower() != f"bearer {KEY}":
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"


@fuzz(60)
@given(
    method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]),
    path=st.sampled_from(
        [
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/models",
            "/v1/models/tiny",
            "/health",
            "/ready",
            "/metrics",
            "/",
            "/v1",
            "/docs",
            "/openapi.json",
        ]
    )  # fmt: skip
    | st.text(
        alphabet=st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#%"), max_size=20
    ).map(lambda s: "/" + s),
    authorization=AUTHORIZATION,
)
def test_fuzz_methods_and_paths(http, method, path, authorization):
    response = http.request(method, path, headers={"authorization": authorization})
    assert response.status_code < 500, (method, path, response.text)
