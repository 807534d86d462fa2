"""``ddtree`` command line: ``generate`` streams a continuation; ``serve`` runs the OpenAI-compatible
server; ``bench`` compares methods side by side; ``train`` builds models.

User mistakes print one line (``ddtree: error: ...``) and exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ddtree.bench.cli import register_bench
from ddtree.errors import DDTreeError
from ddtree.training.cli import register as register_train


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors are one line like ours (no usage dump)."""

    def error(self, message: str):
        raise DDTreeError(message)


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """Model and method flags, shared by every command that runs the engine."""
    p.add_argument("--target", type=Path, default=None, help="HF target model directory (default: built-in)")
    p.add_argument("--drafter", type=Path, default=None, help="DFlash drafter directory (default: built-in)")
    p.add_argument("--method", choices=["ddtree", "dflash", "ar"], default="ddtree")
    p.add_argument("--budget", type=int, default=64, help="draft tree nodes per round (ddtree)")
    p.add_argument("--topk", type=int, default=None, help="cap on candidates per tree depth")
    p.add_argument("--device", default="cpu")


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddtree", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    gen = sub.add_parser("generate", help="generate a continuation of PROMPT (streamed)")
    gen.add_argument("prompt")
    _add_engine_options(gen)
    _add_sampling_options(gen)
    gen.add_argument("--stats", action="store_true", help="print speculative-decoding stats to stderr")
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    _add_engine_options(srv)
    _add_server_options(srv)
    srv.set_defaults(func=_serve)
    register_bench(sub)
    register_train(sub)
    return parser


def engine_from_args(args: argparse.Namespace):
    """Build the engine the flags describe; the built-in pair when no model directory is given.

    The drafter is loaded whenever there is one, also for ``--method ar``: a server's requests may still
    ask for speculation per request.
    """
    from ddtree.engine import Engine
    from ddtree.models import DEFAULT_DRAFTER, DEFAULT_TARGET

    target = args.target or DEFAULT_TARGET
    drafter = args.drafter
    if drafter is None and args.target is None:
        drafter = DEFAULT_DRAFTER
    if drafter is None and args.method != "ar":
        raise DDTreeError(
            f"method {args.method!r} needs --drafter when --target is given (or use --method ar)"
        )
    if args.target is None and not DEFAULT_TARGET.is_dir():
        raise DDTreeError("the built-in models are not installed; pass --target (and --drafter)")
    batch = {"max_batch_size": args.max_batch_size} if "max_batch_size" in args else {}  # serve
    return Engine.from_pretrained(
        target, drafter, method=args.method, budget=args.budget, topk=args.topk, device=args.device, **batch
    )


def _generate(args: argparse.Namespace) -> None:
    from ddtree.params import SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
    )
    engine = engine_from_args(args)
    if engine.tokenizer is None:
        raise DDTreeError(f"target {args.target} has no tokenizer; text prompts need one")
    deltas = engine.stream(args.prompt, params)  # validates the request before anything is printed
    sys.stdout.write(args.prompt)
    delta = None
    for delta in deltas:
        sys.stdout.write(delta.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        stats = delta.stats.as_dict()
        stats["finish_reason"] = delta.finish_reason
        lengths = stats.pop("acceptance_lengths")  # one per round: summarised, the JSON stays readable
        stats["acceptance_histogram"] = {n: lengths.count(n) for n in sorted(set(lengths))}
        print(json.dumps(stats, indent=2), file=sys.stderr)


def _add_server_options(p: argparse.ArgumentParser) -> None:
    from ddtree.server.run import add_server_options

    add_server_options(p)


def _serve(args: argparse.Namespace) -> None:
    from ddtree.server.run import serve

    serve(args, engine_from_args)


def main(argv: list[str] | None = None) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the CLI's stderr is for our stats and errors
    try:
        args = build_parser().parse_args(argv)
        args.func(args)
    except DDTreeError as exc:
        print(f"ddtree: error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
