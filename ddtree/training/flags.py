"""Command-line flags generated from a config dataclass, so a new field becomes a flag by itself, and
the checks every training config shares."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import TypeVar

from ddtree.errors import DDTreeError
from ddtree.training.checkpoint import SAVE_DTYPES

T = TypeVar("T")


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, *, repr_defaults: bool = False) -> None:
    """One ``--field-name`` flag per field of ``cls``, defaulting to the field's default.

    A bool field gets ``--name/--no-name``; any other parses with its default's type and shows the default
    in its help, as ``repr`` (strings quoted) when ``repr_defaults``.
    """
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            shown = repr(f.default) if repr_defaults else f.default
            parser.add_argument(flag, type=type(f.default), default=f.default, help=f"default {shown}")


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    """The ``cls`` instance the flags of :func:`add_dataclass_flags` describe."""
    return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def check_config(cfg, positive: tuple[str, ...]) -> None:
    """The fields named in ``positive`` are > 0 and ``cfg.save_dtype`` is one the checkpoints support."""
    for name in positive:
        if not getattr(cfg, name) > 0:
            raise DDTreeError(f"{name} must be > 0, got {getattr(cfg, name)!r}")
    if cfg.save_dtype not in SAVE_DTYPES:
        raise DDTreeError(f"save_dtype must be one of {sorted(SAVE_DTYPES)}, got {cfg.save_dtype!r}")
