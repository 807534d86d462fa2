"""Tensor-parallel ranks: starting them, rank 0's plan for each step, and the other ranks' loop.

Rank 0 is the process the user started. It runs the whole engine: the scheduler, the drafter, the trees,
the LM head, acceptance and every coin. Each other rank holds only its shard of the target
(``ddtree.tensor_parallel.shard_target``) and its shard of the target's KV pool (its KV heads, the same
blocks; MLA: the whole latent pool, which every head reads). Every call of the model runner that
touches the target (prefill, the verify forward, packing the accepted KV, a timed forward, the start-up
shapes) is first sent by rank 0 over a ``StepChannel``; the other ranks make the same call with the same
shapes, and the forwards' all-reduces pair up. The drafter's pass and everything after the target's
hidden states run on rank 0 alone: trees, verdicts and coins are decided there, as in one process (the
hidden states differ from one process's only by the all-reduce's order of summation).

A message is a header (the calls' names, their host values, the shapes and dtypes of their tensors),
broadcast pickled over a gloo group, then one broadcast of all their tensors' bytes over the data group
(gloo on CPUs, NCCL on GPUs, so the round's tensors never visit the host). The other ranks wait for
headers on a group with no practical timeout: a server may sit idle for days.

Two ways to start: ``Engine.from_pretrained(tensor_parallel_size=N)`` (``--tensor-parallel-size N``)
spawns ranks 1..N-1 on this machine; under ``torchrun`` (one process a rank, on one node or several
through its rendezvous) every process runs the same command and the ranks other than 0 turn into workers
(``run_torchrun_worker``). A spawned rank that dies is noticed by a watcher thread on rank 0, which tells
the engine's owner (the server answers ``/ready`` 503 and exits non-zero); rank 0 dying closes the
workers' sockets, and they exit.

A call that raises on any rank in the middle of a step ends the engine: the other ranks may be waiting
inside a collective that will never be joined, so the step can neither finish nor be retried. A worker
that raises writes one line to the process group's store (``FAILURE_KEY``) and exits 1, which breaks rank
0's collective; rank 0 (``StepChannel.abort``) names the rank at fault (that report, a rank that exited, or
itself), kills the spawned ranks, and raises ``TensorParallelError`` now and at every later call. The
environment variable ``FAIL_ENV`` (tests only) makes a rank raise when it reaches a given call.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import multiprocessing
import os
import pickle
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from ddtree.errors import DDTreeError
from ddtree.tensor_parallel import TPGroup

log = logging.getLogger("ddtree.tp")

DATA_TIMEOUT = timedelta(minutes=10)  # a collective inside a step: a peer that stops answering is dead
IDLE_TIMEOUT = timedelta(days=365)  # waiting for rank 0's next step: an idle server is not a failure
STOP = "stop"  # the call that ends a worker's loop
FAILURE_KEY = "ddtree/failed/{rank}"  # a worker's one-line reason, in the process group's store
REPORT_WAIT = 2.0  # seconds rank 0 waits, after a collective broke, for the rank at fault to be known
# (a worker reports before it exits, and its exit breaks the collective; the watcher needs milliseconds)
FAIL_ENV = "DDTREE_TP_FAIL"  # tests only: "RANK:CALL" makes rank RANK raise when it reaches call CALL


ALIGN = 16  # bytes: every tensor in a step's payload starts at a multiple of this
HEADER_BYTES = 4096  # a message's header broadcast; a longer one takes a second broadcast


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class TensorParallelError(DDTreeError):
    """A rank failed to start, died or failed in a step: the engine cannot run any more."""


def first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def injected_failure(rank: int, name: str) -> None:
    """Tests only: raise where ``FAIL_ENV`` asks, as a rank that fails in the middle of a step would."""
    if os.environ.get(FAIL_ENV) == f"{rank}:{name}":
        raise RuntimeError(f"injected failure in {name}")


def reported_failure(world_size: int) -> str | None:
    """The first worker's reason in the process group's store (``FAILURE_KEY``), if any wrote one."""
    store = dist.distributed_c10d._get_default_store()
    for rank in range(1, world_size):
        key = FAILURE_KEY.format(rank=rank)
        if store.check([key]):
            return store.get(key).decode()
    return None


@dataclass(frozen=True)
class TensorSpec:
    """Where a tensor argument stood in a call, and what the receiving rank allocates for it."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class ChannelStats:
    """What rank 0 has sent: messages, calls, collectives and bytes."""

    messages: int = 0
    calls: int = 0
    collectives: int = 0
    bytes: int = 0


Call = tuple[str, tuple]  # a replicated call: its name, and its arguments with tensors as TensorSpecs


@dataclass
class StepChannel:
    """Rank 0 sends the replicated model-runner calls; the other ranks receive them and make them too.

    A message is every call deferred since the last one (``defer``: the KV packing, which the other
    ranks need only before their next forward) plus the call being sent: one header broadcast (a fixed
    ``HEADER_BYTES`` buffer, and a second broadcast only for a longer header) and one broadcast of all the
    calls' tensors. A round is one message: 2 collectives besides its forward's all-reduces."""

    tp: TPGroup
    device: torch.device
    control: dist.ProcessGroup  # gloo: pickled headers, waited on without a practical timeout
    stats: ChannelStats = field(default_factory=ChannelStats)
    ranks: RankSet | None = None  # rank 0 of spawned ranks: the processes and their watcher
    closed: bool = False  # the other ranks were told to stop: rank 0's shard alone must not run
    failure: str | None = None  # a step failed on some rank (``abort``): the engine runs no more
    pending: list[Call] = field(default_factory=list)  # deferred calls, sent with the next message
    parts: list[torch.Tensor] = field(default_factory=list)  # their tensors' bytes (copies), in order

    @property
    def leader(self) -> bool:
        return self.tp.rank == 0

    def check(self) -> None:
        """Raise rather than wait on a collective that a closed engine's or a dead rank's group won't join."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        if self.closed:
            raise TensorParallelError("the tensor-parallel engine was closed; its ranks are gone")
        if self.ranks is not None:
            self.ranks.check()

    def abort(self, call: str, exc: BaseException) -> TensorParallelError:
        """Rank 0: ``call`` raised ``exc`` after it was sent, so the other ranks may wait inside a collective
        rank 0 will never join. Name the rank at fault (a worker's report, a spawned rank that exited, else
        rank 0), log it in one line, end the spawned ranks, and fail every later call the same way."""
        reason = None
        deadline = time.monotonic() + (REPORT_WAIT if isinstance(exc, RuntimeError) else 0.0)
        while reason is None:  # a broken collective: its cause is usually a peer, which says so shortly
            reason = reported_failure(self.tp.world_size) or (self.ranks and self.ranks.failure)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        self.failure = reason or f"tensor-parallel rank 0 failed in {call}: {first_line(exc)}"
        log.error("%s", self.failure)
        if self.ranks is not None:
            self.ranks.fail(self.failure)
        return TensorParallelError(self.failure)

    def defer(self, name: str, args: tuple) -> None:
        """Rank 0: queue ``name(*args)`` for the next message. Its tensors are copied now, so the caller
        may overwrite them (persistent input buffers) before that message leaves."""
        self.check()
        specs = []
        for a in args:
            if isinstance(a, torch.Tensor):  # each part padded to ALIGN bytes: the receiver views it
                data = a.contiguous().reshape(-1).view(torch.uint8)
                self.parts += [data.clone(), data.new_zeros(padded(data.numel()) - data.numel())]
                a = TensorSpec(tuple(a.shape), a.dtype)
            specs.append(a)
        self.pending.append((name, tuple(specs)))

    def send(self, name: str, args: tuple) -> None:
        """Rank 0: broadcast the deferred calls and ``name(*args)``; tensors travel as one byte buffer on
        the device (gloo on CPUs, NCCL on GPUs)."""
        self.defer(name, args)
        calls, parts = self.pending, self.parts
        self.pending, self.parts = [], []
        self.stats.messages += 1
        self.stats.calls += len(calls)
        self._broadcast_header(calls)
        if parts:
            payload = torch.cat(parts)
            dist.broadcast(payload, src=0, group=self.tp.group)
            self.stats.collectives += 1
            self.stats.bytes += payload.numel()

    def recv(self) -> list[Call]:
        """Another rank: the next message's calls, in order, their tensors on this rank's device."""
        calls = self._broadcast_header(None)
        sizes = [
            torch.Size(a.shape).numel() * a.dtype.itemsize
            for _, args in calls
            for a in args
            if isinstance(a, TensorSpec)
        ]
        if not sizes:
            return calls
        payload = torch.empty(sum(map(padded, sizes)), dtype=torch.uint8, device=self.device)
        dist.broadcast(payload, src=0, group=self.tp.group)
        parts = iter(payload.split([n for size in sizes for n in (size, padded(size) - size)]))

        def unpack(spec: TensorSpec) -> torch.Tensor:
            data = next(parts)
            next(parts)  # its padding
            return data.view(spec.dtype).view(spec.shape)

        return [
            (name, tuple(unpack(a) if isinstance(a, TensorSpec) else a for a in args)) for name, args in calls
        ]

    def _broadcast_header(self, calls: list[Call] | None) -> list[Call]:
        """The pickled calls from rank 0: one broadcast of ``HEADER_BYTES`` (its length first), and one more
        for what does not fit."""
        data = pickle.dumps(calls) if self.leader else b""
        head = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
        if self.leader:
            head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
            first = data[: HEADER_BYTES - 8]
            head[8 : 8 + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        dist.broadcast(head, src=0, group=self.control)
        size = int(head[:8].view(torch.int64))
        body = head[8 : 8 + size].numpy().tobytes()
        rest = size - (HEADER_BYTES - 8)
        if rest > 0:
            tail = torch.frombuffer(bytearray(data[HEADER_BYTES - 8 :]), dtype=torch.uint8) if self.leader \
                else torch.empty(rest, dtype=torch.uint8)  # fmt: skip
            dist.broadcast(tail, src=0, group=self.control)
            body += tail.numpy().tobytes()
        if self.leader:
            self.stats.collectives += 1 + (rest > 0)
            self.stats.bytes += HEADER_BYTES + max(rest, 0)
            return calls
        return pickle.loads(body)


def replicated(method: Callable | None = None, *, deferred: bool = False) -> Callable:
    """A ``ModelRunner`` method every rank runs: on rank 0 it first sends its name and arguments (which
    must be tensors or picklable host values), so the other ranks make the same call. ``deferred``: the
    call returns nothing the other ranks need before their next call, so it rides with the next message."""
    if method is None:
        return lambda m: replicated(m, deferred=deferred)
    signature = inspect.signature(method)

    def call(self, *args, **kwargs):
        channel = self.channel
        if channel is None or not channel.leader:
            return method(self, *args, **kwargs)
        args = signature.bind(self, *args, **kwargs).args[1:]  # keywords as positions: one header shape
        (channel.defer if deferred else channel.send)(method.__name__, args)
        try:
            injected_failure(0, method.__name__)
            return method(self, *args)
        except DDTreeError:  # a refusal every rank makes alike (an option), or the engine already failed
            raise
        except Exception as exc:
            raise channel.abort(method.__name__, exc) from None

    call.__name__, call.__doc__, call.__wrapped__ = method.__name__, method.__doc__, method
    REPLICATED.add(method.__name__)
    return call


REPLICATED: set[str] = set()  # the calls a worker accepts


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


# -- starting ranks ---------------------------------------------------------------------------------------


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


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


def connect(rank: int, world_size: int, device: torch.device, init_method: str) -> StepChannel:
    """Join the process group (every rank calls this) and open the step channel."""
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=world_size, timeout=DATA_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return StepChannel(TPGroup(rank, world_size, dist.group.WORLD), device, control)


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when this process was started by torchrun, else None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))


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


@dataclass(frozen=True)
class ShardSpec:
    """What a spawned rank needs to load its shard, the same way rank 0 loads the target."""

    target_dir: str
    dtype: str | torch.dtype
    device: str
    max_model_len: int | None
    threads: int


def load_shard(spec: ShardSpec, rank: int, world_size: int, device: torch.device):
    from ddtree.models import load_target  # here: models imports transformers, which rank 0 has already

    target, _ = load_target(
        spec.target_dir,
        device=device,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        tokenizer=False,
        shard=(rank, world_size),
    )
    return target


def spawned_rank_main(rank: int, world_size: int, init_method: str, spec: ShardSpec, pipe) -> None:
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


def serve_rank(target, rank: int, world_size: int, device: torch.device, init_method: str) -> None:
    """A rank other than 0, its shard loaded: join the group and serve rank 0's steps until ``stop``."""
    from ddtree.engine.model_runner import ModelRunner

    channel = connect(rank, world_size, device, init_method)
    try:
        serve_steps(channel, lambda args: ModelRunner.worker(target, channel, *args))
    except TensorParallelError as exc:  # this rank failed in a step (reported to rank 0 too)
        print(f"ddtree: {exc}", file=sys.stderr)
        sys.exit(1)
    except DDTreeError:  # an option rank 0 refuses too (it reports it): nothing to add
        sys.exit(1)
    except RuntimeError as exc:  # rank 0 went away mid-collective
        print(f"ddtree: tensor-parallel rank {rank}: {first_line(exc)}", file=sys.stderr)
        sys.exit(1)
    dist.destroy_process_group()


def quiet_loading() -> None:
    """A rank other than 0 prints nothing of its own while loading (no progress bar, no notices)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


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


def run_torchrun_worker(spec: ShardSpec) -> None:
    """A torchrun rank other than 0: load its shard, join, serve rank 0's steps, exit with its status."""
    rank, world_size, local_rank = torchrun_rank()
    torch.set_num_threads(spec.threads)
    quiet_loading()
    device = rank_device(torch.device(spec.device), local_rank)
    serve_rank(load_shard(spec, rank, world_size, device), rank, world_size, device, "env://")


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
    from ddtree.models import check_model_dir, load_target

    launched = torchrun_rank()
    if device.type == "cpu" and launched is None:  # the ranks share this machine's cores: split the threads
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
    spec = ShardSpec(str(target_dir), dtype, str(device), max_model_len, torch.get_num_threads())
    if launched is not None and launched[0] != 0:
        run_torchrun_worker(spec)
        raise SystemExit(0)
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


def close_channel(channel: StepChannel) -> None:
    """Rank 0: end the other ranks' loops (unless one has died: then kill them), wait for spawned ranks to
    leave, and leave the process group (a later engine in this process may form a new one)."""
    ranks = channel.ranks
    failed = channel.failure is not None or (ranks is not None and ranks.failure is not None)
    if ranks is not None:
        ranks.closing = True  # their exits from here on are no failure
    if not failed:
        try:
            channel.send(STOP, ())
        except (RuntimeError, TensorParallelError) as exc:  # a rank is gone: nobody to tell
            failed = True
            log.warning("stopping the tensor-parallel ranks: %s", str(exc).splitlines()[0])
    channel.closed = True
    if ranks is not None:
        ranks.close(0.0 if failed else 10.0)
    dist.destroy_process_group()
