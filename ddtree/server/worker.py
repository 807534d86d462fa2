"""The one thread that owns the engine: it loads it, warms it up, then runs queued jobs one at a time.

The engine is batch-1 and not thread-safe, so nothing else ever touches it (nor its tokenizer). Requests
become :class:`Job` s in a bounded FIFO; a full queue refuses at once (the caller answers 429). A job's
``work`` is a generator run on this thread; each item it yields is handed to the request's event loop.
Cancelling a job (client gone, timeout) removes it from the queue or, if it is running, closes its
generator after the current round, which closes the engine's stream and frees the engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, Literal

from ddtree.server.metrics import Metrics

log = logging.getLogger("ddtree.server")

State = Literal["loading", "warming", "ready", "failed"]
Work = Callable[[Any], Generator[object, None, None]]  # engine -> the items to hand back


class QueueFull(Exception):
    """Every queue slot is taken."""


class ShuttingDown(Exception):
    """The server is stopping and takes no more work."""


@dataclass(frozen=True)
class Failed:
    """The job's work raised; the request re-raises ``error`` on its own task."""

    error: BaseException


FINISHED = object()  # the last item of a job that ran to its end


class Job:
    """One request's work and the channel its items come back on (an asyncio queue on the request's loop)."""

    def __init__(self, work: Work, loop: asyncio.AbstractEventLoop) -> None:
        self.work = work
        self.loop = loop
        self.items: asyncio.Queue[object] = asyncio.Queue()
        self.cancelled = threading.Event()
        self.enqueued_at = time.perf_counter()

    def emit(self, item: object) -> None:
        """Hand ``item`` to the request (thread-safe)."""
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


class EngineWorker:
    """Loads the engine with ``engine_factory`` on its own thread, warms it up, then serves the queue."""

    def __init__(
        self,
        engine_factory: Callable[[], Any],
        metrics: Metrics,
        max_queue: int,
        warmup: Callable[[Any], None] | None = None,
        on_load_failed: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine_factory = engine_factory
        self.metrics = metrics
        self.max_queue = max_queue
        self.warmup = warmup
        self.on_load_failed = on_load_failed
        self.state: State = "loading"
        self.load_error: str | None = None
        self.engine: Any = None
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._main, name="ddtree-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises QueueFull or ShuttingDown instead of waiting."""
        with self._cond:
            if self._stopping:
                raise ShuttingDown()
            idle_engine = 1 if self._running is None else 0  # the first waiting job is about to run
            if len(self._waiting) >= self.max_queue + idle_engine:
                raise QueueFull()
            self._waiting.append(job)
            self.metrics.queue_depth.set(len(self._waiting))
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop ``job``: out of the queue now, or out of the engine after the current round."""
        job.cancelled.set()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return
            self.metrics.queue_depth.set(len(self._waiting))

    def stop(self, timeout: float) -> None:
        """Refuse new work, fail what waits, stop the running job, wait ``timeout`` for the thread."""
        with self._cond:
            self._stopping = True
            pending, self._waiting = list(self._waiting), deque()
            self.metrics.queue_depth.set(0)
            if self._running is not None:
                self._running.cancelled.set()
            self._cond.notify_all()
        for job in pending:
            job.emit(Failed(ShuttingDown()))
        if self.state == "ready" and self._thread.is_alive():  # a load in progress cannot be interrupted
            self._thread.join(timeout)

    # -- the thread ---------------------------------------------------------------------------------------

    def _main(self) -> None:
        try:
            engine = self.engine_factory()
            self.state = "warming"
            if self.warmup is not None:
                self.warmup(engine)
        except BaseException as exc:  # any load failure ends the server
            self.state = "failed"
            self.load_error = str(exc) or type(exc).__name__
            log.error("loading the engine failed: %s", self.load_error)
            if self.on_load_failed is not None:
                self.on_load_failed(exc)
            return
        self.engine = engine
        self.state = "ready"
        log.info("engine ready")
        while True:
            with self._cond:
                while not self._waiting and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._waiting.popleft()
                self.metrics.queue_depth.set(len(self._waiting))
                self._running = job
            try:
                self._run(job, engine)
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: Job, engine: Any) -> None:
        if job.cancelled.is_set():
            return
        self.metrics.queue_wait.observe(time.perf_counter() - job.enqueued_at)
        self.metrics.running.inc()
        items = None
        try:
            items = job.work(engine)
            for item in items:
                if job.cancelled.is_set():
                    return
                job.emit(item)
            job.emit(FINISHED)
        except Exception as exc:  # handed to the request, which turns it into an error answer
            job.emit(Failed(exc))
        finally:
            if items is not None:
                items.close()  # closes the engine's stream when the job stopped early
            self.metrics.running.dec()
