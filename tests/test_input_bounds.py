"""Every value a request carries is bounded where it enters (docs/inputs.md): the server's models and
``SamplingParams`` refuse what the engine's float32 tensors, samplers or tokenizer could not take, with one
line naming the field, and whatever they accept runs. Issue 45's hostile values each get a 400; drawn ones
(extreme floats, huge integers, odd ``logit_bias`` keys, lone surrogates) either fail validation cleanly or
generate without an error."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.request.params import (
    LOGIT_BIAS_RANGE,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
)
from ddtree.server import ServerConfig, create_app
from tests.conftest import save_models

VOCAB = 290  # the tiny models' LM head rows
PROMPT = "def f(x):"


def examples(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple:
    return save_models(tmp_path_factory.mktemp("bounds-models"))


@pytest.fixture(scope="module")
def engine(models) -> Engine:
    return Engine.from_pretrained(*models, budget=8)


@pytest.fixture(scope="module")
def http(models):
    served = Engine.from_pretrained(*models, budget=8)
    with TestClient(
        create_app(lambda: served, ServerConfig(model_name="tiny")), raise_server_exceptions=False
    ) as c:
        deadline = time.monotonic() + 60
        while c.get("/ready").status_code != 200:
            assert time.monotonic() < deadline, c.get("/ready").text
            time.sleep(0.02)
        yield c


def post(http: TestClient, path: str, body: dict):
    """JSON as a hostile client writes it: lone surrogates as ``\\ud800`` escapes, NaN and Infinity bare."""
    return http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def completion(**fields) -> dict:
    return {"prompt": PROMPT, "max_tokens": 2, "temperature": 1.0, "seed": 1} | fields


def chat(content, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2} | fields


TOOL = {"type": "function", "function": {"name": "f", "description": "a\ud800", "parameters": {}}}
HOSTILE = [
    ("/v1/completions", completion(top_k=2**63 - 1), "top_k"),
    ("/v1/completions", completion(top_k=MAX_TOP_K + 1), "top_k"),
    ("/v1/completions", completion(repetition_penalty=1e-300), "repetition_penalty"),
    ("/v1/completions", completion(repetition_penalty=1e300), "repetition_penalty"),
    ("/v1/completions", completion(temperature=1e300), "temperature"),
    ("/v1/completions", completion(logit_bias={"²": 1.0}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"١": 1.0}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"-1": 1.0}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={str(VOCAB): 1.0}), "logit_bias"),
    ("/v1/completions", completion(logit_bias={"5": 1e300}), "logit_bias"),
    ("/v1/completions", completion(prompt="a\ud800b"), "prompt"),
    ("/v1/completions", completion(prompt=["ok", "a\udfffb"]), "prompt[1]"),
    ("/v1/completions", completion(stop=["\n", "\ud800"]), "stop[1]"),
    ("/v1/completions", completion(bad_words=["\ud800"]), "bad_words[0]"),
    ("/v1/completions", completion(model="\ud800"), "model"),
    ("/v1/chat/completions", chat("a\ud800b"), "messages[0].content"),
    ("/v1/chat/completions", chat([{"type": "text", "text": "\udc00"}]), "messages[0].content[0].text"),
    ("/v1/chat/completions", chat("hi", tools=[TOOL]), "tools[0].function.description"),
    ("/v1/chat/completions", chat("hi", chat_template_kwargs={"x": ["\ud800"]}), "chat_template_kwargs.x[0]"),
    ("/tokenize", {"prompt": "a\ud800b"}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
]


@pytest.mark.parametrize(("path", "body", "param"), HOSTILE, ids=[f"{p} {q}" for p, _, q in HOSTILE])
def test_each_hostile_value_is_a_one_line_400_naming_its_field(http, path, body, param):
    response = post(http, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0] in error["message"] and "\n" not in error["message"]


LO, HI = REPETITION_PENALTY_RANGE
EDGES = [
    completion(top_k=MAX_TOP_K),
    completion(top_k=-1, temperature=MAX_TEMPERATURE, stream=True),
    completion(repetition_penalty=LO, presence_penalty=-2, frequency_penalty=-2, temperature=1e-5),
    completion(repetition_penalty=HI, presence_penalty=2, frequency_penalty=2),
    completion(logit_bias={"0": LOGIT_BIAS_RANGE[0], str(VOCAB - 1): LOGIT_BIAS_RANGE[1]}),
    completion(logit_bias={"007": 1.0}, prompt="²١ \U0001f600"),
]


@pytest.mark.parametrize("body", EDGES)
def test_the_bounds_themselves_generate(http, body):
    response = post(http, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert '"error"' not in response.text


@pytest.mark.parametrize("method", ["ddtree", "ar"])
def test_a_top_k_above_the_vocabulary_samples_as_no_top_k(engine, method):
    """As vLLM: a top_k past the vocabulary keeps every token, whatever its size up to the bound."""
    runs = [
        engine.generate(
            PROMPT, SamplingParams(temperature=1.0, top_k=k, seed=3, max_new_tokens=6), method=method
        )
        for k in (0, VOCAB + 1, MAX_TOP_K)
    ]
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids


# -- drawn values: whatever validates runs ------------------------------------------------------------

# Values that break float32, int64, float64's exact integers or the tokenizer weigh two thirds of a draw.
BREAKING_FLOATS = [float("nan"), float("inf"), -float("inf"), 5e-324, 1e-300, 1e-45, 3.5e38, 1e300, -1e300]
EXTREME_FLOATS = st.one_of(
    st.sampled_from(BREAKING_FLOATS), st.sampled_from([-0.0, 1e-5, 0.01, 2.0, 100.0, 1e6]), st.floats()
)
BREAKING_INTS = [-(2**63) - 1, -1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**70]
HUGE_INTS = st.one_of(
    st.sampled_from(BREAKING_INTS), st.sampled_from([0, 1, VOCAB - 1, VOCAB, MAX_TOP_K]), st.integers()
)
ODD_TEXT = st.text(
    alphabet=st.sampled_from(["a", " ", "\n", "²", "١", "7", "\ud800", "\udfff", "\U0001f600"]), max_size=5
) | st.text(max_size=5)


def in_range(lo: float, hi: float) -> st.SearchStrategy[float]:
    return st.floats(lo, hi) | st.sampled_from([lo, hi])


def fields(required: dict, valid: dict, hostile: dict, field: str | None) -> st.SearchStrategy[dict]:
    """Fields in range (their edges included) but ``field``, drawn from anything of its kind: one field out
    of range at a time (several would hide each other behind the first error)."""
    others = st.fixed_dictionaries(required, optional={k: v for k, v in valid.items() if k != field})
    if field is None:
        return others
    return st.tuples(others, hostile[field]).map(lambda drawn: drawn[0] | {field: drawn[1]})


VALID = {
    "temperature": in_range(0, 2) | st.sampled_from([1e-5, MAX_TEMPERATURE]),
    "top_k": st.integers(-1, VOCAB + 1) | st.just(MAX_TOP_K),
    "top_p": st.floats(0, 1, exclude_min=True),
    "min_p": in_range(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "presence_penalty": in_range(-2, 2),
    "frequency_penalty": in_range(-2, 2),
    "repetition_penalty": in_range(*REPETITION_PENALTY_RANGE),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1), in_range(*LOGIT_BIAS_RANGE), max_size=2),
    "stop": st.lists(st.text(min_size=1, max_size=4), max_size=2),
    "bad_words": st.lists(st.text(alphabet="abc \n", min_size=1, max_size=4), max_size=2),
}
FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
HOSTILE = {name: EXTREME_FLOATS for name in FLOATS} | {
    "top_k": HUGE_INTS,
    "seed": HUGE_INTS,
    "logit_bias": st.dictionaries(HUGE_INTS, EXTREME_FLOATS, min_size=1, max_size=2),
    "stop": st.lists(ODD_TEXT, min_size=1, max_size=2),
    "bad_words": st.lists(ODD_TEXT, min_size=1, max_size=2),
}
PARAMS = (
    {"max_new_tokens": st.integers(1, 3)},
    VALID | {"min_tokens": st.integers(0, 1), "logprobs": st.integers(0, 20)},
    HOSTILE | {"min_tokens": HUGE_INTS, "logprobs": HUGE_INTS},
)


@pytest.mark.parametrize("field", [None, *sorted(PARAMS[2])])
@examples(20)
@given(data=st.data(), method=st.sampled_from(["ddtree", "dflash", "ar"]))
def test_sampling_params_that_validate_run_in_the_engine(engine, field, data, method):
    options = data.draw(fields(*PARAMS, field))
    try:
        params = SamplingParams(**options)
    except DDTreeError:
        return
    try:
        engine.add_request(PROMPT, params, method=method)
    except DDTreeError:  # checked against the model: a bias outside the vocabulary, a word without tokens
        return
    while engine.has_unfinished_requests():
        for delta in engine.step():
            assert delta.finish_reason != "error", (options, delta.error)
            assert all(0 <= t < VOCAB for t in delta.token_ids), (options, delta.token_ids)


def json_keys(bias: st.SearchStrategy[dict]) -> st.SearchStrategy[dict]:
    return bias.map(lambda d: {str(k): v for k, v in d.items()})


BODY = (
    {"prompt": st.text(min_size=1, max_size=5), "max_tokens": st.integers(1, 3)},
    VALID | {"logit_bias": json_keys(VALID["logit_bias"]), "stream": st.booleans()},
    HOSTILE
    | {
        "prompt": ODD_TEXT,
        "logit_bias": json_keys(HOSTILE["logit_bias"])
        | st.dictionaries(ODD_TEXT, EXTREME_FLOATS, max_size=2),
    },
)


@pytest.mark.parametrize("field", [None, *sorted(BODY[2])])
@examples(20)
@given(data=st.data(), chat_form=st.booleans())
def test_request_bodies_that_validate_run_in_the_engine(http, field, data, chat_form):
    body = data.draw(fields(*BODY, field))
    path = "/v1/completions"
    if chat_form:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
        path = "/v1/chat/completions"
    response = post(http, path, body)
    assert response.status_code in (200, 400), (body, response.text)
    if response.status_code == 400:
        message = response.json()["error"]["message"]
        assert message and "\n" not in message, (body, message)
    else:
        assert '"error"' not in response.text, (body, response.text)
