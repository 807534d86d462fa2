"""``ddtree train tokenizer|target``: argparse hooks the main ``ddtree`` CLI mounts with :func:`register`.

Each subcommand sets ``func`` (call it as ``args.func(args)``). The target's options are generated from
:class:`TargetConfig`, so a new field becomes a flag without touching this file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddtree.training.drafter import register_drafter
from ddtree.training.flags import COMMON_HELP, add_dataclass_flags, dataclass_from_args
from ddtree.training.target import TARGET_HELP, TargetConfig, train_target
from ddtree.training.tokenizer import train_tokenizer


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train",
        help="train a tokenizer, a target model or a DFlash drafter",
        description="Train the pieces of a model pair on a CPU: a tokenizer, a small target, a drafter.",
        epilog="example:\n  ddtree train drafter --target DIR --out runs/my-drafter --steps 200",
    )
    sub = train.add_subparsers(dest="train_command", required=True, metavar="WHAT")

    tok = sub.add_parser(
        "tokenizer",
        help="byte-level BPE on the stdlib corpus",
        description="Train a byte-level BPE tokenizer (with <|endoftext|> and <|mask|>) on Python source.",
        epilog="example:\n  ddtree train tokenizer --out runs/tokenizer --vocab-size 4096",
    )
    tok.add_argument("--out", type=Path, required=True, help="directory to save the tokenizer to")
    tok.add_argument(
        "--vocab-size", type=int, default=4096, help="tokens in the vocabulary, special ones included"
    )
    tok.add_argument(
        "--corpus-root", type=Path, default=None, help="corpus root (this interpreter's stdlib if omitted)"
    )
    tok.set_defaults(func=_run_tokenizer)

    tgt = sub.add_parser(
        "target",
        help="a small Qwen3 causal LM from scratch on the stdlib corpus",
        description="Train a small Qwen3 causal LM from scratch on the stdlib corpus (resumable).",
        epilog="example:\n  ddtree train target --tokenizer runs/tokenizer --out runs/my-target --steps 200",
    )
    tgt.add_argument("--tokenizer", type=Path, required=True, help="directory saved by 'train tokenizer'")
    tgt.add_argument("--out", type=Path, required=True, help="final HF model directory (with tokenizer)")
    tgt.add_argument("--work-dir", type=Path, default=Path("runs/target"), help="where checkpoints go")
    tgt.add_argument("--resume", action="store_true", help="continue from WORK_DIR/checkpoint.pt")
    tgt.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (torch's default if omitted)"
    )
    tgt.add_argument(
        "--corpus-root", type=Path, default=None, help="corpus root (this interpreter's stdlib if omitted)"
    )
    add_dataclass_flags(tgt, TargetConfig, COMMON_HELP | TARGET_HELP)
    tgt.set_defaults(func=_run_target)

    register_drafter(sub)


def _run_tokenizer(args: argparse.Namespace) -> None:
    out = train_tokenizer(args.out, args.vocab_size, args.corpus_root)
    print(f"tokenizer saved to {out}")


def _run_target(args: argparse.Namespace) -> None:
    cfg = dataclass_from_args(TargetConfig, args)
    metrics = train_target(
        args.tokenizer,
        args.out,
        cfg,
        work_dir=args.work_dir,
        resume=args.resume,
        threads=args.threads,
        root=args.corpus_root,
    )
    print(json.dumps({k: v for k, v in metrics.items() if k != "config"}, indent=2))


if __name__ == "__main__":  # ``python -m ddtree.training.cli train ...`` is ``ddtree train ...``
    from ddtree.cli import main

    main()
