"""Rank 0 starting tensor parallelism: spawn ranks 1..N-1 on this machine (or, under torchrun, join the
ranks it started), load this rank's shard while they load theirs, open the step channel, and watch the
spawned ranks.

``Engine.from_pretrained(tensor_parallel_size=N)`` (``--tensor-parallel-size N``) spawns; under
``torchrun`` (one process a rank, on one node or several through its rendezvous) every process runs the
same command and the ranks other than 0 turn into workers (``ddtree.engine.rank_worker``). A spawned rank
that dies is noticed by a watcher thread on rank 0, which tells the engine's owner (the server answers
``/ready`` 503 and exits non-zero).
"""

from __future__ import annotations

import atexit
import multiprocessing
import socket
import threading
from collections.abc import Callable
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from ddtree import startup
from ddtree.config import EngineConfig
from ddtree.engine.rank_worker import (
    ShardSpec,
    rank_device,
    run_torchrun_worker,
    spawned_rank_main,
    torchrun_rank,
)
from ddtree.engine.step_channel import (
    StepChannel,
    TensorParallelError,
    close_channel,
    connect,
    log,
    reported_failure,
)
from ddtree.errors import DDTreeError
from ddtree.speculative.drafter import DFlashDrafter


def check_world(world_size: int, device: torch.device) -> None:
    """``--tensor-parallel-size`` against the launcher and the device, before anything loads."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise DDTreeError(f"tensor_parallel_size must be an integer >= 1, got {world_size!r}")
    launched = torchrun_rank()
    if launched is not None and world_size > 1 and launched[1] != world_size:
        raise DDTreeError(
            f"--tensor-parallel-size {world_size} under torchrun needs {world_size} processes; "
            f"it started {launched[1]}"
        )
    if world_size > 1 and device.type == "cuda" and device.index not in (None, 0) and launched is None:
        raise DDTreeError(
            f"with --tensor-parallel-size {world_size} rank r runs on cuda:r; give --device cuda, "
            f"not {device}"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankSet:
    """Rank 0's spawned ranks 1..N-1: started before rank 0 loads its own shard, watched until closed."""

    def __init__(self, world_size: int, spec: ShardSpec) -> None:
        self.world_size = world_size
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.failure: str | None = None
        self.closing = False
        self.lock = threading.Lock()  # the first failure wins: the watcher's, or rank 0's abort
        self.callbacks: list[Callable[[str], None]] = []
        context = multiprocessing.get_context("spawn")
        self.pipes, self.processes = [], []
        for rank in range(1, world_size):
            ours, theirs = context.Pipe(duplex=False)
            process = context.Process(
                target=spawned_rank_main,
                args=(rank, world_size, self.init_method, spec, theirs),
                name=f"ddtree-tp-rank{rank}",
                daemon=True,
            )
            process.start()
            theirs.close()
            log.info("tensor-parallel rank %d: pid %d", rank, process.pid)
            self.pipes.append(ours)
            self.processes.append(process)
        atexit.register(self.close, 0.0)  # an engine never closed: its ranks wait for a step that won't come

    def wait_loaded(self) -> None:
        """Every rank has loaded its shard; else a one-line error naming the rank and why."""
        for rank, (pipe, process) in enumerate(zip(self.pipes, self.processes, strict=True), start=1):
            wait([pipe, process.sentinel])
            try:
                message = pipe.recv()
            except EOFError:  # it died without a word (killed, or a crash in its start-up)
                process.join(5.0)
                message = f"exited with code {process.exitcode}"
            if isinstance(message, tuple):  # ("loaded", what it read): the start-up log says it
                log.info("tensor-parallel rank %d: %s", rank, message[1])
            else:
                self.close()
                raise TensorParallelError(f"tensor-parallel rank {rank} failed to load: {message}")

    def watch(self) -> None:
        """From now on a rank that exits is a failure: record it and tell the callbacks (any thread)."""
        threading.Thread(target=self._watch, name="ddtree-tp-watch", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, start=1)}
        ready = wait(list(sentinels))
        if self.closing:
            return
        rank = sentinels[ready[0]]
        process = self.processes[rank - 1]
        process.join(1.0)  # reap it, for its exit code
        exited = f"tensor-parallel rank {rank} exited (exit code {process.exitcode})"
        try:
            reason = reported_failure(self.world_size) or exited
        except RuntimeError:  # the group is being torn down
            reason = exited
        if self.record(reason):
            log.error("%s", reason)

    def record(self, reason: str) -> bool:
        """The engine's failure, once: tell the callbacks. False if one was recorded already."""
        with self.lock:
            if self.failure is not None:
                return False
            self.failure = reason
        for callback in list(self.callbacks):
            callback(reason)
        return True

    def fail(self, reason: str) -> None:
        """Rank 0 ends the engine after a failed step: the ranks may wait in a collective it will never
        join, so they are killed, not told."""
        self.closing = True  # their exits from here on are this failure, not another
        self.record(reason)
        self.close(0.0)

    def check(self) -> None:
        """Raise the recorded failure, rather than wait on a collective a dead rank will never join."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def close(self, timeout: float = 10.0) -> None:
        """Wait ``timeout`` seconds for the ranks to leave (after STOP), then kill what is left."""
        self.closing = True
        for process in self.processes:
            process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join(timeout)


def start_tensor_parallel(
    target_dir,
    dtype: str | torch.dtype,
    device: torch.device,
    max_model_len: int | None,
    world_size: int,
    trust_remote_code: bool = False,
):
    """Rank 0 of ``world_size``: start the other ranks (or, under torchrun, join them), load and shard
    this rank's target while they load theirs, and open the step channel. Returns (target shard,
    tokenizer, channel). Under torchrun a rank other than 0 serves rank 0's steps here and exits."""
    from ddtree.model.loader import check_model_dir, load_target

    launched = torchrun_rank()
    if device.type == "cpu" and launched is None:  # the ranks share this machine's cores: split the threads
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    spec = ShardSpec(str(target_dir), dtype, str(device), max_model_len, torch.get_num_threads())
    if launched is not None and launched[0] != 0:
        run_torchrun_worker(spec)
    check_model_dir(target_dir, "target")
    if dist.is_initialized():
        raise DDTreeError(
            "this process already runs a tensor-parallel engine (or another process group): close() it "
            "first; one at a time per process"
        )
    ranks = RankSet(world_size, spec) if launched is None else None
    try:
        device = rank_device(device, 0 if launched is None else launched[2])
        target, tokenizer = load_target(
            target_dir, device, dtype, max_model_len, trust_remote_code, shard=(0, world_size)
        )
        if ranks is not None:
            ranks.wait_loaded()
        channel = connect(0, world_size, device, "env://" if ranks is None else ranks.init_method)
    except BaseException:
        if ranks is not None:
            ranks.close(0.0)
        raise
    channel.ranks = ranks
    return target, tokenizer, channel


def load_models(
    target_dir,
    drafter_dir,
    config: EngineConfig,
    device: torch.device,
    dtype: str | torch.dtype,
    trust_remote_code: bool,
) -> tuple[torch.nn.Module, DFlashDrafter | None, object, StepChannel | None]:
    """The target (this rank's shard under tensor parallelism, the other ranks started), its tokenizer,
    the drafter in the target's dtype, and rank 0's step channel (None in one process)."""
    from ddtree.model.loader import load_drafter, load_target

    tp, max_model_len = config.tensor_parallel_size, config.max_model_len
    check_world(tp, device)
    channel = None
    with startup.phase("weights"):
        if tp > 1:
            target, tokenizer, channel = start_tensor_parallel(
                target_dir, dtype, device, max_model_len, tp, trust_remote_code
            )
            device = channel.device
        else:
            target, tokenizer = load_target(
                target_dir,
                device=device,
                dtype=dtype,
                max_model_len=max_model_len,
                trust_remote_code=trust_remote_code,
            )
        try:
            drafter = None
            if drafter_dir is not None:
                dtype = next(target.parameters()).dtype  # "auto" resolved
                drafter = load_drafter(drafter_dir, max_model_len).to(device=device, dtype=dtype)
        except BaseException:
            if channel is not None:
                close_channel(channel)
            raise
    return target, drafter, tokenizer, channel
