"""Command-line flags generated from a config dataclass, so a new field becomes a flag once it has a help
line, and the checks every training config shares."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import TypeVar

from ddtree.errors import DDTreeError

SAVE_DTYPE_NAMES = ("bfloat16", "float32")  # the final weights' ``save_dtype`` (torch dtypes of these names)

T = TypeVar("T")

# Help lines of the fields every training config has; each config adds its own.
COMMON_HELP = {
    "batch_size": "sequences per optimizer step",
    "steps": "optimizer steps of the schedule",
    "lr": "peak learning rate (AdamW)",
    "min_lr_ratio": "final learning rate as a fraction of --lr (cosine decay)",
    "warmup_steps": "linear warm-up steps",
    "weight_decay": "AdamW weight decay",
    "grad_clip": "gradient norm clip",
    "seed": "seed for initialisation and data order",
    "bf16_autocast": "forward/backward in bfloat16 on the CPU; master weights stay float32",
    "ckpt_every": "save a resumable checkpoint every N steps",
    "save_dtype": "dtype of the saved model weights",
    "max_minutes": "end the schedule early after this much training time; 0 = no limit",
}


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, helps: dict[str, str]) -> None:
    """One ``--field-name`` flag per field of ``cls``, defaulting to the field's default, with the help line
    ``helps[field]`` (every field needs one: a KeyError here names the one missing).

    A bool field gets ``--name/--no-name``; any other parses with its default's type. Defaults show as
    ``repr`` (strings quoted, so an empty one is visible).
    """
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        help_ = f"{helps[f.name]} (default: %(default)r)"
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_)
        else:
            parser.add_argument(flag, type=type(f.default), default=f.default, help=help_)


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The ``cls`` instance the flags of :func:`add_dataclass_flags` describe."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def check_config(cfg, positive: tuple[str, ...]) -> None:
    """The fields named in ``positive`` are > 0 and ``cfg.save_dtype`` is one the checkpoints support."""
    for name in positive:
        if not getattr(cfg, name) > 0:
            raise DDTreeError(f"{name} must be > 0, got {getattr(cfg, name)!r}")
    if cfg.save_dtype not in SAVE_DTYPE_NAMES:
        raise DDTreeError(f"save_dtype must be one of {sorted(SAVE_DTYPE_NAMES)}, got {cfg.save_dtype!r}")
