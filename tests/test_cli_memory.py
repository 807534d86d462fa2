"""The memory flags (vLLM's names) on the command line: they reach the engine, and a value that cannot work
is one line and exit code 2."""

from __future__ import annotations

import pytest

from ddtree.cli import main
from tests.conftest import save_models

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    target, drafter = save_models(tmp_path_factory.mktemp("cli-memory"))
    return ["--target", str(target), "--drafter", str(drafter), "--threads", "1"]


def fails(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("ddtree: error: ")
    return err


def test_chunked_prefill_small_blocks_and_a_small_pool_give_the_default_output(flags, capsys):
    main(["generate", PROMPT * 3, *flags, "--max-new-tokens", "12"])
    default = capsys.readouterr().out
    small = ["--max-num-batched-tokens", "5", "--block-size", "4", "--kv-cache-memory", "64KiB"]
    main(["generate", PROMPT * 3, *flags, "--max-new-tokens", "12", "--dtype", "float32", *small])
    assert capsys.readouterr().out == default


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-cache-memory", "lots"], "cannot read a memory size"),
        (["--kv-cache-memory", "1KiB", "--max-model-len", "48"], "raise --kv-cache-memory"),
        (["--max-model-len", "8"], "exceeds the context of 8 tokens"),
        (["--max-model-len", "100000"], "exceeds the target's context"),
        (["--dtype", "float64"], "invalid choice: 'float64'"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
        (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be an integer >= 1"),
        (["--block-size", "0"], "--block-size must be an integer >= 1"),
    ],
)
def test_memory_flags_that_cannot_work_exit_2_in_one_line(flags, capsys, extra, message):
    assert message in fails(["generate", PROMPT, *flags, *extra], capsys)


def test_serve_takes_max_num_seqs_and_its_older_name(flags, capsys):
    for flag in ("--max-num-seqs", "--max-batch-size"):
        assert "--max-num-seqs must be an integer >= 1" in fails(["serve", *flags, flag, "0"], capsys)
