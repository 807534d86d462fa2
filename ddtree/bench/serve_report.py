"""``ddtree bench serve`` results: one level's summary, the Markdown report and the plot.

TTFT: request start to the first chunk with text. TPOT: (latency - TTFT) / (output tokens - 1), per
request. ITL: the gaps between successive text chunks of one request (a chunk is one engine step, which
may carry several tokens). Percentiles are over requests (TTFT, TPOT, latency) or over gaps (ITL), with
numpy's linear interpolation; times are reported in milliseconds.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

PERCENTILES = (50, 90, 99)
TIMINGS = ("ttft", "tpot", "itl", "latency")


def _stats(values: list[float]) -> dict | None:
    if not values:
        return None
    ms = np.asarray(values) * 1000.0
    out = {"mean": float(ms.mean())}
    out |= {f"p{q}": float(np.percentile(ms, q)) for q in PERCENTILES}
    return out


def level_summary(records: list, seconds: float) -> dict:
    """What one level measured: throughput, latency distributions (ms) and failures by status."""
    ok = [r for r in records if r.ok]
    tpot = [
        (r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.ttft is not None and r.output_tokens > 1
    ]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": dict(Counter(r.status for r in records if not r.ok)),
        "first_errors": {r.status: r.error for r in reversed(records) if not r.ok},
        "duration_s": seconds,
        "request_throughput": len(ok) / seconds if seconds > 0 else 0.0,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / seconds if seconds > 0 else 0.0,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "prefix_cache_hit_rate": sum(r.cached_tokens for r in ok) / prompt_tokens if prompt_tokens else 0.0,
        "ttft_ms": _stats([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats(itl),
        "latency_ms": _stats([r.latency for r in ok]),
    }


def _level_name(level: dict) -> str:
    if level["request_rate"] is not None:
        return f"{level['request_rate']:g} req/s"
    return str(level["concurrency"])


def _ms(stats: dict | None, key: str) -> str:
    return "-" if stats is None else f"{stats[key]:.1f}"


def _shared(tokens: int | None) -> str:
    return f", each after a shared prefix of about {tokens} tokens" if tokens else ""


def markdown(report: dict) -> str:
    config = report["config"]
    label = config["label"]
    title = f"# ddtree bench serve ({label})" if label else "# ddtree bench serve"
    where = config["base_url"] or f"ddtree serve {' '.join(config['server_args'] or [])}".strip()
    lines = [
        title,
        "",
        f"Server: `{where}`, model `{config['model']}`; prompts: {config['prompts']}"
        f"{_shared(config.get('shared_prefix_tokens'))}; "
        f"max_tokens {config['max_tokens']}, temperature {config['temperature']:g}"
        f"{', ignore_eos' if config['ignore_eos'] else ''}.",
        "",
        "| level | requests ok | failed | req/s | output tok/s | prefix cache hits | TTFT mean / p50 / p90 / "
        "p99 (ms) | TPOT mean / p50 / p90 / p99 (ms) | ITL mean / p50 / p90 / p99 (ms) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for level in report["levels"]:
        failed = ", ".join(f"{k}: {v}" for k, v in sorted(level["failed"].items())) or "0"
        cells = [
            " / ".join(_ms(level[f"{name}_ms"], k) for k in ("mean", "p50", "p90", "p99"))
            for name in ("ttft", "tpot", "itl")
        ]
        lines.append(
            f"| {_level_name(level)} | {level['completed']} | {failed} | {level['request_throughput']:.2f} "
            f"| {level['output_tokens_per_s']:.1f} | {level.get('prefix_cache_hit_rate', 0.0):.0%} "
            f"| {' | '.join(cells)} |"
        )
    errors = {k: v for level in report["levels"] for k, v in level["first_errors"].items()}
    if errors:
        lines += ["", "Failures (a message for each status):", ""]
        lines += [f"- {status}: {message}" for status, message in sorted(errors.items())]
    lines += ["", __doc__.split("\n\n", 1)[1].strip(), ""]
    return "\n".join(lines)


def plot_serve(report: dict, path: Path) -> None:
    """Output tokens/s, and p50 / p99 TTFT, against the level (concurrency or request rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [lv for lv in report["levels"] if lv["completed"]]
    by_rate = bool(levels) and levels[0]["request_rate"] is not None
    x = [lv["request_rate"] if by_rate else lv["concurrency"] for lv in levels]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(x, [lv["output_tokens_per_s"] for lv in levels], "o-")
    left.set_ylabel("output tokens/s")
    for q, style in (("p50", "o-"), ("p99", "s--")):
        right.plot(
            x, [lv["ttft_ms"][q] if lv["ttft_ms"] else np.nan for lv in levels], style, label=f"{q} TTFT"
        )
    right.set_ylabel("time to first token (ms)")
    right.legend()
    for ax in (left, right):
        ax.set_xlabel("request rate (req/s)" if by_rate else "concurrent clients")
        if len(x) > 1 and min(x) > 0:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    label = report["config"]["label"]
    fig.suptitle(f"ddtree bench serve{f' ({label})' if label else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
