"""The ``ddtree`` command, run as a real process on real saved checkpoints and a real tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ddtree.engine import Engine
from ddtree.params import SamplingParams
from tests.conftest import save_models, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A saved target + tokenizer directory and a saved drafter directory."""
    return save_models(tmp_path_factory.mktemp("models"))


def ddtree(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": "1"}  # tiny models; see conftest
    return subprocess.run(
        [sys.executable, "-m", "ddtree.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_generate_streams_the_engines_greedy_text_and_prints_stats(model_dirs):
    target_dir, drafter_dir = model_dirs
    prompt = "def fib"
    run = ddtree("generate", prompt, "--target", target_dir, "--drafter", drafter_dir, "--max-new-tokens", 20,
                 "--budget", 16, "--stats")  # fmt: skip
    assert run.returncode == 0, run.stderr
    engine = Engine.from_pretrained(target_dir, drafter_dir, budget=16)
    expected = engine.generate(prompt, SamplingParams(max_new_tokens=20))
    assert run.stdout == prompt + expected.text + "\n"
    stats = json.loads(run.stderr[run.stderr.index("{") :])
    assert stats["method"] == "ddtree" and stats["rounds"] >= 1 and stats["tau"] >= 1.0
    assert set(stats["stage_seconds"]) == {"draft", "tree", "compile", "verify", "accept", "commit"}


def test_sampled_generation_with_a_seed_repeats(model_dirs):
    target_dir, drafter_dir = model_dirs
    args = ("generate", "def", "--target", target_dir, "--drafter", drafter_dir, "--temperature", "0.9",
            "--top-p", "0.9", "--top-k", "20", "--seed", "7", "--max-new-tokens", "16")  # fmt: skip
    first, second = ddtree(*args), ddtree(*args)
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "/nonexistent/model"], "does not exist"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "1.5"], "top_p"),
        (["--top-k", "-2"], "top_k"),
        (["--budget", "0"], "budget"),
        (["--max-new-tokens", "500"], "context"),
        (["--method", "beam"], "invalid choice"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_input_gives_one_line_and_exit_code_2(model_dirs, args, message):
    target_dir, drafter_dir = model_dirs
    base = ["generate", "def", "--target", target_dir, "--drafter", drafter_dir]
    if args[0] == "--target":
        base = ["generate", "def", "--drafter", drafter_dir]
    run = ddtree(*base, *args)
    assert run.returncode == 2
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddtree: error:") and message in lines[0], run.stderr


def test_drafter_for_another_target_is_refused(model_dirs, tmp_path):
    target_dir, _ = model_dirs
    other = tiny_target(vocab=50)
    tiny_drafter(other).save_pretrained(tmp_path)
    run = ddtree("generate", "def", "--target", target_dir, "--drafter", tmp_path)
    assert run.returncode == 2
    assert "vocabulary" in run.stderr and "Traceback" not in run.stderr


def test_not_a_drafter_directory_is_refused(model_dirs):
    target_dir, _ = model_dirs
    run = ddtree("generate", "def", "--target", target_dir, "--drafter", target_dir)
    assert run.returncode == 2
    assert "not a DFlash checkpoint" in run.stderr


def test_target_without_drafter_needs_method_ar(model_dirs):
    target_dir, _ = model_dirs
    run = ddtree("generate", "def", "--target", target_dir)
    assert run.returncode == 2 and "needs --drafter" in run.stderr
    run = ddtree("generate", "def", "--target", target_dir, "--method", "ar", "--max-new-tokens", "5")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("def")


def test_method_ar_still_loads_the_drafter_for_per_request_speculation(model_dirs):
    from ddtree.cli import build_parser, engine_from_args

    target_dir, drafter_dir = model_dirs
    flags = ["serve", "--target", str(target_dir), "--drafter", str(drafter_dir), "--method", "ar"]
    args = build_parser().parse_args(flags)
    engine = engine_from_args(args)
    assert engine.method == "ar" and engine.drafter is not None
    prompt = [5, 6, 7, 8]
    plain = engine.generate(prompt, SamplingParams(max_new_tokens=12))
    tree = engine.generate(prompt, SamplingParams(max_new_tokens=12), method="ddtree", budget=8)
    assert plain.stats.method == "ar" and tree.stats.method == "ddtree"
    assert tree.token_ids == plain.token_ids


def test_engine_rejects_bad_values_with_ddtree_error():
    from ddtree.errors import DDTreeError

    target = tiny_target()
    with pytest.raises(DDTreeError, match="method"):
        Engine(target, tiny_drafter(target), method="medusa")
    with pytest.raises(DDTreeError, match="needs a drafter"):
        Engine(target, None, method="ddtree")
    engine = Engine(target, None, method="ar")
    with pytest.raises(DDTreeError, match="empty"):
        engine.generate([], SamplingParams())
    with pytest.raises(DDTreeError, match="token ids"):
        engine.generate([10_000], SamplingParams())
    with pytest.raises(DDTreeError, match="tokenizer"):
        engine.generate("text", SamplingParams())
    for bad in ({"temperature": float("nan")}, {"top_p": 0.0}, {"min_p": 2.0}, {"max_new_tokens": 0}):
        with pytest.raises(DDTreeError):
            SamplingParams(**bad)
    assert torch.is_grad_enabled()
