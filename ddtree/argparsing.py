"""argparse as every ``ddtree`` command uses it: one-line errors and defaults shown in ``--help``.

Kept apart from ``ddtree.cli`` because ``ddtree.bench`` and ``ddtree.training`` build their parsers with it
and ``ddtree.cli`` imports them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

from ddtree.errors import DDTreeError
from ddtree.params import DTYPE_CHOICES, memory_size


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


def add_draft_topk(p: argparse.ArgumentParser) -> None:
    """``--draft-topk``: named apart from the sampling ``--top-k``; ``--topk`` still works (hidden)."""
    help_ = (
        "ddtree: cap on tree candidates per depth (SGLang's --speculative-eagle-topk; default: the budget)"
    )
    p.add_argument("--draft-topk", dest="topk", type=int, default=None, metavar="K", help=help_)
    p.add_argument("--topk", dest="topk", type=int, default=None, help=argparse.SUPPRESS)


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


BUCKET_FLAGS = (  # (flag, metavar letter, help) of each fixed-shape dimension --compile captures
    (
        "--batch-buckets",
        "B",
        "with --compile: the batch sizes to compile, comma-separated, the largest being the "
        "maximum batch size (default: 1, 2, 4, ... up to it); fewer buckets start faster",
    ),
    (
        "--node-buckets",
        "N",
        "with --compile: the tree sizes to compile (root included), comma-separated; the "
        "largest must hold the budget plus one (default: 1, 2, 3, 5, 9, 17, ... up to it)",
    ),
    (
        "--span-buckets",
        "S",
        "with --compile: cache columns attention may read, comma-separated; the whole row is always "
        "one (the default: only it); on a CPU, a few smaller spans make short rows read less",
    ),
)


def add_compile_options(p: argparse.ArgumentParser) -> None:
    """``--compile`` and the fixed shapes it captures (``Engine(compile=True, batch_buckets=...)``)."""
    p.add_argument(
        "--compile",
        action="store_true",
        help="pad every round to fixed shapes and torch.compile the target and drafter forwards "
        "(CUDA graphs on CUDA); every shape compiles at start-up, which takes minutes on a CPU",
    )
    for flag, metavar, text in BUCKET_FLAGS:
        p.add_argument(
            flag, type=comma_list(int, flag), default=None, metavar=f"{metavar}1,{metavar}2,...", help=text
        )
    p.add_argument(
        "--attention-backend",
        choices=["sdpa", "flex"],
        default="sdpa",
        help="with --compile: 'flex' reads each row's own KV blocks up to its length (FlexAttention over the "
        "paged pool) instead of a span of every row (default: sdpa)",
    )


def check_compile_options(args: argparse.Namespace, max_batch_size: int) -> None:
    """The bucket flags' checks that need no model, so a bad list fails before any weight is loaded."""
    from ddtree.capture import check_batch_buckets, check_buckets

    if not args.compile:
        for flag, _, _ in BUCKET_FLAGS:
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                raise DDTreeError(f"{flag} needs --compile")
        if args.attention_backend != "sdpa":
            raise DDTreeError(f"--attention-backend {args.attention_backend} needs --compile")
        return
    if args.attention_backend == "flex" and args.span_buckets is not None:
        raise DDTreeError("--span-buckets is for --attention-backend sdpa; flex reads each row's own length")
    check_batch_buckets("--batch-buckets", args.batch_buckets, max_batch_size)
    check_buckets("--node-buckets", args.node_buckets)
    check_buckets("--span-buckets", args.span_buckets)


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


def add_memory_options(p: argparse.ArgumentParser) -> None:
    """The model's precision and memory, under vLLM's flag names."""
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto",
                   help="weights and KV cache; auto = the checkpoint's (float32 for small bf16/fp16 "
                   "checkpoints on a CPU without native bf16 matmuls, where it is faster)")  # fmt: skip
    p.add_argument("--max-model-len", type=int, default=None, metavar="N",
                   help="tokens per request, prompt and output (default: the model's context)")  # fmt: skip
    p.add_argument("--kv-cache-memory", type=memory_size, default=None, metavar="SIZE",
                   help="KV cache bytes (4GiB, 512MiB, ...); wins over --gpu-memory-utilization")  # fmt: skip
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                   help="share of the device's memory (on a CPU, of the RAM available) the engine may "
                   "use: the KV cache gets what weights and activations leave")  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, metavar="N",
                   help="tokens a step may prefill; longer prompts are prefilled in chunks, between "
                   "rounds of the running requests")  # fmt: skip
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks (and the drafter's context) of prompt prefixes that earlier "
                   "requests computed, instead of prefilling them again")  # fmt: skip


def add_trust_remote_code(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trust-remote-code", action="store_true",
                   help="let a tokenizer that ships as code in the target's directory (Kimi's) run it; "
                   "the model always runs transformers' own classes")  # fmt: skip


def memory_options(args: argparse.Namespace) -> dict:
    """``add_memory_options``' flags as ``Engine`` arguments (``--dtype`` goes to the loader)."""
    return {
        "max_model_len": args.max_model_len,
        "kv_cache_memory": args.kv_cache_memory,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "block_size": args.block_size,
        "enable_prefix_caching": args.enable_prefix_caching,
    }
