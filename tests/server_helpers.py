"""Helpers for the server tests (no tests here): saved tiny models, a server process, an in-thread server.

Servers only ever listen on 127.0.0.1, on a port the kernel picks (``--port 0``), which the server
prints before it loads anything.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")


def server_env(**extra: str) -> dict[str, str]:
    return os.environ | {"OMP_NUM_THREADS": "1"} | extra  # tiny models; see conftest


class ServerProcess:
    """``ddtree serve`` as a child process; its stderr goes to a file the test can read."""

    def __init__(self, args: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.log_path = log
        self._log = open(log, "w")  # closed by wait() or close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddtree.cli", "serve", "--port", "0", *map(str, args)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env or server_env(),
        )
        self.url = self._wait_for_port(timeout=60)

    def _wait_for_port(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = LISTENING.search(self.log())
            if match:
                return f"http://{match.group(1)}:{match.group(2)}"
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            time.sleep(0.05)
        raise AssertionError(f"server did not bind in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = 60) -> dict:
        return wait_ready(self.url, timeout, self)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@contextmanager
def serving(args: list, log: Path, env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    """A ready ``ddtree serve`` process for the ``with`` block; stopped after it."""
    proc = ServerProcess(args, log, env)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.close()


def wait_ready(url: str, timeout: float = 60, process: ServerProcess | None = None) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/ready", timeout=5)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        if process is not None and process.proc.poll() is not None:
            raise AssertionError(f"server exited with {process.proc.returncode}:\n{process.log()}")
        time.sleep(0.05)
    raise AssertionError(f"server at {url} not ready in {timeout} s")


class ThreadServer:
    """An app from ``create_app`` served by uvicorn on a thread of the test process (real sockets)."""

    def __init__(self, app) -> None:
        import uvicorn

        from ddtree.server.run import bind

        self.sock = bind("127.0.0.1", 0)
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        wait_ready(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` through Prometheus' own text parser: {(sample name, sorted labels): value}."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def sse_events(lines) -> list:
    """The ``data:`` payloads of a server-sent event stream, ``[DONE]`` included."""
    import json

    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
