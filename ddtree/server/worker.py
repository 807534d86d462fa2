"""The one thread that owns the engine: it loads it, warms it up, then runs the continuous batching loop.

The engine is not thread-safe, so nothing else ever touches it. The engine thread never tokenizes nor
makes text: a request arrives as a :class:`Job` of token-id rows (the API side tokenized it) and its
deltas go back as token ids (the API side detokenizes them). The event loop hands jobs over through a
queue of commands (add, abort, abort some rows) that the engine thread consumes between steps. While
anything runs or waits, the thread loops ``engine.step()``: every running row advances one round, waiting
rows join at the next step (up to the engine's ``max_batch_size``), and each delta is routed by its
request id to its job, whose items go back to the request's event loop. A job that has taken its place
(running or waiting) counts against the limit of ``max_batch_size + max_queue``; past it, ``submit``
refuses at once (the caller answers 429).

Cancelling a job (client gone, timeout, a stop string the API side found) aborts its rows at the next step
boundary. A request that fails (a bad option the engine refuses, or a step the engine traced to it) fails
alone; the others go on. A step that fails whatever requests it runs is the engine's fault: the server
stops, as for a dead tensor-parallel rank.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ddtree import startup
from ddtree.engine.step_channel import TensorParallelError
from ddtree.errors import RequestFailed
from ddtree.request.params import RequestOptions
from ddtree.server.generation import EngineRow, RowDelta, ServedModel, Started
from ddtree.server.metrics import Metrics

log = logging.getLogger("ddtree.server")

State = Literal["loading", "warming", "ready", "failed", "dead"]


class QueueFull(Exception):
    """Every running and waiting place is taken."""


class ShuttingDown(Exception):
    """The server is stopping: it takes no more work, and what was still running past the drain time ends
    with this error."""


@dataclass(frozen=True)
class Failed:
    """The job failed; the request re-raises ``error`` on its own task."""

    error: BaseException


FINISHED = object()  # the last item of a job that ran to its end


class Job:
    """One request's engine rows and the channel its items come back on (an asyncio queue on its loop).

    Items: :class:`Started` once its rows are in the engine, then a :class:`RowDelta` per row and step,
    then FINISHED (every row ended) or a :class:`Failed`.
    """

    def __init__(
        self,
        rows: list[EngineRow],
        prompt_tokens: int,
        loop: asyncio.AbstractEventLoop,
        options: RequestOptions,
    ) -> None:
        self.rows = rows
        self.prompt_tokens = prompt_tokens
        self.loop = loop
        self.options = options  # every row's: the request's method, budget, topk and cache_salt
        self.items: asyncio.Queue[object] = asyncio.Queue()
        self.enqueued_at = time.perf_counter()
        self.live: set[str] = set()  # its request ids still in the engine (engine thread only)
        self.running = False  # a row of it has been admitted (it left the queue)
        self.done = False  # finished, failed or aborted; guarded by the worker's lock

    def emit(self, item: object) -> None:
        """Hand ``item`` to the request (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class EngineWorker:
    """Loads the engine with ``engine_factory`` on its own thread, warms it up, then serves the jobs."""

    def __init__(
        self,
        engine_factory: Callable[[], ServedModel],
        metrics: Metrics,
        max_queue: int,
        warmup: Callable[[Any], None] | None = None,
        on_load_failed: Callable[[BaseException], None] | None = None,
        step_delay: float = 0.0,
        on_engine_failed: Callable[[str], None] | None = None,
    ) -> None:
        self.engine_factory = engine_factory
        self.metrics = metrics
        self.max_queue = max_queue
        self.warmup = warmup
        self.on_load_failed = on_load_failed
        self.on_engine_failed = on_engine_failed  # the engine died after loading (a tensor-parallel rank)
        self.step_delay = step_delay  # a test hook: seconds to sleep before each step (a slow model)
        self.state: State = "loading"
        self.phase: startup.Phase | None = None  # the start-up phase running
        self.phase_started = time.monotonic()
        self.load_error: str | None = None
        self.engine: ServedModel | None = None
        self._commands: deque[tuple[str, Job, tuple[str, ...]]] = deque()  # consumed between steps
        self._jobs: set[Job] = set()  # admitted by submit, not done yet (the 429 limit counts them)
        self._rows: dict[str, Job] = {}  # engine request id -> its job (engine thread only)
        self._preemptions = 0  # the engine's count the metrics have seen
        self._draining = False  # shutting down: no new work, the jobs in flight may finish
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._main, name="ddtree-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def capacity(self) -> int:
        """Requests that may be in the engine at once: a full batch running plus ``max_queue`` waiting."""
        return self.engine.engine.config.max_num_seqs + self.max_queue

    def submit(self, job: Job) -> None:
        """Hand ``job`` to the engine thread; raises QueueFull or ShuttingDown instead of waiting."""
        with self._cond:
            if self._stopping or self._draining:
                raise ShuttingDown()
            if len(self._jobs) >= self.capacity:
                raise QueueFull()
            self._jobs.add(job)
            self._commands.append(("add", job, ()))
            self._count()
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop ``job``: its rows leave the engine at the next step boundary (nothing if it is done)."""
        with self._cond:
            if job.done or self._stopping:
                return
            self._commands.append(("abort", job, ()))
            self._cond.notify()

    def abort_rows(self, job: Job, request_ids: list[str]) -> None:
        """End some rows of ``job`` (a stop string the API side found): they leave the engine at the next
        step boundary, within one step."""
        with self._cond:
            if job.done or self._stopping:
                return
            self._commands.append(("abort_rows", job, tuple(request_ids)))
            self._cond.notify()

    def drain(self, timeout: float, stop_timeout: float) -> int:
        """Refuse new work, give the jobs in flight (running or queued) up to ``timeout`` seconds to finish,
        then stop: the engine thread fails the rest with ShuttingDown, which their requests answer the
        OpenAI way (a JSON error, or an error event and ``[DONE]``). Returns how many were cut."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._draining = True
            while self._jobs and deadline > time.monotonic():
                self._cond.wait(deadline - time.monotonic())
            cut = len(self._jobs)
        self.stop(stop_timeout)
        return cut

    def stop(self, timeout: float) -> None:
        """Refuse new work, fail what is left, wait ``timeout`` for the thread.

        By the time the app stops, uvicorn has already drained (or, past ``--shutdown-timeout``, dropped)
        every request in flight, so this normally finds nothing left.
        """
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self.state == "ready" and self._thread.is_alive():  # a load in progress cannot be interrupted
            self._thread.join(timeout)

    def fail(self, reason: str) -> None:
        """The engine cannot run any more (a tensor-parallel rank died; called from any thread): not ready
        from now on, the jobs in flight fail, the engine thread ends, and the server is told to exit."""
        log.error("the engine failed: %s", reason)
        self.load_error = reason
        self.state = "dead"
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self.on_engine_failed is not None:
            self.on_engine_failed(reason)

    def _entered(self, phase: startup.Phase) -> None:
        self.phase, self.phase_started = phase, time.monotonic()

    @property
    def progress(self) -> str | None:
        """While loading: the start-up phase and how long it has run (``/ready``'s message)."""
        if self.state not in ("loading", "warming") or self.phase is None:
            return None
        return f"{self.phase}, {time.monotonic() - self.phase_started:.0f} s so far"

    # -- the thread ---------------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            with startup.listening(self._entered):
                model = self.engine_factory()  # a compiled engine compiles (and captures) every shape here
                log_compile(model.engine)
                self.state = "warming"
                if self.warmup is not None:
                    with startup.phase("warm-up"):
                        self.warmup(model)
        except BaseException as exc:  # any load failure ends the server
            self.state = "failed"
            self.load_error = str(exc) or type(exc).__name__
            log.error("loading the engine failed: %s", self.load_error)
            if self.on_load_failed is not None:
                self.on_load_failed(exc)
            return
        self.engine = model
        self.state = "ready"
        engine = model.engine
        engine.watch_ranks(self.fail)
        log.info(
            "engine ready (batches of up to %d requests, %d torch threads)",
            engine.config.max_num_seqs,
            torch.get_num_threads(),  # this thread's: the one that runs every forward
        )
        pool = engine.kv_cache_summary()
        log.info(
            "KV cache: %d blocks of %d tokens, %d tokens (%.2f GiB, %s), %d bytes per token (%s); maximum "
            "concurrency for max-model-len requests (%d tokens): %.1fx; prefix caching %s",
            engine.blocks.num_blocks - 1,
            engine.blocks.block_size,
            pool["kv_cache_tokens"],
            engine.runner.kv_cache_bytes / (1 << 30),
            pool["kv_cache_dtype"],
            pool["kv_cache_bytes_per_token"],
            pool["kv_cache_layout"],
            engine.max_model_len,
            pool["max_concurrency"],
            "on" if pool["prefix_caching"] else "off",
        )
        self._count()
        try:
            self._loop(model)
        finally:
            self._fail_all(ShuttingDown())
            engine.close()  # here, on the thread that steps it: its tensor-parallel ranks stop with it

    def _loop(self, model: ServedModel) -> None:
        engine = model.engine
        while True:
            with self._cond:
                while not self._commands and not self._rows and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, deque()
            for kind, job, request_ids in commands:
                if kind == "add":
                    self._add(engine, job)
                elif kind == "abort":
                    self._finish(job, abort=True)
                else:
                    self._end_rows(engine, job, request_ids)
            self._count()
            if self._rows:  # the worker's own rows: it steps only for its requests
                if self.step_delay > 0:
                    time.sleep(self.step_delay)
                self._step(engine)
                self._count()

    def _add(self, engine, job: Job) -> None:
        """Queue the job's rows in the engine (all or none); a request the engine refuses fails alone."""
        o = job.options
        try:
            for row in job.rows:
                engine.add_request(
                    row.prompt_ids,
                    row.params,
                    request_id=row.request_id,
                    method=o.method,
                    budget=o.budget,
                    topk=o.topk,
                    cache_salt=o.cache_salt,
                )
                job.live.add(row.request_id)
        except Exception as exc:  # a 400 (or a bug) for this request only
            self._finish(job, error=exc, abort=True)
            return
        for request_id in job.live:
            self._rows[request_id] = job
        self.metrics.prompt_tokens.inc(job.prompt_tokens)
        job.emit(Started(job.prompt_tokens))

    def _end_rows(self, engine, job: Job, request_ids: tuple[str, ...]) -> None:
        for request_id in request_ids:
            if request_id in job.live:
                engine.abort(request_id)
                self._row_ended(job, request_id)

    def _row_ended(self, job: Job, request_id: str) -> None:
        """A row left the engine; the job finishes with its last one."""
        self._forget(job, request_id)
        if not job.live:
            self._finish(job)

    def _forget(self, job: Job, request_id: str) -> None:
        job.live.discard(request_id)
        self._rows.pop(request_id, None)

    def _step(self, engine) -> None:
        start, rows = time.perf_counter(), engine.num_running
        try:
            deltas = engine.step()
        except TensorParallelError as exc:  # a rank failed mid-step: the engine is gone (one line, no trace)
            for job in {*self._rows.values()}:
                self._finish(job, error=exc)
            if self.state != "dead":  # the rank watcher may have said so first
                self.fail(str(exc))
            return
        except Exception as exc:  # every request's share failed alone too: the engine's (device's) fault
            log.exception("an engine step failed whatever requests it ran; the engine stops")
            for job in {*self._rows.values()}:
                self._finish(job, error=exc, abort=True)
            self.fail(f"an engine step failed: {type(exc).__name__}: {exc}")
            return
        self.metrics.step_seconds.observe(time.perf_counter() - start)
        if rows:  # a step that only admitted ran no round
            self.metrics.step_rows.observe(rows)
        for delta in deltas:
            job = self._rows.get(delta.request_id)
            if job is None or job.done:
                continue
            if not job.running:
                job.running = True
                self.metrics.queue_wait.observe(time.perf_counter() - job.enqueued_at)
            if delta.finish_reason == "error":  # the engine traced a step's failure to this request
                self._forget(job, delta.request_id)
                failure = RequestFailed(f"this request failed in the engine: {delta.error}")
                self._finish(job, error=failure, abort=True)
                continue
            job.emit(RowDelta(delta, len(delta.stats.acceptance_lengths)))
            if delta.finish_reason is not None:
                self._row_ended(job, delta.request_id)

    def _finish(self, job: Job, error: BaseException | None = None, abort: bool = False) -> None:
        """The job is done: its rows leave the engine (``abort``), its request gets FINISHED or ``error``."""
        if job.done:
            return
        for request_id in list(job.live):
            if abort:
                self.engine.engine.abort(request_id)
            self._forget(job, request_id)
        with self._cond:
            job.done = True
            self._jobs.discard(job)
            self._cond.notify_all()  # a drain may be waiting for the last job
        job.emit(FINISHED if error is None else Failed(error))

    def _fail_all(self, error: BaseException) -> None:
        with self._cond:
            left = list(self._jobs)
        for job in left:
            self._finish(job, error=error, abort=True)
        self._count()

    def _count(self) -> None:
        """Gauges: requests (HTTP) waiting and running; engine rows waiting and running."""
        with self._cond:
            running = sum(job.running for job in self._jobs)
            waiting = len(self._jobs) - running
        self.metrics.queue_depth.set(waiting)
        self.metrics.running.set(running)
        if self.engine is not None and threading.current_thread() is self._thread:
            engine = self.engine.engine
            self.metrics.rows_running.set(engine.num_running)
            self.metrics.rows_waiting.set(engine.num_waiting)
            used, free = engine.blocks.num_used, engine.blocks.num_free
            self.metrics.kv_blocks.labels("used").set(used)
            self.metrics.kv_blocks.labels("free").set(free)
            self.metrics.kv_usage.set(used / max(used + free, 1))
            self.metrics.preemptions.inc(engine.num_preemptions - self._preemptions)
            self._preemptions = engine.num_preemptions
            self.metrics.record_prefix_cache(engine.blocks.queried_tokens, engine.blocks.hit_tokens)
            self.metrics.record_auto(engine.auto.status)


def log_compile(engine) -> None:
    """Once at start-up: how long a compiled engine took to compile its shapes (``/ready`` waited for it)."""
    shapes = engine.runner.shapes
    if not shapes.compiled:
        return
    log.info(
        "engine compiled in %.1f s: batch buckets %s, node buckets %s, span buckets %s, attention %s",
        engine.warmup_seconds,
        ",".join(map(str, shapes.batch_buckets)),
        ",".join(map(str, shapes.node_buckets)),
        ",".join(map(str, shapes.span_buckets)),
        shapes.attention,
    )
