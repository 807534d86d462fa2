"""Where each step's deltas go: to the stream that follows their request, or to the next ``step``'s caller.

``Engine.stream`` and ``Engine.generate`` follow their requests: reading one steps the engine whenever
its queue is empty, so every other request advances too and its deltas wait in its own queue. Deltas of
requests nobody follows (``add_request`` + ``step``, vLLM's ``LLMEngine`` loop) are returned by ``step``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator

from ddtree.engine.request import StreamDelta


class Streams:
    """The followed requests' queues over ``advance`` (one engine step's deltas) and ``abort``."""

    def __init__(self, advance: Callable[[], list[StreamDelta]], abort: Callable[[str], bool]) -> None:
        self.advance = advance
        self.abort = abort
        self.followed: dict[str, deque[StreamDelta]] = {}  # request id -> deltas its stream has not read
        self.unclaimed: list[StreamDelta] = []  # deltas the next ``step`` returns

    def step(self) -> list[StreamDelta]:
        """One step; the deltas no stream follows (with those routed since the last call)."""
        self.route(self.advance())
        out, self.unclaimed = self.unclaimed, []
        return out

    def route(self, deltas: list[StreamDelta]) -> None:
        """Each delta to its request's stream, or to the next ``step``'s return value."""
        for delta in deltas:
            queue = self.followed.get(delta.request_id)
            (self.unclaimed if queue is None else queue).append(delta)

    def follow(self, request_id: str) -> Iterator[StreamDelta]:
        """The deltas of one request, stepping whenever none is waiting (registered now, so nothing is
        lost between this call and the first ``next``); closing the iterator early aborts the request."""
        queue = self.followed[request_id] = deque()
        return self._drain(request_id, queue)

    def _drain(self, request_id: str, queue: deque[StreamDelta]) -> Iterator[StreamDelta]:
        done = False
        try:
            while not done:
                while not queue:
                    self.route(self.advance())  # an abort from elsewhere queues the request's last delta
                delta = queue.popleft()
                done = delta.finish_reason is not None
                yield delta
        finally:
            if not done:
                self.abort(request_id)  # its "abort" delta goes to this queue, read by nobody
            del self.followed[request_id]
