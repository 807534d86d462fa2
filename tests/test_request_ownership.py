"""The scheduler is the one place a step changes a request (issue 35): proposer, verifier, auto budget and
engine compute results and hand them to ``Scheduler.update_from_output``; only the scheduler (with its
block manager, which keeps the requests' block tables) assigns or mutates a request's state."""

import ast
import dataclasses
from pathlib import Path

from ddtree.engine.request import GenerationStats, Request

ROOT = Path(__file__).resolve().parents[1] / "ddtree"
OWNERS = {"engine/scheduler.py", "engine/block_manager.py", "engine/request.py"}
FIELDS = {f.name for f in dataclasses.fields(Request)} | {f.name for f in dataclasses.fields(GenerationStats)}
MUTATORS = {"append", "extend", "write", "accept", "pop", "clear", "insert", "update", "remove"}
OUTPUT_FIELDS = {"finish_reason"}  # OutputState's, written through a request
REQUEST_NAMES = {"r", "request", "req", "rows", "batch", "drafting", "slots", "running", "waiting"}


def _chain(node: ast.AST) -> list[str]:
    """``r.stats.drafted_nodes`` -> ["r", "stats", "drafted_nodes"]; subscripts are looked through."""
    names = []
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Attribute):
            names.append(node.attr)
        node = node.value
    names.append(node.id if isinstance(node, ast.Name) else "?")
    return names[::-1]


def _writes_request(chain: list[str]) -> bool:
    """A chain from a request (by the names the engine gives them: ``r``, ``request``, ``rows[i]``,
    ``batch[i]``, ``c.request`` ...) to one of its fields."""
    if chain[0] not in REQUEST_NAMES:
        if "request" not in chain[1:-1]:
            return False
        chain = chain[chain.index("request", 1) :]
    fields = chain[1:]
    return bool(fields) and (fields[0] in FIELDS or fields[-1] in OUTPUT_FIELDS and "output" in fields)


def request_writes(source: str) -> list[str]:
    """Assignments to, and mutating calls on, request state in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            targets = [node.func.value] if node.func.attr in MUTATORS else []
        for t in targets:
            if isinstance(t, (ast.Attribute, ast.Subscript)) and _writes_request(_chain(t)):
                found.append(f"line {t.lineno}: {ast.unparse(t)}")
    return found


def test_only_the_scheduler_writes_request_state():
    offenders = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in OWNERS or rel.split("/")[0] in ("server", "bench", "training"):
            continue  # the server, bench and training see StreamDeltas and their own rows, not Requests
        writes = request_writes(path.read_text())
        if writes:
            offenders[rel] = writes
    assert not offenders, offenders


def test_the_check_sees_each_kind_of_write():
    """It cannot pass vacuously: assignments, augmented ones, subscripts and mutating calls on a request's
    state are found; a part's own attributes and plain reads are not."""
    source = """
def f(self, r, rows, out):
    r.start += 3
    rows[0].root = 5
    r.stats.stage_seconds["draft"] += 1.0
    r.features.append(out)
    r.output.write([1], None)
    r.grammar.accept([1])
    request.output.finish_reason = "abort"
    chunk.request.computed += 2
    self.budget = 4
    self.status.drafting = True
    result.stats = None
    x = r.start + r.root
"""
    writes = request_writes(source)
    assert len(writes) == 8, writes
    assert not any("self." in w for w in writes)
    scheduler = (ROOT / "engine/scheduler.py").read_text()
    assert len(request_writes(scheduler)) > 10  # the owner does write them
