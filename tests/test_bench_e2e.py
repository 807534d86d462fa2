"""``ddtree bench`` end to end on tiny random models saved to disk: outputs, T = 0 check, errors, prompts."""

from __future__ import annotations

import argparse
import json

import pytest

import ddtree.bench.runner as runner
from ddtree.bench.cli import main, register_bench
from ddtree.bench.prompts import BUILTIN_PROMPTS, load_prompts
from ddtree.errors import DDTreeError
from tests.conftest import tiny_drafter, tiny_target, tiny_tokenizer


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Saved target (+ tokenizer) and drafter directories, and a prompts file in all three formats."""
    root = tmp_path_factory.mktemp("bench")
    tokenizer = tiny_tokenizer()
    target = tiny_target(vocab=len(tokenizer))
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    drafter = tiny_drafter(target)
    drafter.mask_token_id = tokenizer.convert_tokens_to_ids("<|mask|>")
    drafter.save_pretrained(root / "drafter")
    prompts = root / "prompts.jsonl"
    lines = [{"id": "fib", "prompt": "def fibonacci(n):\n    if n < 2:\n"}, "    return fib", [5, 6, 7, 8]]
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def bench_args(root, out, *extra: str) -> list[str]:
    return ["--target", str(root / "target"), "--drafter", str(root / "drafter"), "--prompts",
            str(root / "prompts.jsonl"), "--out", str(out), "--no-progress", *extra]  # fmt: skip


def test_tiny_bench_writes_every_output_and_passes_the_t0_check(setup, tmp_path, capsys):
    out = tmp_path / "out"
    flags = "--methods ar,dflash,ddtree,hf,hf-pld --budgets 4,16 --temperatures 0,1 --num-prompts 2"
    main(
        bench_args(
            setup, out, *flags.split(), "--max-new-tokens", "12", "--repeats", "2", "--tree-vocab", "8192"
        )
    )
    for name in ("results.json", "results.md", "tau_speedup.png", "acceptance_histogram.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "tau_speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "results.json").read_text())
    assert results["t0_check"]["passed"] and not results["t0_mismatch"]
    assert results["t0_check"]["compared"] == 2 * 2 * 5  # prompts x repeats x (configs - ar)
    labels = ["ar", "dflash", "ddtree@4", "ddtree@16", "hf", "hf-pld"]
    assert [r["label"] for r in results["summary"]] == labels * 2
    assert len(results["records"]) == 2 * 2 * 2 * len(labels)  # prompts x repeats x temperatures x configs
    for row in results["summary"]:
        assert row["tau"] >= 1.0 and row["tpot_seconds"] > 0 and len(row["speedup_per_repeat"]) == 2
        assert (row["stages"] is None) == row["label"].startswith("hf")
    ar = [r for r in results["summary"] if r["label"] == "ar"]
    assert all(r["speedup"] == 1.0 and r["tau"] == 1.0 for r in ar)

    # interleaved: one prompt's configs back to back, rotated per repeat; one seed per (prompt, repeat)
    first = [r["label"] for r in results["records"][: len(labels)]]
    second_repeat = [r for r in results["records"] if r["repeat"] == 1][: len(labels)]
    assert first == labels and [r["label"] for r in second_repeat] == labels[1:] + labels[:1]
    for key in {(r["prompt_index"], r["repeat"]) for r in results["records"]}:
        assert len({r["seed"] for r in results["records"] if (r["prompt_index"], r["repeat"]) == key}) == 1

    tree = results["tree_build"]  # the tree stage alone at budgets 32 and 256, 1 and 16 rows, flat to peaked
    assert [(r["scale"], r["rows"], r["budget"]) for r in tree] == [
        (s, n, b) for s in (1.0, 3.0, 6.0) for n in (1, 16) for b in (32, 256)
    ]
    assert all(r["vocab"] == 8192 and r["positions"] == 15 and r["median_ms"] > 0 for r in tree)
    assert tree[0]["top1_probability"] < 0.01 < tree[-1]["top1_probability"]

    text = (out / "results.md").read_text()
    assert "## Tree build alone: 15 positions x 8192 tokens" in text
    assert "**T=0 check: passed**" in text and "## Temperature 1" in text and "## Definitions" in text
    assert capsys.readouterr().out == text + f"\nwrote results.json, results.md, tau_speedup.png, " \
        f"acceptance_histogram.png to {out}\n"  # fmt: skip


def test_compile_runs_every_engine_config_eager_and_compiled_and_checks_both_against_ar(setup, tmp_path):
    """The one compiling test (two graphs: one batch bucket, one node bucket; about 30 s on 2 cores)."""
    out = tmp_path / "out"
    flags = "--methods ar,ddtree,hf --budgets 8 --temperatures 0 --num-prompts 2 --max-new-tokens 8"
    main(bench_args(setup, out, *flags.split(), "--repeats", "1", "--tree-vocab", "0", "--compile",
                    "--batch-buckets", "1", "--node-buckets", "17"))  # fmt: skip
    results = json.loads((out / "results.json").read_text())
    labels = ["ar", "ar+compiled", "ddtree@8", "ddtree@8+compiled", "hf"]
    assert [(r["label"], r["compiled"]) for r in results["summary"]] == [(x, "+" in x) for x in labels]
    assert results["t0_check"]["passed"] and results["t0_check"]["compared"] == 2 * 4  # compiled ones too
    compiled = results["compile"]
    assert compiled["enabled"] and compiled["warmup_seconds"] > 0 and compiled["shapes"] == 1
    assert (
        compiled["batch_buckets"] == [1] and compiled["node_buckets"] == [17] and results["config"]["compile"]
    )
    for row in results["summary"]:
        assert row["tpot_seconds"] > 0 and (row["compile_speedup"] is not None) == row["compiled"]
    text = (out / "results.md").read_text()
    assert "| ddtree@8+compiled | yes |" in text and "warm-up (compile) **" in text


def test_a_t0_mismatch_fails_the_run_loudly(setup, tmp_path, capsys, monkeypatch):
    real = runner.run_bench

    def corrupted(*args, **kwargs):
        records = real(*args, **kwargs)
        bad = next(r for r in records if r["label"] == "ddtree@8")
        bad["token_ids"] = bad["token_ids"][:-1] + [bad["token_ids"][-1] + 1]
        return records

    monkeypatch.setattr(runner, "run_bench", corrupted)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        flags = "--methods ar,ddtree --budgets 8 --temperatures 0 --num-prompts 1 --max-new-tokens 6"
        main(bench_args(setup, out, *flags.split(), "--repeats", "1", "--warmup", "0", "--tree-vocab", "0"))
    assert exc.value.code == 3
    assert "T=0 OUTPUT MISMATCH: 1 of 1" in capsys.readouterr().err
    results = json.loads((out / "results.json").read_text())
    assert results["t0_mismatch"] and results["t0_check"]["mismatches"][0]["label"] == "ddtree@8"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--methods", "ar,beam"], "unknown method(s) beam"),
        (["--methods", "dflash,ddtree"], "must include 'ar'"),
        (["--budgets", "4,x"], "--budgets must be a comma-separated list"),
        (["--budgets", "0"], "budget must be an integer >= 1 or 'auto', got 0"),
        (["--temperatures", "-1"], "--temperatures must be numbers >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--tree-vocab", "-1"], "--tree-vocab must be >= 0"),
        (["--max-new-tokens", "500"], "exceeds the target's context"),
        (["--prompts", "/nonexistent.jsonl"], "does not exist"),
    ],
)
def test_user_mistakes_give_one_line_and_exit_code_2(setup, tmp_path, capsys, extra, message):
    with pytest.raises(SystemExit) as exc:
        main(bench_args(setup, tmp_path / "out", *extra))
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ddtree: error: ") and message in err and err.count("\n") == 1


def test_register_bench_adds_the_subcommand():
    parser = argparse.ArgumentParser()
    register_bench(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--methods", "ar,ddtree", "--budgets", "8,32", "--temperatures", "0"])
    assert args.methods == ("ar", "ddtree") and args.budgets == (8, 32) and args.temperatures == (0.0,)
    assert args.prompts == "builtin" and args.repeats == 3 and callable(args.func)
    defaults = parser.parse_args(["bench"])
    assert defaults.methods == ("ar", "dflash", "ddtree", "hf", "hf-pld")
    assert defaults.budgets == ("auto", 4, 8, 16, 32, 64, 128) and defaults.temperatures == (0.0, 1.0)


def test_top_p_shapes_the_sampled_runs_only(setup, tmp_path):
    cfg = runner.BenchConfig(("ar",), (), temperatures=(0.0, 0.7), max_new_tokens=8, top_p=0.95)
    sampled, greedy = cfg.sampling(0.7, seed=3), cfg.sampling(0.0, seed=3)
    assert (sampled.temperature, sampled.top_p, sampled.seed, sampled.max_new_tokens) == (0.7, 0.95, 3, 8)
    assert greedy.greedy and greedy.top_p == 1.0
    out = tmp_path / "out"
    flags = "--methods ar,ddtree --budgets 4 --temperatures 0.7 --top-p 0.9 --num-prompts 1 --repeats 1"
    main(bench_args(setup, out, *flags.split(), "--max-new-tokens", "6", "--tree-vocab", "0"))
    assert json.loads((out / "results.json").read_text())["config"]["top_p"] == 0.9
    assert "## Temperature 0.7, top-p 0.9" in (out / "results.md").read_text()


def test_prompt_files(setup, tmp_path):
    prompts = load_prompts(setup / "prompts.jsonl")
    assert [p.id for p in prompts] == ["fib", "prompts.jsonl:2", "prompts.jsonl:3"]
    assert prompts[1].text == "    return fib" and prompts[2].token_ids == (5, 6, 7, 8)
    builtin = load_prompts("builtin")
    assert BUILTIN_PROMPTS.is_file() and len(builtin) >= 64 and len(load_prompts("builtin", 16)) == 16
    assert len({p.id for p in builtin}) == len(builtin) and all(300 <= len(p.text) <= 1200 for p in builtin)
    assert len({p.id.split(":")[0] for p in builtin[:16]}) == 16  # the first 16 come from 16 files
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": ""}\n')
    with pytest.raises(DDTreeError, match="bad.jsonl:1"):
        load_prompts(bad)


def test_concurrency_sweep_keeps_c_requests_in_flight_and_changes_no_greedy_output(setup, tmp_path):
    out = tmp_path / "conc"
    flags = "--methods ar,dflash,ddtree,hf --budgets 4 --temperatures 0,1 --num-prompts 3 --concurrency 1,4"
    main(bench_args(setup, out, *flags.split(), "--max-new-tokens", "10"))
    for name in ("results.json", "results.md", "throughput_concurrency.png"):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    assert results["t0_check"]["passed"] and results["t0_check"]["checked"] == (3 + 8) * 3  # hf is batch-1
    records = results["records"]
    assert [(r["label"], r["temperature"], r["concurrency"]) for r in records[:3]] == [
        ("ar", 0.0, 1), ("dflash", 0.0, 1), ("ddtree@4", 0.0, 1)
    ]  # fmt: skip
    for r in records:
        assert r["requests"] == max(2 * r["concurrency"], 3) and r["tokens_per_second"] > 0
        assert r["mean_rows_per_step"] <= r["concurrency"]
    assert (
        max(r["mean_rows_per_step"] for r in records if r["concurrency"] == 4) > 2
    )  # rows really shared steps
    assert "## Goals" in (out / "results.md").read_text()
