"""Large request bodies are decoded and validated in child processes, never on the event loop.

``json.loads`` and pydantic hold the GIL for the whole call, so a worker thread would not help: a 16 MiB
body (a million ``logit_bias`` entries, a list of 400,000 prompts) stopped every thread of the server for
seconds, every running stream included. A JSON body (by its Content-Type) over ``LARGE_BODY_BYTES`` goes
to one of a few parse processes (``python -m ddtree.server.body``; ``ddtree serve`` starts one with the
app, more start as large bodies overlap; each ends when its pipe closes): a bad body comes back as its 400
(small), a good one as the validated model, which FastAPI then takes as it is. Small bodies, and a body
whose process failed, take FastAPI's own path; the answers are the same either way, since a parse process
reads a body as FastAPI does and words its errors with ``errors.validation_error``.
"""

from __future__ import annotations

import asyncio
import email.message
import json
import logging
import os
import pickle
import signal
import struct
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, BinaryIO

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

from ddtree.server.errors import APIError, invalid, validation_error

LARGE_BODY_BYTES = 64 * 1024  # a body this small parses in well under a millisecond: on the loop
PARSE_PROCESSES = 2
NOT_PARSED = "There was an error parsing the body"  # FastAPI's 400 for a body that is not UTF-8 JSON
_FRAME = struct.Struct(">Q")  # each message on a parse process's pipes: its length, then its pickle

log = logging.getLogger("ddtree.server")

# A parse process's answer: the validated model, or its 400 as APIError's (status, message, type, param,
# code).
Parsed = BaseModel | tuple[int, str, str, str | None, str | None]


def parse(model: type[BaseModel], body: bytes) -> Parsed:
    """``body`` read as FastAPI reads it: ``json.loads``, then the model in Python mode."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError as exc:
        errors = [{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error"}]
        return _fields(validation_error(RequestValidationError(errors)))
    except (ValueError, RecursionError):  # not UTF-8, or nested too deep: FastAPI's plain 400
        return _fields(invalid(NOT_PARSED))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        located = [{**e, "loc": ("body", *e["loc"])} for e in errors]
        return _fields(validation_error(RequestValidationError(located)))


def _fields(error: APIError) -> Parsed:
    return error.status, error.message, error.type, error.param, error.code


def serve_parses(requests: BinaryIO, answers: BinaryIO) -> None:
    """A parse process: ``(model, body)`` frames in, :data:`Parsed` frames out, until ``requests`` ends."""
    while header := requests.read(_FRAME.size):
        model, body = pickle.loads(requests.read(_FRAME.unpack(header)[0]))
        answer = pickle.dumps(parse(model, body), protocol=pickle.HIGHEST_PROTOCOL)
        answers.write(_FRAME.pack(len(answer)) + answer)
        answers.flush()


class BodyParser:
    """One app's parse processes: at most ``processes``, each reading one body at a time."""

    def __init__(self, processes: int = PARSE_PROCESSES) -> None:
        self.processes = processes
        self._idle: list[asyncio.subprocess.Process] = []
        self._slots: asyncio.Semaphore | None = None  # made on the loop that serves the app
        self._closed = False

    async def parse(self, model: type[BaseModel], body: bytes) -> Parsed:
        """Raises if the process fails (it is ended; the next body starts a fresh one)."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.processes)
        async with self._slots:
            process = self._idle.pop() if self._idle else await _start()
            try:
                request = pickle.dumps((model, body), protocol=pickle.HIGHEST_PROTOCOL)
                process.stdin.write(_FRAME.pack(len(request)) + request)
                await process.stdin.drain()
                size = _FRAME.unpack(await process.stdout.readexactly(_FRAME.size))[0]
                answer = pickle.loads(await process.stdout.readexactly(size))
            except BaseException:  # mid-message (a crash, or this request was cancelled): never reused
                await _end(process, kill=True)
                raise
            if self._closed:
                await _end(process)
            else:
                self._idle.append(process)
            return answer

    async def start(self) -> None:
        """Start one process now (it loads the request models while the server starts), so the first
        large body does not wait for that; more start when large bodies overlap."""
        if not self._idle:
            self._idle.append(await _start())

    async def close(self) -> None:
        """End the idle processes; one still reading a body ends once it has answered."""
        self._closed = True
        idle, self._idle = self._idle, []
        for process in idle:
            await _end(process)


async def _start() -> asyncio.subprocess.Process:
    pipe = asyncio.subprocess.PIPE
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ddtree.server.body", stdin=pipe, stdout=pipe, env=_child_env()
    )


async def _end(process: asyncio.subprocess.Process, kill: bool = False) -> None:
    """A parse process ends when its requests pipe closes (``kill``: at once)."""
    if kill and process.returncode is None:
        process.kill()
    process.stdin.close()
    await process.wait()


class ParsedRequest(Request):
    """The request whose JSON body a parse process has read: FastAPI gets the validated model."""

    def __init__(self, request: Request, body: bytes, model: BaseModel) -> None:
        super().__init__(request.scope, request.receive)
        self._parsed_body = body
        self._parsed_model = model

    async def body(self) -> bytes:
        return self._parsed_body

    async def json(self) -> BaseModel:
        return self._parsed_model


class LargeBodyRoute(APIRoute):
    """A route whose large JSON body is read by the app's :class:`BodyParser` (``app.state.body_parser``)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        model = self.body_field.field_info.annotation if self.body_field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler

        async def route(request: Request) -> Response:
            body = await request.body()
            parser = getattr(request.app.state, "body_parser", None)
            if parser is None or len(body) <= LARGE_BODY_BYTES or not _is_json(request):
                return await handler(request)
            try:
                parsed = await parser.parse(model, body)
            except Exception:
                log.warning("a parse process failed; this body is parsed on the event loop", exc_info=True)
                return await handler(request)
            if isinstance(parsed, tuple):
                raise APIError(*parsed)
            return await handler(ParsedRequest(request, body, parsed))

        return route


def _child_env() -> dict[str, str]:
    """This environment, with the directory this ddtree is imported from first on the child's path."""
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return os.environ | {"PYTHONPATH": root + os.pathsep + path if path else root}


def _is_json(request: Request) -> bool:
    """FastAPI's rule for a body it decodes as JSON: ``application/json`` or ``application/*+json``."""
    content_type = request.headers.get("content-type")
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the group: the server decides
    import ddtree.server.protocol  # noqa: F401  (the models every body is read into: loaded before the first)

    serve_parses(sys.stdin.buffer, sys.stdout.buffer)
