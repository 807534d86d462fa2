"""The README's Python snippet runs as written, on the built-in models."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_the_readme_python_snippet_runs_as_written(capsys):
    snippet = next(block for block in python_blocks() if "from ddtree import" in block)
    exec(compile(snippet, str(README), "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out
    assert printed.strip()  # the generated text and its stats
