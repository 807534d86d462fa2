"""A tensor-parallel rank other than 0: load its shard of the target, join the group, and make every call
rank 0 sends until it says stop.

Each such rank holds only its shard of the target (``ddtree.model.tensor_parallel.shard_target``, read slice
by slice from the checkpoint) and its shard of the target's KV pool (its KV heads, the same blocks; MLA: the
whole latent pool, which every head reads): no drafter, no LM head, no scheduler. It is either spawned by
rank 0 (``spawned_rank_main``) or started by torchrun (``run_torchrun_worker``); rank 0 dying closes its
socket, and it exits.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch
import torch.distributed as dist

from ddtree.engine.model_runner import ModelRunner
from ddtree.engine.step_channel import (
    FAILURE_KEY,
    REPLICATED,
    STOP,
    StepChannel,
    TensorParallelError,
    connect,
    exit_after_group,
    first_line,
    injected_failure,
    leave_group,
)
from ddtree.errors import DDTreeError


def serve_steps(channel: StepChannel, make_runner: Callable[[tuple], object]) -> None:
    """A rank other than 0: build its model runner from rank 0's first message, then make every call rank
    0 sends until it sends STOP."""
    ((name, args),) = channel.recv()
    if name == STOP:  # rank 0 gave up before its engine was built
        return
    if name != "init":
        raise TensorParallelError(f"rank {channel.tp.rank} expected rank 0's 'init', got {name!r}")
    runner = make_runner(args)
    with torch.inference_mode():
        while True:
            for name, args in channel.recv():
                if name == STOP:
                    return
                if name not in REPLICATED:
                    raise TensorParallelError(f"rank {channel.tp.rank} got an unknown call {name!r}")
                try:
                    injected_failure(channel.tp.rank, name)
                    getattr(runner, name)(*args)
                except DDTreeError:  # a refusal rank 0 makes too, and reports
                    raise
                except Exception as exc:
                    raise report_failure(channel.tp.rank, name, exc) from None


def report_failure(rank: int, call: str, exc: BaseException) -> TensorParallelError:
    """A worker whose call raised: its one-line reason, written to the store for rank 0 (which may be gone
    already, its store with it: then there is nobody to tell)."""
    reason = f"tensor-parallel rank {rank} failed in {call}: {first_line(exc)}"
    try:
        dist.distributed_c10d._get_default_store().set(FAILURE_KEY.format(rank=rank), reason)
    except RuntimeError:
        pass
    return TensorParallelError(reason)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """The device of a rank: the CPU, or the GPU of its local rank (set as the current one for NCCL)."""
    if device.type != "cuda":
        return device
    if local_rank >= torch.cuda.device_count():
        raise TensorParallelError(
            f"tensor-parallel rank {local_rank} needs GPU {local_rank}; this machine has "
            f"{torch.cuda.device_count()}"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was started by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


@dataclass(frozen=True)
class ShardSpec:
    """What a spawned rank needs to load its shard, the same way rank 0 loads the target."""

    target_dir: str
    dtype: str | torch.dtype
    device: str
    max_model_len: int | None
    threads: int


def load_shard(spec: ShardSpec, rank: int, world_size: int, device: torch.device):
    from ddtree.model.loader import load_target  # here: models imports transformers, which rank 0 has already

    target, _ = load_target(
        spec.target_dir,
        device=device,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        tokenizer=False,
        shard=(rank, world_size),
    )
    return target


def spawned_rank_main(rank: int, world_size: int, init_method: str, spec: ShardSpec, pipe) -> NoReturn:
    """A spawned rank: load and shard the target, say so to rank 0, join, serve its steps."""
    torch.set_num_threads(spec.threads)
    quiet_loading()
    try:
        device = rank_device(torch.device(spec.device), rank)
        target = load_shard(spec, rank, world_size, device)
    except BaseException as exc:  # rank 0 reports it in one line
        pipe.send(first_line(exc))
        sys.exit(1)
    pipe.send(("loaded", target.load_stats.summary()))
    pipe.close()
    serve_rank(target, rank, world_size, device, init_method)


def worker_runner(target, channel: StepChannel, init: tuple) -> ModelRunner:
    """This rank's runner, from rank 0's ``init`` (its largest steps, cache config, KV plan and drafter
    block): its shard of the target and of the KV pool, with rank 0's blocks and widths."""
    (tokens, rows, nodes), cache, plan, draft_block = init
    pool = (plan, draft_block)
    return ModelRunner(
        target, None, rows, plan.max_model_len, tokens, nodes, cache, True, channel=channel, pool=pool
    )


def serve_rank(target, rank: int, world_size: int, device: torch.device, init_method: str) -> NoReturn:
    """A rank other than 0, its shard loaded: join the group, serve rank 0's steps until ``stop``, and end
    the process (``exit_after_group``: 0 when stopped, 1 when this rank or rank 0 failed)."""
    channel = connect(rank, world_size, device, init_method)
    try:
        serve_steps(channel, lambda init: worker_runner(target, channel, init))
    except TensorParallelError as exc:  # this rank failed in a step (reported to rank 0 too)
        print(f"ddtree: {exc}", file=sys.stderr)
        exit_after_group(1)
    except DDTreeError:  # an option rank 0 refuses too (it reports it): nothing to add
        exit_after_group(1)
    except RuntimeError as exc:  # rank 0 went away mid-collective
        print(f"ddtree: tensor-parallel rank {rank}: {first_line(exc)}", file=sys.stderr)
        exit_after_group(1)
    try:
        leave_group(channel)
    except RuntimeError as exc:  # rank 0 went away after stop
        print(f"ddtree: tensor-parallel rank {rank}: {first_line(exc)}", file=sys.stderr)
        exit_after_group(1)
    exit_after_group(0)


def quiet_loading() -> None:
    """A rank other than 0 prints nothing of its own while loading (no progress bar, no notices)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def run_torchrun_worker(spec: ShardSpec) -> NoReturn:
    """A torchrun rank other than 0: load its shard, join, serve rank 0's steps, exit with its status."""
    rank, world_size, local_rank = torchrun_rank()
    torch.set_num_threads(spec.threads)
    quiet_loading()
    device = rank_device(torch.device(spec.device), local_rank)
    serve_rank(load_shard(spec, rank, world_size, device), rank, world_size, device, "env://")
