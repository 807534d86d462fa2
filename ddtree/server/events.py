"""Waiting on a job from the request's side: its items, a client that hangs up, a deadline; and SSE.

Whatever ends the wait (the last item, a disconnect, the timeout, an exception, the response being
dropped) cancels the job, so a request that no longer has a reader never keeps the engine or its queue
slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from ddtree.engine.step_channel import TensorParallelError
from ddtree.errors import DDTreeError, RequestFailed
from ddtree.server.errors import APIError, ClientGone, error_body, invalid
from ddtree.server.generation import Generation, Piece, RowDelta
from ddtree.server.metrics import Metrics
from ddtree.server.responses import ChatAnswer, CompletionAnswer
from ddtree.server.worker import FINISHED, EngineWorker, Failed, Job, ShuttingDown

log = logging.getLogger("ddtree.server")


async def job_items(
    job: Job, request: Request, worker: EngineWorker, metrics: Metrics, deadline: float, timeout: float
) -> AsyncIterator[object]:
    """The job's items in order; raises ClientGone, a 504 APIError, or what the job raised."""
    gone = asyncio.ensure_future(_client_gone(request))
    get: asyncio.Future | None = None
    ended = False  # the job finished, failed or timed out; if not, the client left
    try:
        while True:
            get = asyncio.ensure_future(job.items.get())
            left = max(0.0, deadline - time.perf_counter())
            done, _ = await asyncio.wait({get, gone}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                if gone in done:
                    raise ClientGone()
                ended = True
                metrics.cancelled.labels("timeout").inc()
                raise APIError(
                    504,
                    f"the request did not finish within {timeout:g} s",
                    "timeout_error",
                    None,
                    "request_timeout",
                )
            item = get.result()
            if item is FINISHED:
                ended = True
                return
            if isinstance(item, Failed):
                ended = True
                if isinstance(item.error, ShuttingDown):
                    message = "the server shut down before this request finished"
                    raise APIError(503, message, "service_unavailable", None, "shutting_down")
                if isinstance(item.error, TensorParallelError):  # the server's fault, not the request's
                    raise APIError(500, str(item.error), "server_error", None, "engine_failed")
                if isinstance(item.error, RequestFailed):  # this request alone: the others went on
                    raise APIError(500, str(item.error), "server_error", None, "request_failed")
                raise item.error
            yield item
    finally:
        gone.cancel()
        if get is not None:
            get.cancel()
        worker.cancel(job)
        if not ended:  # the client left: noticed here, or by Starlette, which cancelled this task
            metrics.cancelled.labels("disconnect").inc()


async def job_pieces(
    items: AsyncIterator[object], generation: Generation, worker: EngineWorker, job: Job
) -> AsyncIterator[Piece]:
    """The request's pieces, made here on the API side from its rows' token ids. A stop string found here
    ends its row at once and aborts it in the engine at the next step; the job finishes (and the items end)
    once the engine has let go of every row."""
    try:
        async for item in items:
            assert isinstance(item, RowDelta)
            piece = generation.piece(item)
            if piece is None:  # a row already cut here: the engine ran it one more step
                continue
            if piece.finish_reason is not None and item.delta.finish_reason is None:
                worker.abort_rows(job, [item.delta.request_id])
            yield piece
    finally:
        generation.close()
        await items.aclose()  # type: ignore[attr-defined]


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so nothing else arrives before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


async def event_stream(
    items: AsyncIterator[object], answer: CompletionAnswer | ChatAnswer, on_first_token
) -> AsyncIterator[str]:
    """SSE: the answer's chunks, then ``[DONE]``; a failure mid-stream becomes an error event first."""
    failure: dict | None = None
    try:
        async for piece in items:
            assert isinstance(piece, Piece)
            if piece.num_tokens:
                on_first_token()
            for chunk in answer.chunks(piece):
                yield sse(chunk)
        for chunk in answer.closing_chunks():
            yield sse(chunk)
    except ClientGone:
        return
    except APIError as exc:
        failure = exc.body()
    except DDTreeError as exc:
        failure = invalid(str(exc)).body()
    except Exception:
        log.exception("internal error while streaming")
        failure = error_body("internal server error", "server_error")
    finally:
        await items.aclose()  # type: ignore[attr-defined]
    if failure is not None:
        yield sse(failure)
    yield sse("[DONE]")


class EventStreamResponse(StreamingResponse):
    """SSE that always closes its generator, so a dropped client cancels its job at once, not at GC."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
