"""A call that raises on one rank in the middle of a step, under TP 2 with gloo (``step_channel.FAIL_ENV``
injects it when the rank reaches the round's verify forward, after rank 0 sent it): every rank leaves the
step, the error names the rank, later calls fail the same way instead of pairing collectives wrongly, and
closing ends every rank; the server answers the request a 500 naming the rank and stops being ready.
Nothing may hang: each wait is bounded."""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as Hung

import pytest
import torch

from ddtree.engine import Engine
from ddtree.engine.step_channel import FAIL_ENV, TensorParallelError
from ddtree.request.params import SamplingParams
from tests.test_server_api import error_of, start, wait_until_ready
from tests.test_tensor_parallel_lossless import save_tp_pair

BOUND = 30.0  # seconds a failed step may take to end on every rank (a hang is far longer)


def bounded(engine: Engine, call, timeout: float = BOUND):
    """``call()``'s result or exception within ``timeout`` s; past it the ranks are killed (so the thread
    blocked in a collective returns) and the test fails."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(call)
        try:
            return future.exception(timeout) or future.result()
        except Hung:
            for process in engine.runner.channel.ranks.processes:
                process.kill()
            pytest.fail(f"hung for {timeout} s")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_step_that_raises_on_one_rank_ends_the_engine_on_every_rank_naming_it(tmp_path, monkeypatch, rank):
    save_tp_pair(tmp_path)
    monkeypatch.setenv(FAIL_ENV, f"{rank}:verify")  # before the spawn: rank 1 inherits it
    engine = Engine.from_pretrained(
        tmp_path / "target", tmp_path / "drafter", tensor_parallel_size=2, dtype=torch.float32
    )
    reasons: list[str] = []
    engine.watch_ranks(reasons.append)  # what the server is told (it answers 503 and exits non-zero)
    expected = f"tensor-parallel rank {rank} failed in verify: injected failure in verify"
    start = time.monotonic()
    error = bounded(engine, lambda: engine.generate([1, 2, 3], SamplingParams(max_new_tokens=8)))
    assert isinstance(error, TensorParallelError) and str(error) == expected
    assert time.monotonic() - start < BOUND
    processes = engine.runner.channel.ranks.processes
    deadline = time.monotonic() + 10
    while any(p.is_alive() for p in processes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(p.is_alive() for p in processes)  # rank 1 exited (its own fault) or was ended
    assert reasons == [expected]
    again = bounded(engine, lambda: engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2)))
    assert isinstance(again, TensorParallelError) and str(again) == expected  # never a step on half a model
    bounded(engine, engine.close)


def test_a_failed_step_answers_500_naming_the_rank_and_logs_no_traceback(tmp_path, monkeypatch, caplog):
    save_tp_pair(tmp_path)
    engines: list[Engine] = []

    def load() -> Engine:
        engines.append(
            Engine.from_pretrained(tmp_path / "target", tmp_path / "drafter", tensor_parallel_size=2)
        )
        return engines[-1]

    client = start(load)
    try:
        wait_until_ready(client, timeout=BOUND)
        monkeypatch.setenv(FAIL_ENV, "0:verify")  # rank 0 reads it at each call: the warm-up went through
        body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 8, "speculative": {"method": "ddtree"}}
        with caplog.at_level(logging.INFO, logger="ddtree"):
            response = bounded(engines[0], lambda: client.post("/v1/completions", json=body))
        expected = "tensor-parallel rank 0 failed in verify: injected failure in verify"
        error = error_of(response, 500)
        assert (
            error["message"] == expected
            and error["type"] == "server_error"
            and error["code"] == "engine_failed"
        )
        ready = client.get("/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "engine_failed"
        assert expected in ready.json()["error"]["message"]
        assert not any(r.exc_info for r in caplog.records)  # one line each, no traceback
        assert any(expected in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)
    finally:
        bounded(engines[0], lambda: client.__exit__(None, None, None))
