"""``ddtree bench serve``: load a server over HTTP with streaming requests; measure what its clients see.

Each level of the sweep is either a number of concurrent clients (``--concurrency 1,4,16,64``: that many
clients, each sending its next request as soon as its last one ended) or a Poisson request rate
(``--request-rate 2,8``: requests arrive at exponentially spaced times, however many are in flight).
Every request streams ``/v1/completions`` with ``stream_options.include_usage``; a level reports request
throughput, output tokens/s, TTFT, TPOT and ITL (mean, p50, p90, p99) and failures by status. Writes
``results.json``, ``results.md`` and ``serve.png`` to ``--out``. ``--start-server ARGS...`` (last on the
line) starts ``ddtree serve --port 0 ARGS...`` first and stops it (SIGTERM) at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import httpx
import numpy as np

from ddtree.argparsing import comma_list
from ddtree.errors import DDTreeError

LISTENING = re.compile(r"listening on (http://[\d.:\[\]a-zA-Z-]+)")


@dataclass
class RequestRecord:
    """One request as the client saw it; times in seconds from the request's start."""

    status: str  # "200", an HTTP status, "error_event" (an error inside the stream) or "transport"
    latency: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk that carried text
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, read from the server's prefix cache
    error: str | None = None  # the server's message, for a failure

    @property
    def ok(self) -> bool:
        return self.status == "200"


def add_serve_bench_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server to load")
    p.add_argument("--concurrency", type=comma_list(int, "--concurrency"), default=(1, 4, 16, 64),
                   help="comma-separated numbers of concurrent clients (default 1,4,16,64)")  # fmt: skip
    p.add_argument("--request-rate", type=comma_list(float, "--request-rate"), default=None,
                   help="comma-separated Poisson request rates (req/s) instead")  # fmt: skip
    p.add_argument("--num-requests", type=int, default=0,
                   help="requests per level (0: 4 x concurrency, at least 8; 32 per rate)")  # fmt: skip
    p.add_argument("--prompts", default="builtin", help="'builtin' (default) or a FILE.jsonl")
    p.add_argument("--shared-prefix-tokens", type=int, default=0, metavar="N",
                   help="start every prompt with the same text of about N tokens (a system prompt the "
                   "clients share; the prefix cache's case). Default 0: none")  # fmt: skip
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens of every request (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    p.add_argument("--ignore-eos", action="store_true", help="every request generates --max-tokens")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--api-key", default=os.environ.get("DDTREE_API_KEY", "").split(",")[0] or None,
                   help="Bearer key (default: the first of $DDTREE_API_KEY)")  # fmt: skip
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests before the sweep (default 1)")
    p.add_argument("--seed", type=int, default=0, help="seeds the Poisson arrivals")
    p.add_argument("--label", default=None, help="a name for this run in the report (e.g. batch16)")
    p.add_argument("--out", type=Path, default=Path("runs/bench-serve"), help="output directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--start-server", nargs=argparse.REMAINDER, default=None, metavar="ARGS",
                   help="run 'ddtree serve --port 0 ARGS...' meanwhile (the last flag)")  # fmt: skip


SERVE_EXAMPLES = """examples:
  ddtree bench serve --base-url http://127.0.0.1:8000 --concurrency 1,4,16
  ddtree bench serve --concurrency 1,16 --max-tokens 128 --start-server --max-batch-size 16
  ddtree bench serve --concurrency 16 --shared-prefix-tokens 2000 --start-server --no-enable-prefix-caching"""


def register_bench_serve(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="load a running server over HTTP (throughput, TTFT, TPOT, ITL)",
        description="Drive an OpenAI-compatible server with streaming completions at each concurrency level "
        "(or a Poisson request rate) and report throughput and latency percentiles.",
        epilog=SERVE_EXAMPLES,
    )
    add_serve_bench_options(serve)
    serve.set_defaults(func=run_serve_bench_command)


# -- one request ------------------------------------------------------------------------------------------


async def one_request(http: httpx.AsyncClient, body: dict) -> RequestRecord:
    """Stream one completion; every chunk's arrival is timed."""
    start = time.perf_counter()
    record = RequestRecord(status="200")
    try:
        async with http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                record.status = str(r.status_code)
                record.error = _message(r.text)
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: ") :])
                    now = time.perf_counter() - start
                    if "error" in event:
                        record.status = "error_event"
                        record.error = str(event["error"].get("message"))
                    elif event.get("usage"):
                        record.output_tokens = event["usage"]["completion_tokens"]
                        record.prompt_tokens = event["usage"]["prompt_tokens"]
                        details = event["usage"].get("prompt_tokens_details") or {}
                        record.cached_tokens = details.get("cached_tokens") or 0
                    elif event.get("choices") and event["choices"][0].get("text"):
                        record.chunk_times.append(now)
                        if record.ttft is None:
                            record.ttft = now
    except (httpx.TransportError, json.JSONDecodeError) as exc:
        record.status, record.error = "transport", str(exc) or type(exc).__name__
    record.latency = time.perf_counter() - start
    return record


def _message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()[:200]


# -- one level --------------------------------------------------------------------------------------------


async def run_level(
    url: str,
    bodies: list[dict],
    concurrency: int | None,
    rate: float | None,
    args: argparse.Namespace,
    progress,
) -> tuple[list[RequestRecord], float]:
    """Send ``bodies`` with ``concurrency`` clients or at Poisson ``rate``; (records, wall seconds)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout, connect=30)
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) as http:

        async def send(body: dict) -> None:
            records.append(await one_request(http, body))
            progress.update(1)

        start = time.perf_counter()
        if rate is None:
            queue = list(reversed(bodies))

            async def client() -> None:
                while queue:
                    await send(queue.pop())

            await asyncio.gather(*(client() for _ in range(concurrency)))
        else:
            rng = np.random.default_rng(args.seed)
            tasks = []
            for body in bodies:
                tasks.append(asyncio.create_task(send(body)))
                await asyncio.sleep(rng.exponential(1.0 / rate))
            await asyncio.gather(*tasks)
        return records, time.perf_counter() - start


def request_bodies(args: argparse.Namespace, model: str, prompts: list, count: int) -> list[dict]:
    base = {
        "model": model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        base["ignore_eos"] = True
    text_prefix, id_prefix = shared_prefixes(prompts, args.shared_prefix_tokens)
    out = []
    for i in range(count):
        p = prompts[i % len(prompts)]
        prompt = text_prefix + p.text if p.text is not None else id_prefix + list(p.token_ids)
        out.append(base | {"prompt": prompt})
    return out


def shared_prefixes(prompts: list, tokens: int) -> tuple[str, list[int]]:
    """About ``tokens`` tokens every prompt starts with, for text and for token-id prompts: the prompts'
    own text (or ids) run together and cut, so it reads like the rest (3.4 characters a token: the
    built-in tokenizer on code)."""
    if not tokens:
        return "", []
    ids = [t for p in prompts if p.token_ids is not None for t in p.token_ids]
    text = "\n".join(p.text for p in prompts if p.text is not None)
    chars = int(tokens * 3.4)
    ids = (ids * (tokens // max(len(ids), 1) + 1))[:tokens]
    return (text * (chars // max(len(text), 1) + 1))[:chars] + "\n", ids


# -- a server of our own ----------------------------------------------------------------------------------


class StartedServer:
    """``ddtree serve --port 0 ARGS`` as a child process; its log goes to a temporary file."""

    def __init__(self, server_args: list[str]) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="ddtree-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddtree.cli", "serve", "--port", "0", *server_args],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.url = self._wait_for(lambda text: LISTENING.search(text), 120).group(1)

    def text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def _wait_for(self, found, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = found(self.text())
            if match:
                return match
            if self.proc.poll() is not None:
                raise DDTreeError(f"the server exited with {self.proc.returncode}:\n{self.text().strip()}")
            time.sleep(0.1)
        raise DDTreeError(f"the server did not start within {timeout:g} s")

    def wait_ready(self, timeout: float = 1800) -> None:
        def ready(_text: str) -> bool:
            try:
                return httpx.get(f"{self.url}/ready", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        self._wait_for(ready, timeout)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        return self.proc.returncode


# -- the command ------------------------------------------------------------------------------------------


def check_args(args: argparse.Namespace) -> None:
    for flag, values in (("concurrency", args.concurrency), ("request_rate", args.request_rate or ())):
        if any(v <= 0 for v in values):
            raise DDTreeError(f"--{flag.replace('_', '-')} must list values > 0, got {values}")
    for flag in ("num_requests", "warmup"):
        if getattr(args, flag) < 0:
            raise DDTreeError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.shared_prefix_tokens < 0:
        raise DDTreeError(f"--shared-prefix-tokens must be >= 0, got {args.shared_prefix_tokens}")
    if args.max_tokens < 1:
        raise DDTreeError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not args.timeout > 0:
        raise DDTreeError(f"--timeout must be > 0, got {args.timeout}")
    if not args.base_url.startswith(("http://", "https://")):
        raise DDTreeError(f"--base-url must start with http:// or https://, got {args.base_url!r}")


def levels(args: argparse.Namespace) -> list[dict]:
    if args.request_rate is not None:
        return [
            {"concurrency": None, "request_rate": r, "num_requests": args.num_requests or 32}
            for r in args.request_rate
        ]
    return [
        {"concurrency": c, "request_rate": None, "num_requests": args.num_requests or max(4 * c, 8)}
        for c in args.concurrency
    ]


def server_model(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(f"{url}/v1/models", headers=headers, timeout=30)
    except httpx.TransportError as exc:
        raise DDTreeError(f"cannot reach the server at {url}: {exc}") from None
    if r.status_code != 200:
        raise DDTreeError(f"{url}/v1/models answered {r.status_code}: {r.text.strip()[:200]}")
    return r.json()["data"][0]["id"]


def run_serve_bench_command(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from ddtree.bench.prompts import load_prompts
    from ddtree.bench.report import write_outputs
    from ddtree.bench.serve_report import level_summary, markdown, plot_serve

    check_args(args)
    prompts = load_prompts(args.prompts)
    plan = levels(args)
    server = StartedServer(args.start_server) if args.start_server is not None else None
    try:
        url = server.url if server is not None else args.base_url.rstrip("/")
        if server is not None:
            print(f"started a server at {url}; waiting for it to load", file=sys.stderr, flush=True)
            server.wait_ready()
        model = args.model or server_model(url, args.api_key)
        args.out.mkdir(parents=True, exist_ok=True)
        results = []
        total = args.warmup + sum(level["num_requests"] for level in plan)
        with tqdm(total=total, disable=args.no_progress, unit="req", desc="bench serve") as progress:
            if args.warmup:
                warm = request_bodies(args, model, prompts, args.warmup)
                asyncio.run(run_level(url, warm, 1, None, args, progress))
            for level in plan:
                bodies = request_bodies(args, model, prompts, level["num_requests"])
                records, seconds = asyncio.run(
                    run_level(url, bodies, level["concurrency"], level["request_rate"], args, progress)
                )
                results.append(
                    level | level_summary(records, seconds) | {"records": [asdict(r) for r in records]}
                )
    finally:
        exit_code = server.stop() if server is not None else None
    report = {
        "config": {
            "label": args.label,
            "base_url": None if server is not None else args.base_url,
            "server_args": args.start_server,
            "model": model,
            "prompts": str(args.prompts),
            "max_tokens": args.max_tokens,
            "shared_prefix_tokens": args.shared_prefix_tokens,
            "temperature": args.temperature,
            "ignore_eos": args.ignore_eos,
            "warmup": args.warmup,
            "argv": sys.argv,
        },
        "server_exit_code": exit_code,
        "levels": results,
    }
    write_outputs(args.out, report, markdown(report), {"serve.png": partial(plot_serve, report)})
