"""Benchmark prompts: the built-in set (code from the corpus's held-out files) or a user's ``.jsonl``.

The built-in prompts are cut from the held-out split of the stdlib corpus (``ddtree.training.corpus``),
so the shipped models never trained on them, and they are the kind of text those models know: each one
ends right after a function's ``def`` line (and its docstring, when it has one), where a code model has
a body to write. They are stored in ``prompts.jsonl`` next to this file so that every machine benchmarks
the same text whatever its Python version; ``python -m ddtree.bench.prompts`` rebuilds that file.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ddtree.errors import DDTreeError

BUILTIN_PROMPTS = Path(__file__).with_name("prompts.jsonl")
_DEF = re.compile(r"^\s*(async\s+)?def \w+\(.*\)( -> .+)?:\s*$")
CONTEXT_LINES = 24  # lines of the file before the def line: enough to show the surrounding code's style
MIN_CHARS, MAX_CHARS = 300, 1200  # ~90-350 tokens with the shipped tokenizer (3.4 bytes/token)
PER_FILE = 4  # spread the set over the files instead of letting turtle.py dominate it


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: ``text`` for a tokenizer, or ready ``token_ids``."""

    id: str
    text: str | None = None
    token_ids: tuple[int, ...] | None = None


def load_prompts(source: str | Path, num_prompts: int | None = None) -> list[Prompt]:
    """``"builtin"`` or a ``.jsonl`` path; the first ``num_prompts`` of them (all when None or 0).

    A JSON line is a string, a list of token ids, or an object with ``"prompt"``/``"text"`` (text) or
    ``"token_ids"`` (ids) and an optional ``"id"`` (the same format ``ddtree train drafter`` reads).
    """
    path = BUILTIN_PROMPTS if str(source) == "builtin" else Path(source)
    if not path.is_file():
        what = "the built-in prompts file" if str(source) == "builtin" else "prompts file"
        raise DDTreeError(f"{what} {path} does not exist")
    if path.suffix != ".jsonl":
        raise DDTreeError(f"prompts file {path} must be a .jsonl file")
    if num_prompts is not None and num_prompts < 0:
        raise DDTreeError(f"--num-prompts must be >= 0, got {num_prompts}")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            prompts.append(_parse(line, f"{path.name}:{n}", f"{path}:{n}"))
    if not prompts:
        raise DDTreeError(f"prompts file {path} holds no prompts")
    return prompts[:num_prompts] if num_prompts else prompts


def _parse(line: str, default_id: str, where: str) -> Prompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DDTreeError(f"{where}: not valid JSON: {exc.msg}") from None
    pid = default_id
    if isinstance(item, dict):
        pid = str(item.get("id", default_id))
        item = item.get("token_ids", item.get("prompt", item.get("text")))
    if isinstance(item, str) and item:
        return Prompt(pid, text=item)
    if isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item):
        return Prompt(pid, token_ids=tuple(item))
    raise DDTreeError(
        f"{where}: expected a non-empty string, a list of token ids, or an object with "
        "'prompt', 'text' or 'token_ids'"
    )


def builtin_prompts_from_corpus(root: Path | None = None) -> list[dict]:
    """Cut the built-in prompts from the held-out files: up to ``PER_FILE`` evenly spread per file.

    They are listed round-robin over the files (every file's first prompt, then every file's second...),
    so that ``--num-prompts 16`` still covers 16 different files.
    """
    from ddtree.training.corpus import corpus_files, read_text, stdlib_root

    root = stdlib_root() if root is None else Path(root)
    per_file = []
    for path in corpus_files("heldout", root):
        lines = read_text(path).splitlines(keepends=True)
        windows = [w for i in range(len(lines)) if (w := _window(lines, i)) is not None]
        step = max(1, len(windows) / PER_FILE)
        chosen = [windows[int(k * step)] for k in range(min(PER_FILE, len(windows)))]
        rel = path.relative_to(root).as_posix()
        per_file.append([{"id": f"{rel}:{line_no}", "prompt": text} for line_no, text in chosen])
    return [rows[k] for k in range(PER_FILE) for rows in per_file if k < len(rows)]


def _window(lines: list[str], i: int) -> tuple[int, str] | None:
    """The text ending at def line ``i`` (plus its docstring), or None when that is no good prompt."""
    if not _DEF.match(lines[i]):
        return None
    end = i + 1
    if end < len(lines) and lines[end].lstrip().startswith(('"""', "'''")):
        quote = lines[end].lstrip()[:3]
        rest = lines[end].lstrip()[3:]
        if quote not in rest:  # a multi-line docstring: take it up to its closing quotes
            end += 1
            while end < len(lines) and quote not in lines[end]:
                end += 1
        end += 1
    text = "".join(lines[max(0, i - CONTEXT_LINES) : end])
    if not MIN_CHARS <= len(text) <= MAX_CHARS:
        return None
    return i + 1, text


if __name__ == "__main__":
    rows = builtin_prompts_from_corpus()
    with open(BUILTIN_PROMPTS, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {len(rows)} prompts to {BUILTIN_PROMPTS}")
