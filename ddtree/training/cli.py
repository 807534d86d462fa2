"""``ddtree train tokenizer|target``: argparse hooks the main ``ddtree`` CLI mounts with :func:`register`.

Each subcommand sets ``func`` (call it as ``args.func(args)``). The target's options are generated from
:class:`TargetConfig`, so a new field becomes a flag without touching this file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ddtree.training.configs import DRAFTER_HELP, TARGET_HELP, DrafterConfig, TargetConfig
from ddtree.training.flags import COMMON_HELP, add_dataclass_flags, dataclass_from_args


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
    from ddtree.training.tokenizer import train_tokenizer  # here: building the parser imports no torch

    out = train_tokenizer(args.out, args.vocab_size, args.corpus_root)
    print(f"tokenizer saved to {out}")


def _run_target(args: argparse.Namespace) -> None:
    from ddtree.training.target import train_target

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


def register_drafter(train_subparsers: argparse._SubParsersAction) -> None:
    """Add ``drafter`` to the ``train`` subcommands; options are generated from :class:`DrafterConfig`."""
    p = train_subparsers.add_parser(
        "drafter",
        help="a DFlash drafter for a target, on its own continuations",
        description="Train a DFlash drafter for a local Qwen3 / Llama target on the target's own\n"
        "continuations and save it in the public DFlash checkpoint format (resumable).",
        epilog="example (a few minutes on a CPU):\n"
        "  ddtree train drafter --target DIR --out runs/drafter-model --num-sequences 256 --steps 200",
    )
    p.add_argument("--target", type=Path, required=True, help="HF target directory (with its tokenizer)")
    p.add_argument("--out", type=Path, required=True, help="directory for the drafter (public DFlash format)")
    p.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="prompts file (.jsonl, or text: one per line) instead of corpus windows",
    )
    p.add_argument(
        "--corpus-root", type=Path, default=None, help="corpus root (this interpreter's stdlib if omitted)"
    )
    p.add_argument("--work-dir", type=Path, default=Path("runs/drafter"), help="checkpoint and data cache")
    p.add_argument("--data", type=Path, default=None, help="data cache file (WORK_DIR/data.pt if omitted)")
    p.add_argument("--resume", action="store_true", help="continue from WORK_DIR/checkpoint.pt")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (torch's default if omitted)")
    p.add_argument(
        "--until-step",
        type=int,
        default=None,
        help="checkpoint and stop after this step without finishing (resume later)",
    )
    add_dataclass_flags(p, DrafterConfig, COMMON_HELP | DRAFTER_HELP)
    p.set_defaults(func=_run_drafter)


def _run_drafter(args: argparse.Namespace) -> None:
    from ddtree.training.drafter import train_drafter

    cfg = dataclass_from_args(DrafterConfig, args)
    metrics = train_drafter(
        args.target,
        args.out,
        cfg,
        prompts=args.prompts,
        corpus_root=args.corpus_root,
        work_dir=args.work_dir,
        data_path=args.data,
        resume=args.resume,
        threads=args.threads,
        until_step=args.until_step,
    )
    print(json.dumps({k: v for k, v in metrics.items() if k not in ("config", "history")}, indent=2))
