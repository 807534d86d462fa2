"""``ddtree bench --concurrency 1,4,16``: throughput of each configuration with c requests in flight.

For each temperature, level c and configuration, the engine decodes ``max(2c, prompts)`` requests while
keeping c of them in flight: a finished request is replaced at the next step, as a server under steady load
sees it. Reported per run: total output tokens/s, the mean per-request TPOT (seconds between a request's
first and last token over its further tokens), tau, and the mean rows per step. The configurations of one
level run back to back, so machine drift hits them alike. At T = 0 every request's tokens must equal plain
decoding's (``ar`` at concurrency 1) for the same prompt: batching never changes an output.

With ``--compile`` every configuration also runs on the compiled engine (label suffix ``+compiled``), right
after its eager twin; the T = 0 reference stays eager ``ar``, and the goals are computed for each engine.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

from tqdm import tqdm

from ddtree.bench.runner import BenchConfig, Spec, pick_engine, seed_for
from ddtree.request.params import AUTO
from ddtree.request.stats import mean_acceptance_length


def run_level(
    engines, spec: Spec, prompt_ids: list[list[int]], cfg: BenchConfig, temperature: float, concurrency: int
) -> dict:
    """One configuration at one level: ``max(2c, prompts)`` requests, c in flight, on
    ``pick_engine(engines, spec)``."""
    engine = pick_engine(engines, spec)
    engine.reset_prefix_cache()  # no configuration starts with another's prompts cached
    total = max(2 * concurrency, len(prompt_ids))
    budget = spec.budget if spec.method == "ddtree" else None
    pending = deque(range(total))
    index: dict[str, int] = {}
    tokens: dict[int, list[int]] = {}
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    taus: dict[int, float] = {}
    steps = rows = 0
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and engine.num_running + engine.num_waiting < concurrency:
            i = pending.popleft()
            params = cfg.sampling(temperature, seed_for(cfg.seed, i % len(prompt_ids), 0))
            rid = engine.add_request(
                prompt_ids[i % len(prompt_ids)], params, method=spec.method, budget=budget, topk=cfg.topk
            )
            index[rid] = i
            tokens[i] = []
        rows += engine.num_running
        deltas = engine.step()
        steps += 1
        now = time.perf_counter()
        for delta in deltas:
            i = index[delta.request_id]
            tokens[i] += delta.token_ids
            first.setdefault(i, now)
            last[i] = now
            if delta.finish_reason is not None:
                taus[i] = mean_acceptance_length(delta.stats.acceptance_lengths)
    wall = time.perf_counter() - start
    output = sum(len(t) for t in tokens.values())
    tpots = [(last[i] - first[i]) / (len(tokens[i]) - 1) for i in tokens if len(tokens[i]) > 1]
    return {
        "label": spec.label,
        "method": spec.method,
        "budget": spec.budget,
        "compiled": spec.compiled,
        "temperature": temperature,
        "concurrency": concurrency,
        "requests": total,
        "output_tokens": output,
        "wall_seconds": wall,
        "tokens_per_second": output / wall,
        "tpot_seconds": sum(tpots) / len(tpots) if tpots else None,
        "tau": sum(taus.values()) / len(taus),
        "mean_rows_per_step": rows / steps if steps else 0.0,
        "token_ids": [tokens[i] for i in range(total)],
    }


def run_concurrency(
    engines,
    prompt_ids: list[list[int]],
    cfg: BenchConfig,
    levels: tuple[int, ...],
    progress: bool = True,
) -> list[dict]:
    """Every (temperature, level, configuration), after one untimed warm-up run per configuration."""
    specs = [s for s in cfg.specs if s.method in ("ar", "dflash", "ddtree")]
    bar = tqdm(
        total=len(cfg.temperatures) * len(levels) * len(specs), desc="bench", unit="run", disable=not progress
    )
    warm = replace(cfg, max_new_tokens=min(cfg.max_new_tokens, 8))
    for spec in specs:
        run_level(engines, spec, prompt_ids[:1], warm, cfg.temperatures[0], 1)
    records = []
    try:
        for temperature in cfg.temperatures:
            for c in levels:
                for spec in specs:
                    bar.set_postfix_str(f"{spec.label} T={temperature:g} c={c}", refresh=False)
                    records.append(run_level(engines, spec, prompt_ids, cfg, temperature, c))
                    bar.update()
    finally:
        bar.close()
    return records


def greedy_check(records: list[dict], num_prompts: int) -> dict:
    """At T = 0 every request (compiled ones included) equals eager ``ar`` at the lowest level for the same
    prompt."""
    greedy = [r for r in records if r["temperature"] == 0]
    if not greedy:
        return {"checked": 0, "mismatches": [], "passed": True}
    base = min(r["concurrency"] for r in greedy)
    reference = next(
        r for r in greedy if r["method"] == "ar" and not r.get("compiled") and r["concurrency"] == base
    )["token_ids"]
    mismatches = []
    for r in greedy:
        for i, ids in enumerate(r["token_ids"]):
            if ids != reference[i % num_prompts]:
                mismatches.append({"label": r["label"], "concurrency": r["concurrency"], "request": i})
    checked = sum(len(r["token_ids"]) for r in greedy)
    return {"checked": checked, "mismatches": mismatches, "passed": not mismatches}


def goals(records: list[dict]) -> list[dict]:
    """The issue's figures per temperature: batching speedups and ddtree against ar under load; for the
    eager engine, then (``compiled`` true, ``what`` saying so) for the compiled one against itself."""
    out = []
    for compiled in (False, True):
        mine = [r for r in records if bool(r.get("compiled")) == compiled]
        for goal in _goals(mine):
            if compiled:
                goal["what"] = "compiled engine: " + goal["what"]
            out.append(goal | {"compiled": compiled})
    return out


def _goals(records: list[dict]) -> list[dict]:
    out = []
    for temperature in sorted({r["temperature"] for r in records}):
        rows = [r for r in records if r["temperature"] == temperature]
        levels = sorted({r["concurrency"] for r in rows})

        def tps(label_filter, c: int, rows=rows) -> tuple[float, str] | None:
            found = [
                (r["tokens_per_second"], r["label"])
                for r in rows
                if label_filter(r) and r["concurrency"] == c
            ]
            return max(found) if found else None

        fixed = lambda r: r["method"] == "ddtree" and r["budget"] != AUTO  # noqa: E731
        lo, hi = levels[0], levels[-1]
        ar_lo, ar_hi = tps(lambda r: r["method"] == "ar", lo), tps(lambda r: r["method"] == "ar", hi)
        dd_lo, dd_hi = tps(fixed, lo), tps(fixed, hi)
        if ar_lo and ar_hi and hi != lo:
            target = 4.0 if (lo, hi) == (1, 16) else None
            out.append(_goal(temperature, f"ar at c={hi} / ar at c={lo}", ar_hi[0] / ar_lo[0], target))
        if dd_lo and dd_hi and hi != lo:
            out.append(
                _goal(
                    temperature,
                    f"best ddtree at c={hi} ({dd_hi[1]}) / best ddtree at c={lo} ({dd_lo[1]})",
                    dd_hi[0] / dd_lo[0],
                    3.0 if (lo, hi) == (1, 16) else None,
                )
            )
        for c in levels:
            ar_c, dd_c = tps(lambda r: r["method"] == "ar", c), tps(fixed, c)
            if ar_c and dd_c:
                target = 1.3 if c == 4 else None
                out.append(
                    _goal(
                        temperature,
                        f"best ddtree at c={c} ({dd_c[1]}) / ar at c={c}",
                        dd_c[0] / ar_c[0],
                        target,
                    )
                )
            auto_c = tps(lambda r: r["budget"] == AUTO, c)
            if auto_c and ar_c:
                best = max(ar_c, dd_c or ar_c)
                out.append(
                    _goal(
                        temperature,
                        f"ddtree@auto at c={c} / max(ar, best fixed: {best[1]})",
                        auto_c[0] / best[0],
                        0.97,
                    )
                )
    return out


def _goal(temperature: float, what: str, ratio: float, target: float | None) -> dict:
    return {
        "temperature": temperature,
        "what": what,
        "ratio": ratio,
        "target": target,
        "met": None if target is None else ratio >= target,
    }


def markdown(results: dict) -> str:
    cfg = results["config"]
    lines = [
        "# ddtree bench --concurrency",
        "",
        f"{cfg['num_prompts']} prompts, {cfg['max_new_tokens']} new tokens, levels {cfg['concurrency']}; "
        f"`max(2c, prompts)` requests per run, c in flight. Machine: {results['machine']['processor']}, "
        f"{results['machine']['torch_threads']} torch threads.",
        "",
    ]
    check = results["t0_check"]
    lines += [
        f"T = 0 check: {check['checked']} responses, "
        + ("all equal plain decoding." if check["passed"] else f"{len(check['mismatches'])} MISMATCHES."),
        "",
    ]
    compile_ = results.get("compile") or {}
    if compile_.get("enabled"):
        lines += [
            f"Compiled engine (`+compiled` rows): warm-up (compile) {compile_['warmup_seconds']:.1f} s for "
            f"{compile_['shapes']} verify shape(s) (batch buckets {compile_['batch_buckets']}, node buckets "
            f"{compile_['node_buckets']}, span buckets {compile_['span_buckets']}), outside every timing; "
            "ratios are against eager `ar`.",
            "",
        ]
    levels = cfg["concurrency"]
    for temperature in cfg["temperatures"]:
        rows = [r for r in results["records"] if r["temperature"] == temperature]
        ar = {r["concurrency"]: r["tokens_per_second"] for r in rows if r["label"] == "ar"}  # eager ar
        lines += [
            f"## T = {temperature:g}: output tokens/s (x ar at the same c) | TPOT ms | tau",
            "",
            "| config | " + " | ".join(f"c={c}" for c in levels) + " |",
            "|---|" + "---|" * len(levels),
        ]
        for label in dict.fromkeys(r["label"] for r in rows):
            cells = []
            for c in levels:
                r = next((x for x in rows if x["label"] == label and x["concurrency"] == c), None)
                if r is None:
                    cells.append("")
                    continue
                ratio = r["tokens_per_second"] / ar[c] if c in ar else float("nan")
                tpot = r["tpot_seconds"] * 1000 if r["tpot_seconds"] else float("nan")
                cells.append(f"{r['tokens_per_second']:.0f} ({ratio:.2f}x) / {tpot:.1f} / {r['tau']:.2f}")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Goals", "", "| T | figure | ratio | target | met |", "|---|---|--:|--:|---|"]
    for g in results["goals"]:
        target = "" if g["target"] is None else f">= {g['target']:g}x"
        met = "" if g["met"] is None else ("yes" if g["met"] else "no")
        lines.append(f"| {g['temperature']:g} | {g['what']} | {g['ratio']:.2f}x | {target} | {met} |")
    return "\n".join(lines) + "\n"
