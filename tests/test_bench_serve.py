"""``ddtree bench serve`` as a real command against real ``ddtree serve`` processes (tiny models)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import save_models
from tests.server_helpers import server_env, serving

PROMPTS = ["def fib(n):", "import os\n", "class A:\n    def", "x = [1, 2,"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    return save_models(tmp_path_factory.mktemp("bench-serve-models"))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-serve-prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    target, drafter = model_dirs
    args = ["--target", target, "--drafter", drafter, "--budget", 16, "--max-batch-size", 4]
    with serving(args, tmp_path_factory.mktemp("bench-serve-log") / "server.log") as proc:
        yield proc


def bench_serve(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddtree.cli", "bench", "serve", "--no-progress", *map(str, args)],
        capture_output=True, text=True, timeout=timeout, env=server_env(),
    )  # fmt: skip


def test_a_concurrency_sweep_reports_every_request_and_writes_json_markdown_and_a_plot(
    server, prompts_file, tmp_path
):
    run = bench_serve("--base-url", server.url, "--concurrency", "1,4", "--num-requests", 8,
                      "--max-tokens", 6, "--ignore-eos", "--prompts", prompts_file, "--out", tmp_path,
                      "--label", "tiny")  # fmt: skip
    assert run.returncode == 0, run.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert [level["concurrency"] for level in results["levels"]] == [1, 4]
    for level in results["levels"]:
        assert level["completed"] == 8 and level["failed"] == {}
        assert level["output_tokens"] == 8 * 6  # ignore_eos: every request ran to max_tokens
        assert level["output_tokens_per_s"] > 0 and level["request_throughput"] > 0
        for name in ("ttft_ms", "tpot_ms", "itl_ms"):
            stats = level[name]
            assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"], (name, stats)
        assert len(level["records"]) == 8 and all(r["status"] == "200" for r in level["records"])
    assert results["config"]["label"] == "tiny" and results["config"]["model"] == "target"
    markdown = (tmp_path / "results.md").read_text()
    assert "| 1 | 8 | 0 |" in markdown and "| 4 | 8 | 0 |" in markdown
    assert markdown in run.stdout
    assert (tmp_path / "serve.png").read_bytes().startswith(b"\x89PNG")


def test_a_poisson_rate_run_counts_failures_by_status(server, prompts_file, tmp_path):
    long_prompt = tmp_path / "long.jsonl"
    long_prompt.write_text(json.dumps({"prompt": "def fib(n):"}) + "\n" + json.dumps(list(range(60))) + "\n")
    run = bench_serve("--base-url", server.url, "--request-rate", 50, "--num-requests", 6, "--max-tokens", 8,
                      "--prompts", long_prompt, "--out", tmp_path, "--warmup", 0)  # fmt: skip
    assert run.returncode == 0, run.stderr
    (level,) = json.loads((tmp_path / "results.json").read_text())["levels"]
    assert level["request_rate"] == 50 and level["concurrency"] is None
    # Every second prompt has 60 tokens: with 8 more it cannot fit the 64-token context (a 400).
    assert level["completed"] == 3 and level["failed"] == {"400": 3}
    assert "context" in level["first_errors"]["400"]
    assert "400: 3" in (tmp_path / "results.md").read_text()


def test_a_shared_prefix_is_served_from_the_prefix_cache_and_its_hit_rate_reported(server, tmp_path):
    """Token-id prompts after a 32-id shared prefix (two blocks): after the warm-up request every request
    finds both blocks cached, and the report says so."""
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps([7 + i, 8, 9 + i]) + "\n" for i in range(4)))
    run = bench_serve("--base-url", server.url, "--concurrency", 1, "--num-requests", 4, "--max-tokens", 4,
                      "--prompts", ids, "--shared-prefix-tokens", 32, "--out", tmp_path)  # fmt: skip
    assert run.returncode == 0, run.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    (level,) = results["levels"]
    assert [r["prompt_tokens"] for r in level["records"]] == [35] * 4
    assert [r["cached_tokens"] for r in level["records"]] == [32] * 4
    assert level["prefix_cache_hit_rate"] == pytest.approx(32 / 35)
    assert results["config"]["shared_prefix_tokens"] == 32
    assert "| 91% |" in (tmp_path / "results.md").read_text()


def test_start_server_runs_its_own_server_and_stops_it(model_dirs, prompts_file, tmp_path):
    target, drafter = model_dirs
    run = bench_serve("--concurrency", 2, "--num-requests", 2, "--max-tokens", 4, "--prompts", prompts_file,
                      "--out", tmp_path, "--start-server", "--target", target, "--drafter", drafter,
                      "--budget", 16)  # fmt: skip
    assert run.returncode == 0, run.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["server_exit_code"] == 0
    assert results["config"]["server_args"][:2] == ["--target", str(target)]
    assert results["levels"][0]["completed"] == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--concurrency", "0"], "--concurrency must list values > 0"),
        (["--concurrency", "two"], "comma-separated list"),
        (["--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["--shared-prefix-tokens", "-1"], "--shared-prefix-tokens must be >= 0"),
        (["--base-url", "localhost:1"], "--base-url must start with http://"),
        (["--base-url", "http://127.0.0.1:1"], "cannot reach the server"),
        (["--prompts", "/nonexistent.jsonl"], "does not exist"),
    ],
)
def test_mistakes_exit_2_with_one_line(args, message, tmp_path):
    run = bench_serve(*args, "--out", tmp_path, timeout=120)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
