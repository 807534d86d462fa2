"""The package's import graph: no module imports one that (at any depth, lazily or not) imports it back;
only ``typing.TYPE_CHECKING`` imports, which never run, are left out."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ddtree"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path, modules: set[str]) -> set[str]:
    """The ddtree modules ``path`` imports anywhere in its code, TYPE_CHECKING blocks excepted."""
    tree = ast.parse(path.read_text())
    skipped = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    out = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddtree"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in modules else node.module)
        elif isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names if alias.name.startswith("ddtree")}
    return out & modules


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_its_way_back_to_itself():
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {name: imported(path, set(paths)) - {name} for name, path in paths.items()}
    assert sum(map(len, graph.values())) > 100  # the graph was read
    assert cycles(graph) == []


def test_the_cycle_finder_sees_a_lazy_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "xgrammar", "safetensors")


def test_the_command_line_builds_without_model_or_web_code():
    """`ddtree --help` and every subcommand's help (and argument errors) answer in about a second: building
    the parser imports none of the heavy libraries, which each subcommand imports when it runs."""
    script = (
        "import sys\n"
        "from ddtree.cli import build_parser\n"
        "parser = build_parser()\n"
        "for argv in (['--help'], ['generate', '--help'], ['serve', '--help'], ['bench', '--help'],\n"
        "             ['bench', 'serve', '--help'], ['train', 'drafter', '--help'],\n"
        "             ['train', 'target', '--help']):\n"
        "    try:\n"
        "        parser.parse_args(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"
