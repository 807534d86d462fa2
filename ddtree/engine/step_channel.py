"""The step channel of tensor parallelism: how rank 0 sends each step's calls to the other ranks.

Rank 0 runs the whole engine; every call of the model runner that touches the target (prefill, the
verify forward, packing the accepted KV, a timed forward, the start-up shapes) is ``@replicated``: first
sent by rank 0 over the ``StepChannel``, then made by every other rank with the same shapes, so the
forwards' all-reduces pair up. A message is a header (the calls' names, their host values, the shapes
and dtypes of their tensors), broadcast pickled over a gloo group, then one broadcast of all their
tensors' bytes over the data group (gloo on CPUs, NCCL on GPUs, so the round's tensors never visit the
host). The other ranks wait for headers on a group with no practical timeout: a server may sit idle for
days.

A call that raises on any rank in the middle of a step ends the engine: the other ranks may be waiting
inside a collective that will never be joined, so the step can neither finish nor be retried. A worker
that raises writes one line to the process group's store (``FAILURE_KEY``) and exits 1, which breaks rank
0's collective; rank 0 (``StepChannel.abort``) names the rank at fault (that report, a rank that exited, or
itself), kills the spawned ranks, and raises ``TensorParallelError`` now and at every later call. The
environment variable ``FAIL_ENV`` (tests only) makes a rank raise when it reaches a given call.
"""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NoReturn, Protocol

import torch
import torch.distributed as dist

from ddtree.errors import DDTreeError
from ddtree.model.tensor_parallel import TPGroup

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


class SpawnedRanks(Protocol):
    """What the channel asks of rank 0's spawned ranks (``launch.RankSet``): the first failure, and ending
    them."""

    failure: str | None
    closing: bool

    def check(self) -> None: ...
    def fail(self, reason: str) -> None: ...
    def close(self, timeout: float = 10.0) -> None: ...


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
    ranks: SpawnedRanks | None = None  # rank 0 of spawned ranks: the processes and their watcher
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


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def connect(rank: int, world_size: int, device: torch.device, init_method: str) -> StepChannel:
    """Join the process group (every rank calls this) and open the step channel."""
    _joined.append(rank)
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=world_size, timeout=DATA_TIMEOUT
    )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return StepChannel(TPGroup(rank, world_size, dist.group.WORLD), device, control)


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
            dist.barrier(group=channel.control)  # paired with leave_group on every other rank
        except (RuntimeError, TensorParallelError) as exc:  # a rank is gone: nobody to tell
            failed = True
            log.warning("stopping the tensor-parallel ranks: %s", str(exc).splitlines()[0])
    channel.closed = True
    if ranks is not None:
        ranks.close(0.0 if failed else 10.0)
    dist.destroy_process_group()


def leave_group(channel: StepChannel) -> None:
    """A rank other than 0, its loop stopped: meet rank 0 at a barrier, then leave the process group.

    The barrier is a wait with the GIL released: gloo's worker threads free each finished operation's
    tensors, which needs the GIL, so they do it here rather than race the interpreter's exit."""
    dist.barrier(group=channel.control)
    dist.destroy_process_group()


_joined: list[int] = []  # this process's ranks in the groups it has joined (gloo's threads outlive them)


def joined_group() -> bool:
    """Whether this process has ever joined a process group (then it ends with ``exit_after_group``)."""
    return bool(_joined)


def exit_after_group(code: int) -> NoReturn:
    """End a process that joined a gloo process group, its output flushed, without the interpreter's
    teardown: a gloo worker thread that frees a finished operation's tensor takes the GIL, and one that
    asks for it while the interpreter finalizes aborts the process ("terminate called without an active
    exception", SIGABRT; pytorch/pytorch#190489). Destroying the group does not join those threads while
    other objects (the target's layers, the engine) still hold it."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
