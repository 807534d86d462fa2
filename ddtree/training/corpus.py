"""The training corpus: the Python standard library's own source, the one real text every install carries.

What goes in (``docs/models.md`` repeats this): every regular ``*.py`` file under
``sysconfig.get_paths()["stdlib"]``, read as UTF-8 with newlines untouched, except

* test suites: any directory named ``test`` or ``tests`` and any file named ``test_*.py``;
* ``idlelib`` (mostly a GUI and its own tests) and ``site-packages`` (third-party code);
* ``__pycache__``, and ``pydoc_data`` (a 750 KB generated dict of documentation prose);
* build-specific files: ``_sysconfigdata_*.py`` and the ``config-*`` directory;
* generated charmap codecs (``encodings/*.py`` whose header names ``gencodec.py``): 1.2 MB of hex tables.

``lib2to3`` (minus its tests), ``turtledemo`` and ``ensurepip`` stay: they are ordinary hand-written code.
Files come in sorted relative-path order. About 2% of files are held out *by file*, chosen by a hash
of the relative path, so the split is stable across machines and never leaks a held-out file into training.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from ddtree.errors import DDTreeError

Split = Literal["train", "heldout"]

HELDOUT_PER_MILLE = 20  # ~2% of files
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "pydoc_data"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel: str) -> bool:
    """Stable split: sha256 of the relative POSIX path, not Python's salted ``hash``."""
    digest = hashlib.sha256(rel.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < HELDOUT_PER_MILLE


def _keep(path: Path, root: Path) -> bool:
    rel = path.relative_to(root)
    if any(part in _SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
        return False
    name = rel.name
    if name.startswith("test_") or name.startswith("_sysconfigdata_") or not path.is_file():
        return False
    if rel.parts[0] == "encodings":
        with open(path, "rb") as f:
            if b"gencodec.py" in f.read(1024):
                return False
    return True


def corpus_files(split: Split, root: Path | None = None) -> list[Path]:
    """The files of one split, sorted by relative path. ``root`` defaults to this interpreter's stdlib."""
    if split not in ("train", "heldout"):
        raise DDTreeError(f"split must be 'train' or 'heldout', got {split!r}")
    root = stdlib_root() if root is None else Path(root)
    if not root.is_dir():
        raise DDTreeError(f"corpus root {root} is not a directory")
    files = sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix())
    want_heldout = split == "heldout"
    return [p for p in files if _keep(p, root) and is_heldout(p.relative_to(root).as_posix()) == want_heldout]


def read_text(path: Path) -> str:
    """Exact file text: ``newline=""`` keeps ``\\r\\n`` as written, so the tokenizer sees the real bytes."""
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def corpus_texts(split: Split, root: Path | None = None) -> Iterator[str]:
    for path in corpus_files(split, root):
        yield read_text(path)
