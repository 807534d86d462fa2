"""``ddtree serve --tensor-parallel-size 2`` as a real process with two gloo ranks: it becomes ready, serves
concurrent streams with one process's tokens, and ends every rank on SIGTERM; a rank that dies makes
``/ready`` answer 503 and the server exit non-zero."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from ddtree.engine import Engine
from ddtree.request.params import SamplingParams
from tests.server_helpers import ServerProcess, server_env

FLAGS = ["--tensor-parallel-size", "2", "--dtype", "float32", "--max-model-len", "512",
         "--kv-cache-memory", "64MiB", "--max-batch-size", "8"]  # fmt: skip
PROMPTS = [f"def f{i}(x):\n    return" for i in range(8)]
TOKENS = 24


def rank_pids(server: ServerProcess) -> list[int]:
    return [int(pid) for pid in re.findall(r"tensor-parallel rank \d+: pid (\d+)", server.log())]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0] == "Z"  # not a zombie


def wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(p) for p in pids)


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    engine = Engine.from_pretrained(dtype=torch.float32, max_model_len=512, kv_cache_memory="64MiB")
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=TOKENS, ignore_eos=True))
    return [r.text for r in results]


def test_serve_streams_eight_requests_at_once_and_sigterm_ends_every_rank(tmp_path, expected):
    server = ServerProcess(FLAGS, tmp_path / "serve.log")
    try:
        server.wait_ready(timeout=120)
        pids = rank_pids(server)
        assert len(pids) == 1 and alive(pids[0])
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)

        def stream(prompt: str) -> str:
            chunks = client.completions.create(
                model="ddtree-default", prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            return "".join(c.choices[0].text for c in chunks)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(stream, PROMPTS)) == expected
        server.terminate()
        assert server.wait(60) == 0
        wait_gone(pids, 15)
    finally:
        server.close()


def test_a_rank_that_dies_makes_ready_503_and_the_server_exit_nonzero(tmp_path):
    server = ServerProcess(FLAGS, tmp_path / "serve.log")
    try:
        server.wait_ready(timeout=120)
        (pid,) = rank_pids(server)
        os.kill(pid, 9)
        killed = time.monotonic()
        ready = None
        while server.proc.poll() is None and time.monotonic() - killed < 30:
            try:
                ready = httpx.get(f"{server.url}/ready", timeout=2)
            except httpx.TransportError:
                pass
            if ready is not None and ready.status_code == 503:
                break
            time.sleep(0.05)
        assert ready is not None and ready.status_code == 503, server.log()
        error = ready.json()["error"]
        assert error["code"] == "engine_failed" and "rank 1 exited" in error["message"]
        code = server.wait(30 - (time.monotonic() - killed))
        assert code != 0 and time.monotonic() - killed < 30
        assert "the engine stopped: tensor-parallel rank 1 exited" in server.log()
        assert "Traceback" not in server.log()
    finally:
        server.close()


def run_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=server_env())


GENERATE = ["generate", "def fibonacci(n):", "--max-new-tokens", "24", "--dtype", "float32"]


def test_generate_prints_one_process_output_when_spawning_ranks_or_under_torchrun():
    one = run_cli(sys.executable, "-m", "ddtree.cli", *GENERATE)
    spawned = run_cli(sys.executable, "-m", "ddtree.cli", *GENERATE, "--tensor-parallel-size", "2")
    torchrun = run_cli(
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "ddtree.cli", *GENERATE, "--tensor-parallel-size", "2",
    )  # fmt: skip
    for run in (one, spawned, torchrun):
        assert run.returncode == 0, run.stderr
        # No rank prints a progress bar or a notice; rank 0 may say once why budget auto stopped drafting.
        notices = [line for line in run.stderr.splitlines() if not line.startswith("budget auto: ")]
        assert notices == [], run.stderr
    assert spawned.stdout == one.stdout == torchrun.stdout
    assert len(one.stdout) > len("def fibonacci(n):") + 10


@pytest.mark.parametrize(
    ("size", "message"),
    [("0", "--tensor-parallel-size must be an integer >= 1"), ("3", "divisible by 3")],
)
def test_a_tensor_parallel_size_that_cannot_work_exits_2_in_one_line(size, message):
    run = run_cli(sys.executable, "-m", "ddtree.cli", *GENERATE, "-tp", size)
    assert run.returncode == 2
    assert run.stderr.startswith("ddtree: error: ") and message in run.stderr
    assert run.stderr.count("\n") == 1
