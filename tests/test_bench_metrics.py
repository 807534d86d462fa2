"""Benchmark metric definitions on hand-built records: every expected number is worked out by hand."""

from __future__ import annotations

import pytest

from ddtree.bench.metrics import (
    acceptance_histogram,
    histogram_fractions,
    mean_tpot,
    speedups,
    stage_breakdown,
    summarize,
    tau,
    tpot,
)


def rec(label="ar", repeat=0, acc=(1,), decode_seconds=1.0, decode_tokens=None, first_draft=0.0, stages=None,
        temperature=0.0, prompt=0, method=None, budget=0):  # fmt: skip
    """A record as the runner writes it; decode_tokens defaults to what the rounds committed."""
    tokens = 1 + sum(acc)
    return {
        "label": label,
        "method": method or label.split("@")[0].removesuffix("+compiled"),
        "budget": budget,
        "compiled": label.endswith("+compiled"),
        "temperature": temperature,
        "prompt_index": prompt,
        "prompt_id": f"p{prompt}",
        "repeat": repeat,
        "seed": 0,
        "token_ids": list(range(tokens)),
        "finish_reason": "length",
        "prompt_tokens": 10,
        "acceptance_lengths": list(acc),
        "stage_seconds": stages,
        "prefill_seconds": 0.5,
        "decode_seconds": decode_seconds,
        "first_draft_seconds": first_draft,
        "decode_tokens": sum(acc) if decode_tokens is None else decode_tokens,
        "peak_memory_bytes": 1000 * (prompt + 1),
    }


def test_tau_is_the_mean_of_per_response_means_not_the_pooled_mean():
    records = [rec(acc=(1, 3)), rec(acc=(4,)), rec(acc=())]  # response means 2 and 4; no rounds: left out
    assert tau(records) == 3.0  # pooled would be 8 / 3
    assert tau([rec(acc=())]) is None


def test_tpot_excludes_the_first_drafter_pass_and_counts_decode_tokens_only():
    assert tpot(rec(acc=(3, 5), decode_seconds=1.0, first_draft=0.2)) == pytest.approx(0.1)  # 0.8 s / 8
    assert tpot(rec(acc=(), decode_seconds=0.0)) is None  # one output token: no decode time to divide
    assert mean_tpot([rec(acc=(4,), decode_seconds=1.0), rec(acc=(4,), decode_seconds=3.0)]) == 0.5


def test_speedup_is_per_repeat_ratio_of_mean_tpots_and_its_median():
    records = []
    # per repeat: ar's decode seconds on prompts 0 and 1, then ddtree's (4 tokens each): ratios 4, 2, 3
    runs = ((0, (0.4, 1.2), (0.2, 0.2)), (1, (0.8, 0.8), (0.4, 0.4)), (2, (1.2, 1.2), (0.4, 0.4)))
    for repeat, ar, tree in runs:
        for prompt in (0, 1):
            records.append(rec("ar", repeat, (1, 1, 1, 1), ar[prompt], prompt=prompt))
            records.append(rec("ddtree@8", repeat, (2, 2), tree[prompt], prompt=prompt))
    assert speedups(records, "ddtree@8") == pytest.approx([4.0, 2.0, 3.0])
    assert speedups(records, "ar") == [1.0, 1.0, 1.0]
    row = next(r for r in summarize(records) if r["label"] == "ddtree@8")
    assert row["speedup"] == pytest.approx(3.0)  # median over repeats
    assert row["speedup_pooled"] == pytest.approx((5.6 / 6 / 4) / (2.0 / 6 / 4))  # ratio of overall means


def test_acceptance_histogram_pools_rounds_of_all_responses():
    records = [rec(acc=(1, 3)), rec(acc=(4,)), rec(acc=(1, 1))]
    histogram = acceptance_histogram(records)
    assert histogram == {1: 3, 3: 1, 4: 1} and list(histogram) == [1, 3, 4]
    assert histogram_fractions(histogram) == {1: 0.6, 3: 0.2, 4: 0.2}


def test_stage_breakdown_per_round_fractions_and_overhead():
    stages = {"draft": 0.25, "tree": 0.125, "inputs": 0.0625, "verify": 0.5, "commit": 0.0625}
    got = stage_breakdown([rec(acc=(2, 2, 2, 2), decode_seconds=1.0, stages=stages)])
    assert got["rounds"] == 4
    assert got["stage_seconds_per_round"] == {**{k: v / 4 for k, v in stages.items()}, "other": 0.0}
    assert got["stage_fractions"]["verify"] == 0.5 and got["stage_fractions"]["other"] == 0.0
    assert got["overhead_fraction"] == 0.25  # 1 - (draft + verify) = tree + inputs + commit + other
    assert got["host_seconds_per_round"] == 0.0625  # (1.0 - 0.75) / 4 rounds
    two = stage_breakdown([rec(acc=(1,), decode_seconds=2.0, stages=dict.fromkeys(stages, 0.25))] * 2)
    assert two["stage_fractions"]["other"] == pytest.approx(0.375)  # (4 - 5 * 0.5) / 4
    assert stage_breakdown([rec("hf", stages=None)]) is None  # HF has no stage timers


def test_summary_rows_per_temperature_in_label_order():
    records = [
        rec("ar", temperature=1.0, acc=(1, 1)),
        rec("dflash", temperature=1.0, acc=(3,)),
        rec("ar", temperature=0.0, acc=(1, 1), prompt=1),
        rec("hf", temperature=0.0, acc=(1, 1)),
    ]
    rows = summarize(records)
    keys = [(r["temperature"], r["label"]) for r in rows]
    assert keys == [(0.0, "ar"), (0.0, "hf"), (1.0, "ar"), (1.0, "dflash")]
    dflash = rows[-1]
    assert dflash["tau"] == 3.0 and dflash["tpot_seconds"] == pytest.approx(1 / 3)
    assert dflash["speedup"] == pytest.approx(1.5) and dflash["speedup_per_repeat"] == pytest.approx([1.5])
    assert dflash["acceptance_histogram"] == {3: 1} and dflash["output_tokens_mean"] == 4
    assert rows[0]["peak_memory_bytes"] == 2000 and rows[1]["stages"] is None


def summary_with_coinciding_lines() -> list[dict]:
    """ar and hf share tau 1.0; dflash's speedup equals ar's 1.0 (same TPOT)."""
    return summarize(
        [
            rec("ar", acc=(1, 1)),
            rec("hf", acc=(1, 1)),
            rec("dflash", acc=(2,)),
            rec("ddtree@8", method="ddtree", budget=8, acc=(3,)),
            rec("ddtree@16", method="ddtree", budget=16, acc=(4,)),
        ]
    )


def test_plot_keeps_coinciding_reference_lines_apart_and_labels_their_values(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    from ddtree.bench import plots

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to inspect it
    plots.plot_tau_speedup(summary_with_coinciding_lines(), tmp_path / "plot.png")
    tau_axes, speedup_axes = figures[0].axes
    for ax in (tau_axes, speedup_axes):
        lines = {line.get_label(): line for line in ax.get_lines()}
        flat = [line for label, line in lines.items() if not label.startswith("ddtree")]
        widths = [line.get_linewidth() for line in flat]
        assert len(set(widths)) == len(widths)  # a line on top of another stays visible around it
    assert {"ar 1.00", "hf 1.00"} <= {line.get_label() for line in tau_axes.get_lines()}
    assert {"ar 1.00", "dflash 1.00"} <= {line.get_label() for line in speedup_axes.get_lines()}


def test_results_md_says_which_budget_the_histogram_shows_and_why():
    from ddtree.bench.report import _histogram_table, best_ddtree

    rows = summary_with_coinciding_lines()
    best = best_ddtree(rows, 0.0)
    title = _histogram_table([r for r in rows if r["method"] in ("dflash", "ddtree")], best)[1]
    assert best["budget"] == 16 and "ddtree at budget 16: the budget with the highest median speedup" in title


def test_compiled_configurations_sit_next_to_their_eager_twins_with_their_compile_gain():
    from ddtree.bench.report import markdown
    from ddtree.bench.runner import BenchConfig

    cfg = BenchConfig(("ar", "ddtree", "hf"), (8,), (0.0,), 16, compile=True)
    assert [(s.label, s.compiled) for s in cfg.specs] == [
        ("ar", False), ("ar+compiled", True), ("ddtree@8", False), ("ddtree@8+compiled", True), ("hf", False)
    ]  # fmt: skip
    records = [
        rec("ar", acc=(1, 1), decode_seconds=1.0),
        rec("ar+compiled", acc=(1, 1), decode_seconds=0.5),
        rec("ddtree@8", method="ddtree", budget=8, acc=(2,), decode_seconds=0.5),
        rec("ddtree@8+compiled", method="ddtree", budget=8, acc=(2,), decode_seconds=0.25),
    ]
    rows = {r["label"]: r for r in summarize(records)}
    assert rows["ar"]["compiled"] is False and rows["ar"]["compile_speedup"] is None
    assert rows["ar+compiled"]["compiled"] and rows["ar+compiled"]["compile_speedup"] == 2.0
    assert rows["ddtree@8+compiled"]["compile_speedup"] == 2.0
    assert rows["ddtree@8+compiled"]["speedup"] == 4.0  # against eager ar, like every row
    results = {
        "config": {"target": "t", "drafter": "d", "num_prompts": 1, "prompts": "p", "max_new_tokens": 16,
                   "repeats": 1},
        "machine": {"device": "cpu", "processor": "x", "dtype": "float32", "torch": "2", "torch_threads": 1,
                    "memory_kind": "rss"},
        "t0_check": {"compared": 3, "passed": True, "mismatches": []},
        "compile": {"enabled": True, "warmup_seconds": 31.25, "shapes": 2, "batch_buckets": [1],
                    "node_buckets": [1, 17], "span_buckets": [2049]},
        "summary": list(rows.values()),
    }  # fmt: skip
    text = markdown(results)
    shapes = "2 verify shapes (batch buckets 1, node buckets 1,17, span buckets 2049)"
    assert f"warm-up (compile) **31.2 s** for {shapes}" in text
    assert "| config | compiled | x eager | tau |" in text
    assert "| ddtree@8+compiled | yes | 2.00x | 2.00 |" in text and "| ar | no |  | 1.00 |" in text


def test_concurrency_check_and_goals_keep_eager_and_compiled_apart():
    from ddtree.bench.concurrency import goals, greedy_check

    def run(label, c, tps, tokens=((1, 2),), compiled=False):
        method = label.split("@")[0]
        return {"label": label + ("+compiled" if compiled else ""), "method": method, "compiled": compiled,
                "budget": 8 if method == "ddtree" else 0, "temperature": 0.0, "concurrency": c,
                "tokens_per_second": tps, "token_ids": [list(t) for t in tokens]}  # fmt: skip

    records = [run("ar", 1, 10.0), run("ar", 1, 20.0, compiled=True), run("ddtree@8", 1, 15.0),
               run("ddtree@8", 1, 60.0, compiled=True)]  # fmt: skip
    assert greedy_check(records, 1)["passed"]
    records[-1]["token_ids"] = [[1, 3]]
    check = greedy_check(records, 1)
    assert check["mismatches"] == [{"label": "ddtree@8+compiled", "concurrency": 1, "request": 0}]
    figures = {(g["compiled"], g["what"]): g["ratio"] for g in goals(records)}
    assert figures == {
        (False, "best ddtree at c=1 (ddtree@8) / ar at c=1"): 1.5,
        (True, "compiled engine: best ddtree at c=1 (ddtree@8+compiled) / ar at c=1"): 3.0,
    }
