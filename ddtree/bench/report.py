"""``results.json`` (everything, raw records included) and ``results.md`` (the tables a reader wants)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from ddtree.bench.metrics import DEFINITIONS


def best_ddtree(rows: list[dict], temperature: float) -> dict | None:
    """The ddtree row of one temperature with the highest speedup (tau when no speedup is known)."""
    mine = [r for r in rows if r["temperature"] == temperature and r["method"] == "ddtree"]
    if not mine:
        return None
    return max(mine, key=lambda r: (r["speedup"] or 0.0, r["tau"] or 0.0))


def write_json(path: Path, results: dict) -> None:
    path.write_text(json.dumps(results, indent=1) + "\n")


def write_outputs(out: Path, results: dict, text: str, plots: dict[str, Callable[[Path], None]]) -> None:
    """``results.json``, ``results.md`` (``text``) and each plot (file name -> drawer) into ``out``; prints
    the Markdown and where everything went."""
    write_json(out / "results.json", results)
    (out / "results.md").write_text(text)
    for name, draw in plots.items():
        draw(out / name)
    sys.stdout.write(text)
    print(f"\nwrote {', '.join(['results.json', 'results.md', *plots])} to {out}")


def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def markdown(results: dict) -> str:
    cfg, machine, rows = results["config"], results["machine"], results["summary"]
    where = machine.get("gpu") or machine["processor"]
    out = [
        "# ddtree benchmark",
        "",
        f"Target `{cfg['target']}`, drafter `{cfg['drafter']}`, {cfg['num_prompts']} prompts "
        f"(`{cfg['prompts']}`), {cfg['max_new_tokens']} new tokens, {cfg['repeats']} repeats, "
        f"{machine['device']} ({where}), {machine['dtype']}, torch {machine['torch']}, "
        f"{machine['torch_threads']} torch threads.",
        "",
        _check_line(results["t0_check"]),
        *compile_lines(results.get("compile")),
    ]
    for temperature in dict.fromkeys(r["temperature"] for r in rows):
        mine = [r for r in rows if r["temperature"] == temperature]
        top_p = cfg.get("top_p", 1.0) if temperature > 0 else 1.0
        out += ["", f"## Temperature {temperature:g}" + (f", top-p {top_p:g}" if top_p < 1 else ""), ""]
        out += _main_table(mine, machine["memory_kind"])
        out += _stage_table([r for r in mine if r["stages"] is not None])
        chain = next((r for r in mine if r["method"] == "dflash"), None)
        best = best_ddtree(rows, temperature)
        out += _histogram_table([r for r in (chain, best) if r is not None], best)
    out += _tree_build_table(results.get("tree_build") or [])
    out += ["", "## Definitions", ""]
    out += [f"- **{name}**: {text}" for name, text in DEFINITIONS.items()]
    return "\n".join(out) + "\n"


def compile_lines(compile_: dict | None) -> list[str]:
    """With ``--compile``: which shapes the compiled engine holds and what compiling them cost."""
    if not compile_ or not compile_.get("enabled"):
        return []
    return [
        "",
        f"Compiled engine (`+compiled` rows, `compile=True`): warm-up (compile) "
        f"**{compile_['warmup_seconds']:.1f} s** for {_shapes(compile_['shapes'])} (batch buckets "
        f"{_csv(compile_['batch_buckets'])}, node buckets {_csv(compile_['node_buckets'])}, span buckets "
        f"{_csv(compile_['span_buckets'])}), before the "
        "run and outside every timing. Eager rows run the default engine on the same weights.",
    ]


def _shapes(n: int) -> str:
    return f"{n} verify shape" + ("" if n == 1 else "s")


def _csv(values) -> str:
    return ",".join(map(str, values))


def _check_line(check: dict) -> str:
    if check["compared"] == 0:
        return "**T=0 check: not run** (no temperature 0 or nothing to compare with `ar`)."
    if check["passed"]:
        return f"**T=0 check: passed**: all {check['compared']} greedy responses equal `ar`'s tokens."
    labels = ", ".join(sorted({m["label"] for m in check["mismatches"]}))
    return (
        f"**T=0 check: FAILED**: {len(check['mismatches'])} of {check['compared']} greedy responses "
        f"differ from `ar`'s ({labels}); see `t0_check` in results.json."
    )


def _main_table(rows: list[dict], memory_kind: str) -> list[str]:
    memory = "peak MiB" if memory_kind == "cuda_max_allocated" else "process peak RSS MiB"
    compiled = any(r.get("compiled") for r in rows)
    extra_head, extra_rule = (" compiled | x eager |", "---|--:|") if compiled else ("", "")
    out = [
        f"| config |{extra_head} tau | TPOT ms | tokens/s | speedup (median) | per-repeat speedups "
        f"| prefill ms | output tokens | {memory} |",
        f"|---|{extra_rule}--:|--:|--:|--:|---|--:|--:|--:|",
    ]
    for r in rows:
        tpot_ms = r["tpot_seconds"] * 1e3 if r["tpot_seconds"] is not None else None
        repeats = ", ".join(f"{s:.2f}" for s in r["speedup_per_repeat"])
        extra = ""
        if compiled:
            gain = r.get("compile_speedup")
            extra = f" {'yes' if r.get('compiled') else 'no'} | {'' if gain is None else f'{gain:.2f}x'} |"
        out.append(
            f"| {r['label']} |{extra} {_f(r['tau'], '.2f')} | {_f(tpot_ms, '.2f')} "
            f"| {_f(r['tokens_per_second'], '.1f')} | {_f(r['speedup'], '.2f')}x | {repeats} "
            f"| {r['prefill_seconds_mean'] * 1e3:.1f} | {r['output_tokens_mean']:.1f} "
            f"| {_mib(r['peak_memory_bytes'])} |"
        )
    return out


def _stage_table(rows: list[dict]) -> list[str]:
    """ms per round and share of decode time of each engine stage; HF rows have no stages."""
    if not rows:
        return []
    names = list(dict.fromkeys(k for r in rows for k in r["stages"]["stage_seconds_per_round"]))
    caveat = (
        " (verify includes the acceptance step)" if rows[0]["stages"]["verify_includes_acceptance"] else ""
    )
    out = [
        "",
        f"Per round: ms per stage (share of decode time); overhead: outside the forwards{caveat}; host ms "
        "per round: the round's wall time minus its two forwards.",
        "",
        "| config | rounds | " + " | ".join(names) + " | overhead | host ms per round |",
        "|---|--:|" + "--:|" * (len(names) + 2),
    ]
    for r in rows:
        s = r["stages"]
        per_round, share = s["stage_seconds_per_round"], s["stage_fractions"]
        cells = [f"{per_round.get(k, 0.0) * 1e3:.3f} ({share.get(k, 0.0):.0%})" for k in names]
        out.append(
            f"| {r['label']} | {s['rounds']} | " + " | ".join(cells) + f" | {s['overhead_fraction']:.0%} "
            f"| {s['host_seconds_per_round'] * 1e3:.2f} |"
        )
    return out


def _histogram_table(rows: list[dict], best: dict | None) -> list[str]:
    if not rows:
        return []
    lengths = sorted({int(k) for r in rows for k in r["acceptance_histogram"]})
    title = "Acceptance lengths (share of rounds)"
    if best is not None:
        title += (
            f"; ddtree at budget {best['budget']}: the budget with the highest median speedup at this "
            "temperature (the highest tau when no speedup is known), as in acceptance_histogram.png"
        )
    out = [
        "",
        title + ":",
        "",
        "| config | " + " | ".join(map(str, lengths)) + " |",
        "|---|" + "--:|" * len(lengths),
    ]
    for r in rows:
        shares = {int(k): v for k, v in r["acceptance_fractions"].items()}
        out.append(f"| {r['label']} | " + " | ".join(f"{shares.get(k, 0.0):.1%}" for k in lengths) + " |")
    return out


def _tree_build_table(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    first = rows[0]
    budgets = list(dict.fromkeys(r["budget"] for r in rows))
    out = [
        "",
        f"## Tree build alone: {first['positions']} positions x {first['vocab']} tokens, synthetic logits",
        "",
        "Median ms of the round's tree stage (`draft_candidates`, then the batched device beam "
        "`build_tree_batch`) for all the rows at once.",
        "",
        "| logits scale | mean top-1 prob | rows | " + " | ".join(f"budget {b}" for b in budgets) + " |",
        "|--:|--:|--:|" + "--:|" * len(budgets),
    ]
    for scale in dict.fromkeys(r["scale"] for r in rows):
        for b in dict.fromkeys(r["rows"] for r in rows):
            mine = {r["budget"]: r for r in rows if r["scale"] == scale and r["rows"] == b}
            top1 = next(iter(mine.values()))["top1_probability"]
            cells = " | ".join(f"{mine[n]['median_ms']:.3f}" for n in budgets)
            out.append(f"| {scale:g} | {top1:.3f} | {b} | {cells} |")
    return out
