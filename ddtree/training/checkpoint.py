"""What a training run saves, shared by the target and drafter trainers.

A resumable checkpoint (``work_dir/checkpoint.pt``) holds ``config`` (the dataclass as a dict), ``step``,
``elapsed`` (training seconds so far) and the trainer's own parts (weights, AdamW moments, ...). A resumed
run must agree with it on every config field except the trainer's ``RUN_FIELDS``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from ddtree.errors import DDTreeError
from ddtree.training.flags import SAVE_DTYPE_NAMES

CHECKPOINT = "checkpoint.pt"
SAVE_DTYPES = {name: getattr(torch, name) for name in SAVE_DTYPE_NAMES}  # the final weights' ``save_dtype``


def check_resumable(saved: Any, cfg: Any, run_fields: Collection[str]) -> None:
    """Raise unless dataclasses ``saved`` and ``cfg`` agree on every field outside ``run_fields``."""
    diff = [
        f.name
        for f in fields(cfg)
        if f.name not in run_fields and getattr(saved, f.name) != getattr(cfg, f.name)
    ]
    if diff:
        raise DDTreeError(f"--resume with settings that differ from the checkpoint: {', '.join(diff)}")


def load_checkpoint(path: Path, cfg: Any, run_fields: Collection[str]) -> dict:
    """The state saved at ``path``, once :func:`check_resumable` says ``cfg`` may resume it."""
    if not path.is_file():
        raise DDTreeError(f"--resume: no checkpoint at {path}")
    state = torch.load(path, weights_only=True)
    check_resumable(type(cfg)(**state["config"]), cfg, run_fields)
    return state


def save_checkpoint(path: Path, cfg: Any, step: int, elapsed: float, **parts: Any) -> None:
    """Save ``{config, step, elapsed, **parts}`` write-then-rename, so a run killed mid-save still leaves the
    previous checkpoint intact."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    state = {"config": asdict(cfg), "step": step, "elapsed": elapsed, **parts}
    torch.save(state, tmp)
    tmp.replace(path)
