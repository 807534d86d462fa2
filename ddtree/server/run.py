"""``ddtree serve``: bind the port, hand the socket to uvicorn, load the models in the background.

Binding comes first so a taken port fails in a second with a clear message, not after minutes of
loading weights. SIGTERM (or Ctrl-C) stops accepting connections and lets every in-flight request (running
or queued) finish for up to ``--shutdown-timeout`` seconds; what is still running then ends the OpenAI way
(a JSON 503 ``shutting_down``, or for a stream an error event and ``data: [DONE]``). The exit code is 0 when
every request finished, 1 when some had to be cut. A model that fails to load stops the server with exit 2.
A signal at any other moment of ``serve`` (binding, loading, warming up) stops it the same way, with 0.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import errno
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import NoReturn

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from ddtree.errors import DDTreeError
from ddtree.model.loader import check_model_dir
from ddtree.server.app import create_app
from ddtree.server.auth import api_keys, open_access_warning
from ddtree.server.config import DEFAULT_MODEL_NAME, ServerConfig

LOAD_DELAY_ENV = "DDTREE_TEST_LOAD_DELAY"  # test hook: seconds to sleep before loading (a slow disk)
STEP_DELAY_ENV = (
    "DDTREE_TEST_STEP_DELAY"  # test hook: seconds to sleep before each engine step (a slow model)
)


def bind(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A listening socket, or a DDTreeError that says why not (port taken, bad address)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise DDTreeError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # reuse TIME_WAIT ports; never a live listener
    try:
        sock.bind(address)
        sock.listen(backlog)
    except OSError as exc:
        sock.close()
        reason = "the port is already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise DDTreeError(f"cannot listen on {host}:{port}: {reason}") from None
    return sock


def log_config(level: str) -> dict:
    """uvicorn's logging, with ddtree's server logger on the same handler."""
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["ddtree"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return config


EXIT_REQUESTS_CUT = 1  # the drain time ran out: some requests ended with a shutting_down error
EXIT_ENGINE_FAILED = 1  # the engine died while serving (a tensor-parallel rank exited)
FAILED_GRACE_SECONDS = 2.0  # a dead engine: /ready answers 503 this long before the server stops
FLUSH_SECONDS = 5.0  # after the drain, for the cut requests' error answers to reach their clients


class DrainingServer(uvicorn.Server):
    """uvicorn whose shutdown drains the engine first: stop accepting, give the requests in flight the
    drain time, then let the engine worker end the rest with an error their handlers answer properly.

    uvicorn's own graceful timeout cancels the request tasks instead: a 500 with a plain-text body, a
    stream cut without an error event or ``[DONE]``, and an ASGI traceback in the log.
    """

    def __init__(self, config: uvicorn.Config, app, drain_seconds: float) -> None:
        super().__init__(config)
        self.drain_seconds = drain_seconds
        self.app_state = app.state.ddtree
        self.cut = 0  # requests ended by the shutdown

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections while draining
        for sock in sockets or []:
            sock.close()
        worker, config = self.app_state.worker, self.app_state.config
        self.cut = await asyncio.to_thread(worker.drain, self.drain_seconds, config.engine_stop_timeout)
        if self.cut:
            log = logging.getLogger("ddtree.server")
            log.warning("shutdown: %d request(s) still running after %g s were ended", self.cut,
                        self.drain_seconds)  # fmt: skip
        await super().shutdown(sockets)


class StopSignals:
    """SIGTERM and SIGINT while uvicorn is not listening for them (before it starts, after it stops): each
    is recorded and stops the server, instead of killing the process by the signal (uvicorn re-raises the
    ones it caught once it has stopped: these handlers let the process exit normally then)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.server: uvicorn.Server | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, sig: int, frame: FrameType | None) -> None:
        self.received.append(sig)
        if self.server is not None:
            self.server.should_exit = True

    def serving(self, server: uvicorn.Server) -> None:
        """``server`` stops for a signal from now on (at once, after its start-up, for one received)."""
        self.server = server
        server.should_exit = bool(self.received)


def run_app(
    app,
    sock: socket.socket,
    shutdown_timeout: float,
    level: str = "info",
    access_log: bool = False,
    signals: StopSignals | None = None,
):
    """Serve ``app`` on ``sock`` until SIGTERM/SIGINT; returns the server once it has stopped (``cut``: the
    requests its shutdown had to end)."""
    config = uvicorn.Config(
        app,
        log_config=log_config(level),
        log_level=level,
        access_log=access_log,
        timeout_graceful_shutdown=FLUSH_SECONDS,
        lifespan="on",
    )
    server = DrainingServer(config, app, shutdown_timeout)
    app.state.uvicorn = server
    (signals or StopSignals()).serving(server)
    server.run(sockets=[sock])
    return server


def exit_process(code: int) -> NoReturn:
    """Exit with ``code``. While a thread still runs (a model load cannot be interrupted, nor an engine
    step), the interpreter's exit would destroy torch's C++ state under it and abort the process
    ("terminate called without an active exception", SIGABRT), and so would gloo's threads after tensor
    parallelism: then the logs are flushed and the process ends at once, without that teardown."""
    from ddtree.engine.step_channel import exit_after_group, joined_group

    threads = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    if threads or joined_group():
        exit_after_group(code)
    sys.exit(code)


def generation_config(args: argparse.Namespace) -> str:
    """``--generation-config`` with ``auto`` resolved: the target's directory when it has a
    ``generation_config.json`` (the built-in target's too), else ``vllm`` (OpenAI's defaults)."""
    from ddtree.model.loader import DEFAULT_TARGET

    if args.generation_config != "auto":
        return args.generation_config
    target = Path(args.target or DEFAULT_TARGET)
    return str(target) if (target / "generation_config.json").is_file() else "vllm"


def serve(args: argparse.Namespace, engine_from_args: Callable[[argparse.Namespace], object]) -> None:
    """The ``serve`` command: checks the server's flags (``ServerConfig.from_args``), binds, serves; raises
    DDTreeError for the CLI's exit 2. The engine's flags are the caller's to check
    (``ddtree.cli.check_engine_flags``)."""
    config = ServerConfig.from_args(
        args,
        model_name=args.model_name or (Path(args.target).name if args.target else DEFAULT_MODEL_NAME),
        generation_config=generation_config(args),
        trust_remote_code=bool(getattr(args, "trust_remote_code", False)),
        api_keys=api_keys(args.api_keys, os.environ),
        step_delay=float(os.environ.get(STEP_DELAY_ENV, "0") or 0),
        start_body_parser=True,
    )
    signals = StopSignals()  # from here on a signal stops the server cleanly, whatever it is doing
    if args.target is not None:
        check_model_dir(args.target, "target")
    delay = float(os.environ.get(LOAD_DELAY_ENV, "0") or 0)

    sock = bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    print(f"ddtree serve: listening on http://{host}:{port} (pid {os.getpid()})", file=sys.stderr, flush=True)
    warning = open_access_warning(host, port, config.api_keys)
    if warning:
        print(warning, file=sys.stderr, flush=True)

    def load():
        if delay > 0:
            time.sleep(delay)
        return engine_from_args(args)

    failures: list[BaseException] = []
    died: list[str] = []

    def load_failed(exc: BaseException) -> None:
        failures.append(exc)
        app.state.uvicorn.should_exit = True

    def engine_failed(reason: str) -> None:
        died.append(reason)
        # /ready answers 503 a moment before the listener closes, so that health checks see why
        threading.Timer(FAILED_GRACE_SECONDS, setattr, (app.state.uvicorn, "should_exit", True)).start()

    app = create_app(load, config, on_load_failed=load_failed, on_engine_failed=engine_failed)
    server = run_app(app, sock, config.shutdown_timeout, config.log_level, config.access_log, signals)
    if failures:
        raise DDTreeError(f"cannot serve: {failures[0]}")
    if died:
        print(f"ddtree serve: the engine stopped: {died[0]}", file=sys.stderr)
        exit_process(EXIT_ENGINE_FAILED)
    if server.cut:
        print(
            f"ddtree serve: {server.cut} request(s) did not finish within --shutdown-timeout "
            f"{config.shutdown_timeout:g} s and ended with a shutting_down error",
            file=sys.stderr,
        )
        exit_process(EXIT_REQUESTS_CUT)
    exit_process(0)
