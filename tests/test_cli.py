"""The ``ddtree`` command on real saved checkpoints and a real tokenizer: in this process where a test is
about parsing, dispatch and output (``cli``: ``ddtree.cli.main`` with its own stdin, stdout and stderr), and
as a real process where the process itself is what is tested (``ddtree``: ``python -m``, the environment,
what transformers prints)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ddtree.engine import Engine
from ddtree.errors import DDTreeError
from ddtree.request.params import SamplingParams
from ddtree.server.config import Limits, ServerConfig
from tests.conftest import save_models, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A saved target + tokenizer directory and a saved drafter directory."""
    return save_models(tmp_path_factory.mktemp("models"))


def ddtree(
    *args: str, stdin: str | None = None, cwd=None, module: str = "ddtree.cli", threads: str = "1"
) -> subprocess.CompletedProcess:
    env = os.environ | {"OMP_NUM_THREADS": threads}  # tiny models; see conftest
    if cwd is not None:  # the checkout, not an installed copy, wherever the process runs
        env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        input=stdin,
        cwd=cwd,
    )


def cli(*args, stdin: str | None = None) -> subprocess.CompletedProcess:
    """``ddtree ARGS`` in this process: its exit status and what it printed, as ``ddtree`` returns them.
    torch's thread count and transformers' verbosity, which the command sets, are put back."""
    from transformers.utils import logging as hf_logging

    from ddtree.cli import main

    out, err, threads, verbosity = (
        io.StringIO(),
        io.StringIO(),
        torch.get_num_threads(),
        hf_logging.get_verbosity(),
    )
    code = 0
    saved_stdin = sys.stdin
    sys.stdin = io.StringIO(stdin or "")
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main([str(a) for a in args])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.stdin = saved_stdin
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)
    return subprocess.CompletedProcess(["ddtree", *map(str, args)], code, out.getvalue(), err.getvalue())


def assert_one_line_error(run: subprocess.CompletedProcess, *fragments: str) -> None:
    assert run.returncode == 2 and run.stdout == "", run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddtree: error: "), run.stderr
    assert all(f in lines[0] for f in fragments), run.stderr


def test_generate_streams_the_engines_greedy_text_and_prints_stats(model_dirs):
    target_dir, drafter_dir = model_dirs
    prompt = "def fib"
    run = cli("generate", prompt, "--target", target_dir, "--drafter", drafter_dir, "--max-new-tokens", 20,
              "--budget", 16, "--stats")  # fmt: skip
    assert run.returncode == 0, run.stderr
    engine = Engine.from_pretrained(target_dir, drafter_dir, budget=16)
    expected = engine.generate(prompt, SamplingParams(max_new_tokens=20))
    assert run.stdout == prompt + expected.text + "\n"
    stats = json.loads(run.stderr[run.stderr.index("{") :])
    assert stats["method"] == "ddtree" and stats["rounds"] >= 1 and stats["tau"] >= 1.0
    assert set(stats["stage_seconds"]) == {"draft", "tree", "inputs", "verify", "accept", "commit"}
    assert stats["stage_seconds"]["verify"] > 0 and stats["stage_seconds"]["draft"] > 0  # --stats profiles


def test_sampled_generation_with_a_seed_repeats(model_dirs):
    target_dir, drafter_dir = model_dirs
    args = (
        "generate",
        "def",
        "--target",
        target_dir,
        "--drafter",
        drafter_dir,
        "--temperature",
        "0.9",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
        "--seed",
        "7",
        "--max-new-tokens",
        "16",
        "--budget",
        "16",
    )  # fmt: skip  (a seed repeats a sample with a fixed tree; auto's follow timing)
    first, second = cli(*args), cli(*args)
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
        (["--budget", "100000"], "budget must be at most 4096"),
        (["--method", "beam"], "invalid choice"),
        (["--no-such-flag"], "unrecognized arguments"),
    ],
)
def test_bad_input_gives_one_line_and_exit_code_2(model_dirs, args, message):
    target_dir, drafter_dir = model_dirs
    base = ["generate", "def", "--target", target_dir, "--drafter", drafter_dir]
    if args[0] == "--target":
        base = ["generate", "def", "--drafter", drafter_dir]
    run = cli(*base, *args)
    assert run.returncode == 2
    assert run.stdout == ""
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddtree: error:") and message in lines[0], run.stderr


def test_drafter_for_another_target_is_refused(model_dirs, tmp_path):
    target_dir, _ = model_dirs
    other = tiny_target(vocab=50)
    other.config.num_hidden_layers = 6  # a drafter trained on another (deeper) target's features
    tiny_drafter(other).save_pretrained(tmp_path)
    run = cli("generate", "def", "--target", target_dir, "--drafter", tmp_path)
    assert run.returncode == 2
    assert "6-layer target" in run.stderr and "Traceback" not in run.stderr


def test_not_a_drafter_directory_is_refused(model_dirs):
    target_dir, _ = model_dirs
    run = cli("generate", "def", "--target", target_dir, "--drafter", target_dir)
    assert run.returncode == 2
    assert "not a DFlash checkpoint" in run.stderr


def test_target_without_drafter_needs_method_ar(model_dirs):
    target_dir, _ = model_dirs
    run = cli("generate", "def", "--target", target_dir)
    assert run.returncode == 2 and "needs --drafter" in run.stderr
    run = cli("generate", "def", "--target", target_dir, "--method", "ar", "--max-new-tokens", "5")
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("def")


def test_method_ar_still_loads_the_drafter_for_per_request_speculation(model_dirs):
    from ddtree.cli import build_parser, engine_from_args

    target_dir, drafter_dir = model_dirs
    flags = ["serve", "--target", str(target_dir), "--drafter", str(drafter_dir), "--method", "ar"]
    args = build_parser().parse_args(flags)
    engine = engine_from_args(args)
    assert engine.config.method == "ar" and engine.runner.drafter is not None
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


# -- conventions of vLLM / HF command lines ---------------------------------------------------------------


def test_version_from_the_command_and_from_python_dash_m():
    from ddtree import __version__

    for run in (ddtree("--version"), ddtree("--version", module="ddtree")):
        assert run.returncode == 0 and run.stdout.strip() == f"ddtree {__version__}", run.stderr


def test_help_opens_with_whole_sentences_and_shows_defaults():
    run = ddtree("--help", module="ddtree")
    assert run.returncode == 0
    description = run.stdout.split("\n\n")[1]
    assert "``" not in description and description.rstrip().endswith(".")
    generate = cli("generate", "--help").stdout
    assert "--budget BUDGET" in generate and "(default: 16)" in generate and "examples:" in generate
    assert "--draft-topk" in generate and "--topk" not in generate  # the old name works, unadvertised
    drafter = cli("train", "drafter", "--help").stdout
    defaults = {"--gamma": "0.0", "--anchors": "16", "--sample-fraction": "0.5", "--mask-token-id": "-1",
                "--target-layer-ids": "''", "--max-minutes": "0.0"}  # fmt: skip
    for flag, default in defaults.items():
        assert flag in drafter and f"(default: {default})" in drafter, flag


def parsers(parser: argparse.ArgumentParser, name: str = "ddtree"):
    """Every parser of the command tree, with its command line."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, child in action.choices.items():
                yield from parsers(child, f"{name} {sub}")


def test_every_argument_of_every_command_has_a_help_line_and_an_example():
    from ddtree.cli import build_parser

    for name, parser in parsers(build_parser()):
        for action in parser._actions:
            if action.help is not argparse.SUPPRESS and not isinstance(action, argparse._SubParsersAction):
                assert action.help, f"{name} {action.option_strings or action.dest} has no help"
        if not any(isinstance(a, argparse._SubParsersAction) for a in parser._actions) and name != "ddtree":
            assert parser.epilog and "ddtree " in parser.epilog, f"{name} has no example"


def test_topk_is_draft_topk_under_its_old_name():
    from ddtree.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["generate", "x", "--topk", "3"]).topk == 3
    assert parser.parse_args(["serve", "--draft-topk", "5"]).topk == 5
    assert parser.parse_args(["bench", "--draft-topk", "2"]).topk == 2


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_budget_defaults_to_auto_and_thresholds_to_lossless(command):
    from ddtree.cli import build_parser

    args = build_parser().parse_args([command] + (["x"] if command == "generate" else []))
    assert args.budget == "auto" and args.accept_threshold_single == 1.0 and args.accept_threshold_acc == 1.0


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["--device", "foo"], ["unknown device 'foo'"]),
        (["--speculative-accept-threshold-single", "1.5"], ["accept_threshold_single", "[0, 1]"]),
        (["--speculative-accept-threshold-acc", "nan"], ["accept_threshold_acc", "[0, 1]"]),
        (["--draft-topk", "0"], ["topk must be an integer >= 1"]),
        (["--device", "mps"], ["device 'mps' is not supported", "cpu, cuda"]),
        (["--device", "meta"], ["device 'meta' is not supported"]),
        (["--threads", "0"], ["--threads must be >= 1"]),
        (["--budget", "abc"], ["argument --budget: budget must be an integer >= 1 or 'auto', got 'abc'"]),
    ],
)
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_engine_flags_fail_in_one_line_before_loading(command, flags, fragments):
    run = cli(command, *(["def"] if command == "generate" else ["--port", "0"]), *flags)
    assert_one_line_error(run, *fragments)
    assert "listening" not in run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_cuda_on_a_machine_without_it_is_one_line(command, tmp_path):
    args = {"generate": ["def"], "serve": ["--port", "0"], "bench": ["--out", tmp_path]}[command]
    assert_one_line_error(cli(command, *args, "--device", "cuda"), "CUDA is not available")


def test_prompt_from_stdin_or_a_file_matches_the_argument(model_dirs, tmp_path):
    target_dir, drafter_dir = model_dirs
    flags = ["--target", target_dir, "--drafter", drafter_dir, "--max-new-tokens", "8"]
    prompt = "def fib(n):\n    "
    expected = cli("generate", prompt, *flags)
    assert expected.returncode == 0, expected.stderr
    assert ddtree("generate", "-", *flags, stdin=prompt).stdout == expected.stdout  # a real pipe, once
    (tmp_path / "prompt.txt").write_text(prompt)
    assert cli("generate", "--prompt-file", tmp_path / "prompt.txt", *flags).stdout == expected.stdout
    assert_one_line_error(cli("generate", *flags), "give a PROMPT")
    assert_one_line_error(cli("generate", "x", "--prompt-file", tmp_path / "prompt.txt", *flags), "not both")
    assert_one_line_error(cli("generate", "--prompt-file", tmp_path / "none.txt", *flags), "cannot read")


def test_a_hub_id_as_target_gets_a_download_hint(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no such directory here
    for command in (["generate", "def"], ["serve", "--port", "0"]):
        run = cli(*command, "--target", "Qwen/Qwen3-0.6B", "--method", "ar")
        assert_one_line_error(run, "Qwen/Qwen3-0.6B does not exist", "hf download Qwen/Qwen3-0.6B")


def test_an_over_long_prompt_is_our_one_line_and_nothing_from_transformers(model_dirs, tmp_path):
    target_dir, drafter_dir = model_dirs
    short = tmp_path / "target"
    shutil.copytree(target_dir, short)
    config = json.loads((short / "tokenizer_config.json").read_text())
    (short / "tokenizer_config.json").write_text(json.dumps(config | {"model_max_length": 8}))
    run = ddtree("generate", "def fib(n): return n " * 20, "--target", short, "--drafter", drafter_dir)
    assert_one_line_error(run, "exceeds the context of 64 tokens")


def test_lossy_thresholds_reach_the_engine_and_its_stats(model_dirs):
    target_dir, drafter_dir = model_dirs
    run = cli("generate", "def", "--target", target_dir, "--drafter", drafter_dir, "--max-new-tokens", "8",
              "--temperature", "1", "--seed", "0", "--speculative-accept-threshold-single", "0",
              "--speculative-accept-threshold-acc", "0.5", "--stats")  # fmt: skip
    assert run.returncode == 0, run.stderr
    stats = json.loads(run.stderr[run.stderr.index("{") :])
    assert stats["accept_threshold_single"] == 0.0 and stats["accept_threshold_acc"] == 0.5


# -- --compile and its buckets ----------------------------------------------------------------------------


def test_compile_flags_parse_for_generate_serve_and_bench():
    from ddtree.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(
        ["generate", "x", "--compile", "--batch-buckets", "1", "--node-buckets", "1, 9,17"]
    )
    assert args.compile and args.batch_buckets == (1,) and args.node_buckets == (1, 9, 17)
    serve = parser.parse_args(["serve", "--compile", "--max-batch-size", "4", "--batch-buckets", "1,4"])
    assert serve.compile and serve.batch_buckets == (1, 4) and serve.node_buckets is None
    bench = parser.parse_args(["bench", "--compile", "--node-buckets", "17"])
    assert bench.compile and bench.node_buckets == (17,)
    for command in (["generate", "x"], ["serve"], ["bench"]):
        plain = parser.parse_args(command)
        assert not plain.compile and plain.batch_buckets is None and plain.node_buckets is None
    assert "--compile" in cli("serve", "--help").stdout


@pytest.mark.parametrize(
    ("flags", "fragments"),
    [
        (["generate", "def", "--node-buckets", "17"], ["--node-buckets needs --compile"]),
        (["generate", "def", "--compile", "--node-buckets", "1,x"], ["must be a comma-separated list"]),
        (["generate", "def", "--compile", "--node-buckets", "0,17"], ["--node-buckets must be", ">= 1"]),
        (["generate", "def", "--compile", "--batch-buckets", "1,2"], ["--batch-buckets may not exceed 1"]),
        (["serve", "--port", "0", "--compile", "--max-batch-size", "8", "--batch-buckets", "1,4"],
         ["largest of --batch-buckets must be the maximum batch size (8)"]),
        (["serve", "--port", "0", "--batch-buckets", "16"], ["--batch-buckets needs --compile"]),
        (["generate", "def", "--span-buckets", "256"], ["--span-buckets needs --compile"]),
        (["generate", "def", "--compile", "--span-buckets", "-1"], ["--span-buckets must be", ">= 1"]),
        (["bench", "--batch-buckets", "1", "--num-prompts", "1"], ["--batch-buckets needs --compile"]),
        (["generate", "def", "--attention-backend", "flex"], ["--attention-backend flex needs --compile"]),
        (["serve", "--port", "0", "--compile", "--attention-backend", "flex", "--span-buckets", "64"],
         ["--span-buckets is for --attention-backend sdpa"]),
        (["bench", "--compile", "--concurrency", "1,4", "--batch-buckets", "1,2", "--num-prompts", "1"],
         ["largest of --batch-buckets must be the maximum batch size (4)"]),
    ],
)  # fmt: skip
def test_bad_bucket_lists_fail_in_one_line_before_loading(flags, fragments, capsys):
    from ddtree.cli import main

    with pytest.raises(SystemExit) as exc:
        main(flags)
    captured = capsys.readouterr()
    assert exc.value.code == 2 and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ddtree: error: "), captured.err
    assert all(f in lines[0] for f in fragments), captured.err


def test_generate_builds_a_one_row_engine_that_profiles_only_for_stats(model_dirs):
    from ddtree.cli import build_parser, engine_from_args

    target_dir, drafter_dir = model_dirs
    flags = ["generate", "x", "--target", str(target_dir), "--drafter", str(drafter_dir)]
    quiet, stats = (engine_from_args(build_parser().parse_args(flags + extra)) for extra in ([], ["--stats"]))
    assert not quiet.profile and stats.profile and not stats.runner.shapes.compiled
    assert (
        quiet.config.max_num_seqs == stats.config.max_num_seqs == 1
    )  # one request: one cache row, one batch shape


def test_prefix_caching_is_on_unless_the_flag_turns_it_off(model_dirs):
    from ddtree.cli import build_parser, engine_from_args

    target_dir, drafter_dir = model_dirs
    flags = ["serve", "--target", str(target_dir), "--drafter", str(drafter_dir)]
    on, off = (
        engine_from_args(build_parser().parse_args(flags + extra))
        for extra in ([], ["--no-enable-prefix-caching"])
    )
    assert on.blocks.prefix_caching and not off.blocks.prefix_caching
    assert on.kv_cache_summary()["prefix_caching"] and not off.kv_cache_summary()["prefix_caching"]


@pytest.mark.parametrize(("flags", "expected"), [(["--threads", "1"], 1), ([], 2)])
def test_threads_reach_torch_in_generate_and_omp_num_threads_is_kept_without_it(model_dirs, flags, expected):
    target_dir, drafter_dir = model_dirs
    run = ddtree("generate", "def", "--target", target_dir, "--drafter", drafter_dir, "--max-new-tokens", 4,
                 "--stats", *flags, threads="2")  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stderr[run.stderr.index("{") :])["torch_threads"] == expected


def test_default_threads_leave_the_busy_cores_to_their_work():
    from ddtree.argparsing import default_threads

    assert default_threads(torch_default=2, cores=2, load=0.1) == 2  # idle: torch's default
    assert default_threads(torch_default=2, cores=2, load=1.0) == 1  # one core busy elsewhere
    assert default_threads(torch_default=8, cores=16, load=4.2) == 8  # never more than torch's default
    assert default_threads(torch_default=32, cores=32, load=30.0) == 2
    assert default_threads(torch_default=4, cores=4, load=9.0) == 1  # oversubscribed: at least one


def test_serve_flags_are_server_config_fields_read_back_with_their_defaults_and_checks():
    """ServerConfig is built like EngineConfig: serve's own flags are its (and its Limits') fields, the
    defaults are the fields', and the checks name the flags."""
    from ddtree.cli import build_parser
    from ddtree.config import field_flags

    args = build_parser().parse_args(["serve"])
    flags = field_flags(ServerConfig) | field_flags(Limits)
    assert all(name in args for name in flags)
    config = ServerConfig.from_args(args)
    assert config == ServerConfig() and config.limits == Limits()
    args = build_parser().parse_args(["serve", "--max-speculative-budget", "8", "--api-key", "a", "b"])
    config = ServerConfig.from_args(args, model_name="m")
    assert config.limits.max_speculative_budget == 8 and config.api_keys == ("a", "b")
    assert config.model_name == "m"
    with pytest.raises(DDTreeError, match=r"^--port must be in \[0, 65535\], got 70000$"):
        ServerConfig.from_args(build_parser().parse_args(["serve", "--port", "70000"]))
    with pytest.raises(DDTreeError, match="^max_queue must be >= 0, got -1$"):
        ServerConfig(max_queue=-1)
