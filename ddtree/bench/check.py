"""The T = 0 losslessness check: at temperature 0 every method must emit exactly ``ar``'s tokens.

A speedup measured on different outputs is meaningless, and a greedy mismatch is either a bug in the
method or numerical non-determinism (e.g. a batched tree forward that flips a near-tie argmax); either
way the person reading the table must know. So a mismatch is printed in a banner on stderr, recorded in
``results.json`` (``t0_check.passed = false``) and turns the exit code non-zero.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import TextIO

from ddtree.bench.metrics import REFERENCE

MISMATCH_EXIT_CODE = 3


def check_greedy_equality(records: list[dict], reference: str = REFERENCE) -> dict:
    """Compare every T = 0 record with the reference's record of the same prompt and repeat."""
    groups: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for r in records:
        if r["temperature"] == 0:
            groups[(r["prompt_index"], r["repeat"])].append(r)
    mismatches, compared = [], 0
    for (prompt, repeat), group in sorted(groups.items()):
        refs = [r for r in group if r["label"] == reference]
        if not refs:
            continue
        expected = refs[0]["token_ids"]
        for r in group:
            if r["label"] == reference:
                continue
            compared += 1
            if r["token_ids"] != expected:
                got = r["token_ids"]
                first = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), None)
                mismatches.append(
                    {
                        "prompt_index": prompt,
                        "prompt_id": r.get("prompt_id"),
                        "repeat": repeat,
                        "label": r["label"],
                        "first_difference": first if first is not None else min(len(expected), len(got)),
                        "reference_tokens": len(expected),
                        "tokens": len(got),
                    }
                )
    return {
        "reference": reference,
        "compared": compared,
        "passed": not mismatches,
        "mismatches": mismatches,
    }


def announce(check: dict, stream: TextIO | None = None) -> None:
    """Say loudly on ``stream`` (stderr) that outputs differ; silent when the check passed."""
    if check["passed"]:
        return
    stream = stream or sys.stderr
    bar = "!" * 78
    bad = sorted({m["label"] for m in check["mismatches"]})
    lines = [
        bar,
        f"T=0 OUTPUT MISMATCH: {len(check['mismatches'])} of {check['compared']} greedy responses differ "
        f"from '{check['reference']}' ({', '.join(bad)})",
    ]
    for m in check["mismatches"][:10]:
        lines.append(
            f"  {m['label']}: prompt {m['prompt_index']} ({m['prompt_id']}), repeat {m['repeat']}: "
            f"first difference at token {m['first_difference']} "
            f"({m['tokens']} vs {m['reference_tokens']} tokens)"
        )
    if len(check["mismatches"]) > 10:
        lines.append(f"  ... and {len(check['mismatches']) - 10} more (results.json: t0_check)")
    lines += ["Speedups of these methods compare different outputs.", bar]
    print("\n".join(lines), file=stream, flush=True)
