"""One structured-output request's constraint never touches another's: a compile past the bound is killed
(its CPU and memory come back) and answers its own request with a 400 while ordinary constraints compile
beside it; past the compile slots a request gets a 429; JSON schemas that xgrammar would not enforce are
refused naming what, never followed loosely."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.model.loader import DEFAULT_TARGET, load_tokenizer
from ddtree.request import grammar
from ddtree.request.grammar import GrammarCompiler
from ddtree.request.params import StructuredOutputs
from ddtree.server import ServerConfig, create_app
from tests.conftest import save_models
from tests.server_helpers import ThreadServer

BOUND = 2.0  # seconds of compiling allowed in these tests


def slow_schema(required_count: int) -> dict:
    """The issue's 5 KB schema: 200 optional integer properties, ``minProperties`` of them present. It
    takes xgrammar 0.2.9 ~8 s (4,096-token vocabulary) and ~+150 MB; each count is a new constraint."""
    properties = {f"p{i}": {"type": "integer"} for i in range(200)}
    return {"type": "object", "properties": properties, "minProperties": required_count}


def ordinary_schema(i: int) -> dict:
    """A new constraint for each ``i`` (the title), compiling in milliseconds."""
    properties = {"name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}}
    return {"title": f"person {i}", "type": "object", "properties": properties, "required": ["name", "n"]}


def descendants() -> dict[int, float]:
    """{pid: CPU seconds used so far} of every process below this one (compile processes among them)."""
    parent_of, cpu = {}, {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # not a process, or gone meanwhile
            continue
        parent_of[int(entry.name)] = int(fields[1])
        cpu[int(entry.name)] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    below, grew = {os.getpid()}, True
    while grew:
        more = {pid for pid, parent in parent_of.items() if parent in below} - below
        below |= more
        grew = bool(more)
    return {pid: cpu[pid] for pid in below - {os.getpid()}}


def own_memory(pid: int) -> int:
    """KiB only ``pid`` maps (read while it is idle: /proc waits on a process that is allocating)."""
    lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    return sum(
        int(line.split()[1]) for line in lines if line.startswith(("Private_Clean:", "Private_Dirty:"))
    )


def cpu_over(interval: float) -> dict[int, float]:
    """{pid: CPU seconds} the processes below this one use in the next ``interval`` seconds."""
    before = descendants()
    time.sleep(interval)
    return {pid: cpu - before.get(pid, 0.0) for pid, cpu in descendants().items()}


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler(load_tokenizer(DEFAULT_TARGET), vocab_size=4096)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> Engine:
    return Engine.from_pretrained(*save_models(tmp_path_factory.mktemp("isolation-models")), budget=16)


@pytest.fixture
def server(engine, monkeypatch):
    monkeypatch.setattr(grammar, "COMPILE_SECONDS", BOUND)
    with ThreadServer(create_app(lambda: engine, ServerConfig(model_name="tiny"))) as served:
        ask(served.url, ordinary_schema(-1))  # the compile processes' forkserver is up
        yield served.url


def ask(url: str, schema: dict) -> tuple[httpx.Response, float]:
    """A completion under ``schema`` and its latency."""
    body = {"model": "tiny", "prompt": "def", "max_tokens": 8, "structured_outputs": {"json": schema}}
    start = time.perf_counter()
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    return reply, time.perf_counter() - start


def test_slow_schemas_get_a_400_while_ordinary_ones_beside_them_answer_in_their_own_time(server):
    replies: dict[str, tuple[httpx.Response, float]] = {}
    requests = {f"slow {i}": slow_schema(100 - i) for i in range(2)}
    requests |= {f"ordinary {i}": ordinary_schema(i) for i in range(4)}
    threads = [
        threading.Thread(target=lambda k=key, s=schema: replies.__setitem__(k, ask(server, s)))
        for key, schema in requests.items()
    ]
    for thread in threads:
        thread.start()
    # The slow compiles run in processes below this one (niced: on a busy machine they may wait a while).
    deadline = time.monotonic() + BOUND
    while sum(cpu_over(0.2).values()) < 0.02:
        assert time.monotonic() < deadline
    for thread in threads:
        thread.join(60)
    for key in requests:
        reply, seconds = replies[key]
        if key.startswith("slow"):
            assert reply.status_code == 400, reply.text
            assert f"did not compile within {BOUND:g} s" in reply.json()["error"]["message"]
        else:
            assert reply.status_code == 200, reply.text
            assert seconds < BOUND / 2, (key, seconds)  # never waited behind a slow compile
    time.sleep(0.2)
    assert sum(cpu_over(1.0).values()) < 0.1  # the killed compiles' CPU came back...
    assert max(map(own_memory, descendants())) < 64 << 10  # ...and their memory
    reply, seconds = ask(server, slow_schema(100))
    assert reply.status_code == 400 and seconds < 0.5  # the verdict is remembered: no second compile


def test_past_the_compile_slots_a_new_constraint_gets_a_429_with_retry_after(server, monkeypatch):
    monkeypatch.setattr(grammar, "COMPILE_PROCESSES", 1)
    monkeypatch.setattr(grammar, "COMPILES_WAITING", 0)
    slow: list = []
    thread = threading.Thread(target=lambda: slow.append(ask(server, slow_schema(90))))
    thread.start()
    time.sleep(BOUND / 4)
    full, _ = ask(server, ordinary_schema(100))
    thread.join(60)
    assert full.status_code == 429, full.text
    assert full.headers["Retry-After"] == "1" and full.json()["error"]["code"] == "grammar_compiles_full"
    assert slow[0][0].status_code == 400
    assert ask(server, ordinary_schema(100))[0].status_code == 200  # refusals are not remembered


UNENFORCEABLE = {
    "allOf with 2 members": {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "string"}}, "required": ["b"]},
        ]
    },
    "allOf with 2 members (at #/properties/x)": {
        "type": "object",
        "properties": {"x": {"allOf": [{"type": "integer"}, {"type": "string"}]}},  # unsatisfiable
    },
    "a $ref that does not point into the schema itself": {"$ref": "https://example.com/person.json"},
    "a $ref that does not point into the schema itself ('#person'": {
        "$defs": {"p": {"$anchor": "person", "type": "integer"}},
        "$ref": "#person",
    },
    "not (at #)": {"not": {"type": "string"}},
    "if/then/else": {"if": {"type": "string"}, "then": {"minLength": 3}},
    "dependentRequired": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "dependentRequired": {"a": ["b"]},
    },
    "uniqueItems (at #/properties/tags)": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    },
    "contains": {"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}},
    "an enum or const value of no allowed type": {"type": "integer", "enum": ["a"]},
    "$ref beside minimum": {
        "$defs": {"n": {"type": "integer"}},
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/n", "minimum": 5}},
    },
    "anyOf beside type": {"type": "integer", "anyOf": [{"minimum": 5}, {"maximum": 0}]},
    "oneOf with overlapping": {"oneOf": [{"type": "integer"}, {"type": "number"}]},  # xgrammar's warning
    "pattern combined with minLength/maxLength": {"type": "string", "pattern": "^a+$", "maxLength": 2},
}


@pytest.mark.parametrize("feature", list(UNENFORCEABLE))
def test_a_schema_xgrammar_would_not_enforce_is_refused_naming_what(compiler, feature):
    with pytest.raises(DDTreeError, match="cannot be enforced") as info:
        compiler.compile(StructuredOutputs.of_schema(UNENFORCEABLE[feature]))
    assert feature in str(info.value) and "\n" not in str(info.value)


ENFORCED = {  # schema, an instance it forbids, one it allows
    "single-member allOf": ({"allOf": [{"type": "integer"}], "title": "n"}, '"s"', "1"),
    "local $ref": (
        {"$defs": {"n": {"type": "integer"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}},
        '{"a": "s"}',
        '{"a": 1}',
    ),
    "recursive $ref": (
        {"$defs": {"t": {"type": "object", "properties": {"c": {"$ref": "#/$defs/t"}}}}, "$ref": "#/$defs/t"},
        '{"c": 1}',
        '{"c": {}}',
    ),
    "optional field as pydantic writes it": (
        {
            "type": "object",
            "properties": {"x": {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}},
            "required": ["x"],
        },
        '{"x": 1}',
        '{"x": null}',
    ),
    "disjoint oneOf": ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true", '"s"'),
    "enum of several types": ({"type": ["string", "integer"], "enum": ["a", 1]}, "2", "1"),
}


@pytest.mark.parametrize("case", list(ENFORCED))
def test_what_xgrammar_enforces_still_compiles_and_is_enforced(compiler, case):
    schema, forbidden, allowed = ENFORCED[case]
    compiled = compiler.compile(StructuredOutputs(json=json.dumps(schema), disable_any_whitespace=True))
    assert isinstance(compiled, xgr.CompiledGrammar)
    assert not _is_grammar_accept_string(compiled.grammar, forbidden)
    assert _is_grammar_accept_string(compiled.grammar, allowed)


def test_the_same_new_constraint_asked_at_once_is_compiled_once_and_answered_alike(compiler, monkeypatch):
    monkeypatch.setattr(grammar, "COMPILE_SECONDS", 1.0)
    errors: list[str] = []

    def compile_slow() -> None:
        try:
            compiler.compile(StructuredOutputs.of_schema(slow_schema(80)))
        except DDTreeError as exc:
            errors.append(str(exc))

    threads = [threading.Thread(target=compile_slow) for _ in range(3)]
    for thread in threads:
        thread.start()
    working: set[int] = set()
    end = time.monotonic() + 0.8  # before the 1 s bound kills the compile and a replacement starts
    while time.monotonic() < end:
        working |= {pid for pid, cpu in cpu_over(0.2).items() if cpu > 0.02}
    assert len(working) <= 1  # one compile process at work, not three (niced: maybe none got the CPU yet)
    for thread in threads:
        thread.join(30)
    assert errors == ["the structured-output constraint did not compile within 1 s"] * 3
