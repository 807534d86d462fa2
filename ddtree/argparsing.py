"""argparse as every ``ddtree`` command uses it: one-line errors and defaults shown in ``--help``.

Kept apart from ``ddtree.cli`` because ``ddtree.bench`` and ``ddtree.training`` build their parsers with it
and ``ddtree.cli`` imports them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path

from ddtree.errors import DDTreeError
from ddtree.request.params import DTYPE_CHOICES


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Each option's default after its help (as vLLM and HF tools do), except the uninformative None, False
    and []; descriptions and epilogs keep their line breaks, so examples read as typed."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (``ddtree: error: ...``, exit 2, no usage dump) like ours."""

    def __init__(self, *args, formatter_class: type = HelpFormatter, **kwargs) -> None:
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        raise DDTreeError(message)


def comma_list(kind: Callable[[str], object], flag: str):
    """An argparse type for a comma-separated list of ``kind`` (``1,2,4``); errors name the flag's value."""

    def parse(text: str) -> tuple:
        try:
            values = tuple(kind(v.strip()) for v in text.split(",") if v.strip())
        except (ValueError, argparse.ArgumentTypeError):
            raise argparse.ArgumentTypeError(f"{flag} must be a comma-separated list, got {text!r}") from None
        if not values:
            raise argparse.ArgumentTypeError(f"{flag} is empty")
        return values

    return parse


def add_threads_option(p: argparse.ArgumentParser) -> None:
    """``--threads``: torch's CPU threads, for the commands that run the engine (generate, serve, bench)."""
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        metavar="N",
        help="torch CPU threads (default: the cores not busy with other work, from the 1-minute load "
        "average; OMP_NUM_THREADS, when set, is kept). Oversubscribed cores are many times slower",
    )


def default_threads(torch_default: int, cores: int, load: float) -> int:
    """Threads for a CPU shared with other work: torch's default (one per core), less the cores the load
    average says are busy, at least one.

    Measured on a 2-core machine (docs/benchmarks.md): with one core busy elsewhere, torch's 2 threads
    decode the quick start at 31 tokens/s and 1 thread at 129 (OpenMP threads spin waiting for the one
    that lost its core); on an idle machine both give 136."""
    return max(1, min(torch_default, cores - round(load)))


def check_threads(threads: int | None) -> None:
    """``--threads``' check, before any model is loaded (``serve`` checks before it binds)."""
    if threads is not None and threads < 1:
        raise DDTreeError(f"--threads must be >= 1, got {threads}")


def apply_threads(threads: int | None) -> int:
    """Set torch's CPU threads from ``--threads`` (None: ``default_threads``); returns the count set."""
    import torch

    check_threads(threads)
    if threads is None:
        if os.environ.get("OMP_NUM_THREADS"):
            return torch.get_num_threads()  # the user's own choice, already applied by torch
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
        threads = default_threads(torch.get_num_threads(), cores, load)
    torch.set_num_threads(threads)
    return threads


def add_load_options(p: argparse.ArgumentParser) -> None:
    """Where the models come from and how they are loaded (``Engine.from_pretrained``'s keywords)."""
    p.add_argument(
        "--target", type=Path, default=None, help="HF target model directory (the built-in one if omitted)"
    )
    p.add_argument(
        "--drafter", type=Path, default=None, help="DFlash drafter directory (the built-in one if omitted)"
    )
    p.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1, ...")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="weights and KV cache; auto = the checkpoint's (float32 for small bf16/fp16 "
                   "checkpoints (under 100M parameters) on a CPU, where it is faster)")  # fmt: skip
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let a tokenizer that ships as code in the target's directory (Kimi's) run it; "
                   "the model always runs transformers' own classes")  # fmt: skip
    add_threads_option(p)
