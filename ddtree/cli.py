"""``ddtree`` command line: ``generate`` streams a continuation; ``serve`` runs the OpenAI-compatible
server; ``bench`` compares methods side by side; ``train`` builds models.

User mistakes print one line (``ddtree: error: ...``) and exit with code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path
from typing import NoReturn

from ddtree import __version__
from ddtree.argparsing import Parser, add_load_options, apply_threads, check_threads
from ddtree.bench.cli import register_bench
from ddtree.config import (
    BATCH_FLAGS,
    COMPILE_FLAGS,
    MEMORY_FLAGS,
    NUMERICS_FLAGS,
    PARALLEL_FLAGS,
    SPECULATIVE_FLAGS,
    EngineConfig,
    add_engine_flags,
)
from ddtree.errors import DDTreeError
from ddtree.server.options import add_server_options
from ddtree.training.cli import register as register_train

DESCRIPTION = """\
Lossless speculative decoding with DDTree over DFlash drafters: generate text, serve an
OpenAI-compatible API, benchmark the methods, or train models. With no --target / --drafter,
every command uses the small built-in model pair."""
GENERATE_EXAMPLES = """examples:
  ddtree generate "def fibonacci(n):" --stats
  echo "import os" | ddtree generate - --temperature 0.7 --seed 1
  ddtree generate --prompt-file prompt.txt --target DIR --drafter DIR --budget 32
  ddtree generate "import os" --device cuda --compile --node-buckets 1,17 --stats"""
SERVE_EXAMPLES = """example:
  ddtree serve --port 8000 &                      # the built-in pair; ddtree serve DIR --drafter DIR: yours
  curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
      -d '{"prompt": "def fibonacci(n):", "max_tokens": 32, "temperature": 0}'
  ddtree serve --device cuda --compile --max-batch-size 8 --batch-buckets 1,2,4,8   # compiled at start-up"""


ENGINE_FLAGS = (
    SPECULATIVE_FLAGS + PARALLEL_FLAGS + MEMORY_FLAGS + COMPILE_FLAGS + NUMERICS_FLAGS
)  # generate, serve


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """Model, method, memory and compile flags, shared by every command that runs the engine."""
    add_load_options(p)
    add_engine_flags(p, ENGINE_FLAGS)


def _add_sampling_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass; 1.0 = off")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p x the top probability")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling (random if omitted)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, help="minus this x a token's count so far")
    p.add_argument("--presence-penalty", type=float, default=0.0, help="minus this once a token has appeared")
    p.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="divide seen tokens' positive logits; 1.0 = off"
    )
    p.add_argument("--min-tokens", type=int, default=0, help="no stop before this many tokens")
    p.add_argument("--bad-word", action="append", default=[], help="a word never completed (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="ddtree", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    gen = sub.add_parser("generate", help="generate a continuation of a prompt (streamed)",
                         description="Stream the target's continuation of PROMPT to stdout.",
                         epilog=GENERATE_EXAMPLES)  # fmt: skip
    gen.add_argument("prompt", nargs="?", default=None, help="the prompt; - reads it from stdin")
    gen.add_argument("--prompt-file", type=Path, default=None, help="read the prompt from this file")
    _add_engine_options(gen)
    _add_sampling_options(gen)
    gen.add_argument("--stats", action="store_true",
                     help="print speculative-decoding stats, stage seconds included, to stderr")  # fmt: skip
    gen.add_argument("--chat", action="store_true",
                     help="the prompt is a user message: the target's chat template renders it, and only "
                     "the answer is printed")  # fmt: skip
    gen.set_defaults(func=_generate)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)",
                         description="Serve the engine over an OpenAI-compatible HTTP API.",
                         epilog=SERVE_EXAMPLES)  # fmt: skip
    srv.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                     help="the target model directory (vLLM's positional model; as --target)")  # fmt: skip
    srv.add_argument("--model", dest="model_flag", type=Path, default=None, metavar="DIR",
                     help="the target model directory (as --target)")  # fmt: skip
    srv.add_argument("--enforce-eager", action="store_true",
                     help="vLLM's: no compiled graphs (the default; refused with --compile)")  # fmt: skip
    _add_engine_options(srv)
    add_engine_flags(srv, BATCH_FLAGS)
    add_server_options(srv)
    srv.set_defaults(func=_serve)
    register_bench(sub)
    register_train(sub)
    return parser


GENERATE_BATCH_SIZE = 1  # ``generate`` runs one request: one row, and one batch shape to compile


def resolve_serve_model(args: argparse.Namespace) -> None:
    """``serve MODEL`` and ``--model DIR`` are ``--target DIR`` (vLLM's spellings); ``--enforce-eager``
    is the uncompiled default, and contradicts ``--compile``."""
    given = [Path(v) for v in (args.model_arg, args.model_flag, args.target) if v is not None]
    if len(set(given)) > 1:
        raise DDTreeError("give the target model once: as MODEL, --model or --target")
    args.target = given[0] if given else None
    if args.enforce_eager and args.compile:
        raise DDTreeError("--enforce-eager and --compile contradict each other; give one")


def check_engine_flags(args: argparse.Namespace):
    """The checks that need no model (every EngineConfig rule, threads, device). Returns the device and
    the config."""
    from ddtree.engine.launch import check_world
    from ddtree.model.loader import check_device

    overrides = {} if "max_num_seqs" in args else {"max_num_seqs": GENERATE_BATCH_SIZE}
    # stage seconds cost a device sync per stage: only with --stats
    config = EngineConfig.from_args(args, profile=bool(getattr(args, "stats", False)), **overrides)
    check_threads(args.threads)
    device = check_device(args.device)
    check_world(config.tensor_parallel_size, device)
    return device, config


def engine_from_args(args: argparse.Namespace):
    """Build the engine the flags describe; the built-in pair when no model directory is given.

    The drafter is loaded whenever there is one, also for ``--method ar``: a server's requests may still
    ask for speculation per request.
    """
    from ddtree.engine import Engine
    from ddtree.model.loader import DEFAULT_DRAFTER, DEFAULT_TARGET

    device, config = check_engine_flags(args)
    args.threads = apply_threads(args.threads)  # before any weight is loaded; --stats and serve report it
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
    return Engine.from_pretrained(
        target, drafter, config, device=device, dtype=args.dtype, trust_remote_code=args.trust_remote_code
    )


def serve_torchrun_rank(args: argparse.Namespace) -> NoReturn:
    """A torchrun rank other than 0: load this rank's shard of the target the flags name, then run rank
    0's steps until it stops, and end the process."""
    from ddtree.engine.rank_worker import ShardSpec, run_torchrun_worker
    from ddtree.model.loader import DEFAULT_TARGET

    device, _ = check_engine_flags(args)
    threads = apply_threads(args.threads)
    target = str(args.target or DEFAULT_TARGET)
    run_torchrun_worker(ShardSpec(target, args.dtype, str(device), args.max_model_len, threads))


def read_prompt(args: argparse.Namespace) -> str:
    """PROMPT, stdin (PROMPT is -) or --prompt-file: exactly one of them."""
    if args.prompt is None and args.prompt_file is None:
        raise DDTreeError("no prompt: give a PROMPT, - to read it from stdin, or --prompt-file FILE")
    if args.prompt is not None and args.prompt_file is not None:
        raise DDTreeError("give a PROMPT or --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            return args.prompt_file.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise DDTreeError(f"cannot read --prompt-file {args.prompt_file}: {exc}") from None
    return sys.stdin.read() if args.prompt == "-" else args.prompt


def _generate(args: argparse.Namespace) -> None:
    from ddtree.request.params import SamplingParams

    prompt = read_prompt(args)
    params = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        stop=tuple(args.stop),
        frequency_penalty=args.frequency_penalty,
        presence_penalty=args.presence_penalty,
        repetition_penalty=args.repetition_penalty,
        min_tokens=args.min_tokens,
        bad_words=tuple(args.bad_word),
    )
    with engine_from_args(args) as engine:  # ``with``: tensor-parallel ranks end with it
        _stream(engine, prompt, params, args)


def _stream(engine, prompt: str, params, args: argparse.Namespace) -> None:
    import torch

    if engine.tokenizer is None:
        raise DDTreeError(f"target {args.target} has no tokenizer; text prompts need one")
    if getattr(args, "chat", False):
        from ddtree.server.chat import render_chat
        from ddtree.server.errors import APIError

        try:
            rendered = render_chat(engine.tokenizer, [{"role": "user", "content": prompt}])
        except APIError as exc:
            raise DDTreeError(str(exc)) from None
        # as the server: the rendered template has its special tokens already
        deltas = engine.stream(engine.encode(rendered, add_special_tokens=False), params)
    else:
        deltas = engine.stream(prompt, params)  # validates the request before anything is printed
        sys.stdout.write(prompt)
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
        if engine.runner.shapes.compiled:
            stats["compile_warmup_seconds"] = engine.warmup_seconds
        stats["torch_threads"] = torch.get_num_threads()  # what torch runs with, --threads or not
        stats |= engine.kv_cache_summary()
        print(json.dumps(stats, indent=2), file=sys.stderr)


def quiet_transformers() -> None:
    """The CLI's stderr is for our stats and errors: no progress bars, and no transformers warning (like
    the tokenizer's "sequence length is longer than ..." before our own one-line error for a long prompt)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _serve(args: argparse.Namespace) -> None:
    from ddtree.server.run import serve

    check_engine_flags(args)  # before binding: a bad flag fails at once, not after the port is taken
    serve(args, engine_from_args)


def _exit_cleanly(sig: int, frame: object) -> None:
    """Nothing started yet: exit 0 at once (a normal exit in the middle of importing torch can abort)."""
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    try:
        args = build_parser().parse_args(argv)  # --help and argument errors end here, before any model code
        if args.command == "serve":  # stopped while it imports: a clean exit (serve's own handlers follow)
            resolve_serve_model(args)
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, _exit_cleanly)
        quiet_transformers()
        if getattr(args, "tensor_parallel_size", 1) > 1:
            from ddtree.engine.rank_worker import torchrun_rank

            launched = torchrun_rank()
            if launched is not None and launched[0] != 0:
                serve_torchrun_rank(args)  # torchrun's other ranks: no port, no output, rank 0's steps
        args.func(args)
    except DDTreeError as exc:
        print(f"ddtree: error: {exc}", file=sys.stderr)
        leave_tensor_parallel(2)
        sys.exit(2)
    except KeyboardInterrupt:
        leave_tensor_parallel(130)
        sys.exit(130)
    leave_tensor_parallel(0)


def leave_tensor_parallel(code: int) -> None:
    """A process that ran tensor-parallel ranks ends here with ``code``, without the interpreter's teardown
    (``exit_after_group``: gloo's threads would abort it); any other process goes on."""
    if "ddtree.engine.step_channel" in sys.modules:
        from ddtree.engine.step_channel import exit_after_group, joined_group

        if joined_group():
            exit_after_group(code)


if __name__ == "__main__":
    main()
