"""Schemathesis over a live ``ddtree serve`` (issue 45, item 6): every operation of the server's
``/openapi.json``, with schema-valid and schema-violating requests, never gets a 5xx nor an answer its
schema does not describe.

Bounded for CI: derandomized, ``EXAMPLES`` requests per operation and generation mode, and a server whose
``--max-tokens-per-request`` keeps every generation short (a longer one is its 400). The schema is the
app's own (``create_app(...).openapi()``, what ``/openapi.json`` serves), read at collection so that each
operation is a test of its own. Hand-made hostile requests are ``test_server_fuzz``'s; this follows the
published schema wherever it leads.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from ddtree.server import ServerConfig, create_app
from tests.conftest import save_models
from tests.server_helpers import ServerProcess

EXAMPLES = int(os.environ.get("DDTREE_SCHEMATHESIS_EXAMPLES", "25"))  # more for a longer hunt
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]
SCHEMA = schemathesis.openapi.from_dict(create_app(lambda: None, ServerConfig(model_name="tiny")).openapi())
OPERATIONS = [result.ok() for result in SCHEMA.get_all_operations()]
CASES = [(op, GenerationMode.POSITIVE) for op in OPERATIONS] + [
    (op, GenerationMode.NEGATIVE)
    for op in OPERATIONS
    if op.body  # a request that can break its schema
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    target, drafter = save_models(tmp_path_factory.mktemp("schemathesis-models"))
    args = ["--target", target, "--drafter", drafter, "--served-model-name", "tiny",
            "--max-tokens-per-request", 64]  # fmt: skip
    proc = ServerProcess(args, tmp_path_factory.mktemp("schemathesis-log") / "server.log")
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.close()
    assert "Traceback" not in proc.log(), proc.log()


@pytest.mark.parametrize(("operation", "mode"), CASES, ids=[f"{op.label}-{mode.value}" for op, mode in CASES])
def test_every_operation_answers_within_its_schema_and_never_with_a_5xx(server, operation, mode):
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(case=operation.as_strategy(generation_mode=mode))
    def call(case) -> None:
        case.call_and_validate(base_url=server.url, checks=CHECKS)

    call()


HI = [{"role": "user", "content": "hi"}]
STREAMS = {
    "POST /v1/completions": {"prompt": "def fib", "max_tokens": 4, "stream": True},
    "POST /v1/chat/completions": {"messages": HI, "max_tokens": 4, "stream": True},
}


@pytest.mark.parametrize("label", STREAMS)
def test_a_streamed_answer_is_the_event_stream_its_schema_describes(server, label):
    operation = next(op for op in OPERATIONS if op.label == label)
    case = operation.Case(body=STREAMS[label], media_type="application/json")
    response = case.call_and_validate(base_url=server.url, checks=CHECKS)
    assert response.headers["content-type"][0].startswith("text/event-stream")
