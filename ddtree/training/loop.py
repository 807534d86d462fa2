"""The parts of a training loop the target and drafter trainers share: AdamW groups, the learning-rate
schedule (linear warmup, then cosine decay), time-based progress, CPU bf16 autocast and the step bar.

``cfg`` is the trainer's config dataclass; the fields read here are named in each function.
"""

from __future__ import annotations

import math
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from tqdm import tqdm


def make_optimizer(model: torch.nn.Module, cfg: Any) -> torch.optim.AdamW:
    """AdamW at ``cfg.lr``, weight decay ``cfg.weight_decay`` on matrices (incl. a tied embedding) only;
    norms' gains are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def progress(step: int, seconds: float, cfg: Any) -> float:
    """Fraction of the run done: by ``cfg.steps``, or by time when ``cfg.max_minutes`` would run out first.

    On a shared CPU the step rate is unknown in advance; letting the clock advance the schedule
    keeps a hard wall-time bound and still ends with a fully decayed learning rate.
    """
    by_steps = step / cfg.steps
    return max(by_steps, seconds / (60 * cfg.max_minutes)) if cfg.max_minutes else by_steps


def lr_at(step: int, cfg: Any, frac: float | None = None, *, progress_warmup: bool) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.min_lr_ratio * lr`` as ``frac`` goes 0 -> 1.

    ``frac`` is the run's progress (default: by steps); the decay starts at ``warmup_steps / steps`` of it.
    Warmup lasts ``warmup_steps`` steps or, with ``progress_warmup``, until progress reaches that
    fraction (at least as fast as by steps), so a run the clock cuts short does not spend most of its few
    steps warming up.
    """
    frac = step / cfg.steps if frac is None else frac
    warm = cfg.warmup_steps / cfg.steps
    if progress_warmup and frac < warm:
        return cfg.lr * max((step + 1) / cfg.warmup_steps, frac / warm)
    if not progress_warmup and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay = (frac - warm) / max(1e-9, 1 - warm)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, max(0.0, decay))))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def autocast(bf16: bool) -> AbstractContextManager:
    """bf16 autocast on CPU when ``bf16`` (master weights stay fp32), else a no-op context."""
    return torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()


def step_bar(total: int, initial: int) -> tqdm:
    """The run's step progress bar on stderr (redrawn at most every 30 s when stderr is not a terminal)."""
    return tqdm(
        total=total,
        initial=initial,
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0 if sys.stderr.isatty() else 30.0,
    )
