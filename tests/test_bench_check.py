"""The T = 0 check: a fabricated greedy mismatch is found, located and announced loudly."""

from __future__ import annotations

import io

from ddtree.bench.check import announce, check_greedy_equality
from ddtree.bench.report import markdown


def rec(label, tokens, prompt=0, repeat=0, temperature=0.0):
    return {"label": label, "token_ids": tokens, "prompt_index": prompt, "prompt_id": f"p{prompt}",
            "repeat": repeat, "temperature": temperature}  # fmt: skip


def test_equal_greedy_outputs_pass_and_stay_silent():
    records = [rec(label, [1, 2, 3]) for label in ("ar", "ddtree@8", "hf", "dflash")]
    records += [rec("ar", [4], prompt=1), rec("dflash", [4], prompt=1)]
    records += [rec("ar", [7], temperature=1.0), rec("dflash", [5], temperature=1.0)]  # sampled: not compared
    check = check_greedy_equality(records)
    assert check == {"reference": "ar", "compared": 4, "passed": True, "mismatches": []}
    stream = io.StringIO()
    announce(check, stream)
    assert stream.getvalue() == ""


def test_a_mismatch_is_located_and_announced_loudly():
    records = [
        rec("ar", [1, 2, 3, 4]),
        rec("ddtree@16", [1, 2, 9, 4]),  # differs at token 2
        rec("ar", [1, 2, 3], repeat=1),
        rec("hf-pld", [1, 2], repeat=1),  # a prefix: differs in length at token 2
        rec("dflash", [1, 2, 3, 4]),
    ]
    check = check_greedy_equality(records)
    assert not check["passed"] and check["compared"] == 3
    assert [(m["label"], m["repeat"], m["first_difference"]) for m in check["mismatches"]] == [
        ("ddtree@16", 0, 2),
        ("hf-pld", 1, 2),
    ]
    stream = io.StringIO()
    announce(check, stream)
    text = stream.getvalue()
    assert "T=0 OUTPUT MISMATCH: 2 of 3" in text and "ddtree@16, hf-pld" in text
    assert "first difference at token 2" in text and text.startswith("!" * 78)


def test_the_markdown_says_failed():
    check = check_greedy_equality([rec("ar", [1]), rec("ddtree@4", [2])])
    results = {
        "config": {
            "target": "t",
            "drafter": "d",
            "num_prompts": 1,
            "prompts": "builtin",
            "max_new_tokens": 1,
            "repeats": 1,
        },  # fmt: skip
        "machine": {
            "processor": "x",
            "device": "cpu",
            "dtype": "float32",
            "torch": "2",
            "torch_threads": 1,
            "memory_kind": "process_peak_rss",
        },  # fmt: skip
        "summary": [],
        "t0_check": check,
    }
    assert "**T=0 check: FAILED**: 1 of 1 greedy responses differ from `ar`'s (ddtree@4)" in markdown(results)
