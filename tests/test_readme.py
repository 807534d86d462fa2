"""The README's Python snippet runs as written, on the built-in models."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def test_the_readme_python_snippet_runs_as_written_and_does_what_it_says(capsys):
    """It prints a sampled completion with its finish reason and tau, then streams a greedy one; its
    batch of two gives each prompt's solo output."""
    from ddtree import SamplingParams

    snippet = next(block for block in python_blocks() if "from ddtree import" in block)
    scope = {"__name__": "readme"}
    exec(compile(snippet, str(README), "exec"), scope)
    printed = capsys.readouterr().out
    engine, result, results = scope["engine"], scope["result"], scope["results"]
    first = f"{result.text} {result.finish_reason} {result.stats.tau}\n"
    assert result.text and result.finish_reason in ("stop", "length") and result.stats.tau >= 1.0
    assert printed.startswith(first)
    streamed = printed[len(first) :]
    assert streamed and streamed == engine.generate("import os", SamplingParams(max_new_tokens=64)).text
    assert len(results) == 2
    for prompt, batched in zip(["def add(a, b):", "class Stack:"], results, strict=True):
        assert 0 < len(batched.token_ids) <= 32
        assert batched.token_ids == engine.generate(prompt, SamplingParams(max_new_tokens=32)).token_ids
