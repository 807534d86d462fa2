"""PNG plots: tau and speedup vs budget, the acceptance-length histogram, throughput vs concurrency.

Matplotlib's Agg backend draws to files without a display, which is what a benchmark box has.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen before pyplot loads)

from ddtree.bench.report import best_ddtree  # noqa: E402
from ddtree.bench.runner import COMPILED_SUFFIX  # noqa: E402
from ddtree.request.params import AUTO  # noqa: E402

_REFERENCE_STYLE = {
    "ar": ("black", ":"),
    "dflash": ("tab:orange", "--"),
    "hf": ("gray", "-."),
    "hf-pld": ("tab:green", "-."),
}
_COMPILED_CURVE = ("tab:purple", "ddtree+compiled")


def plot_tau_speedup(rows: list[dict], path: Path) -> None:
    """Rows: tau, speedup. Columns: temperatures. DDTree's curve vs budget; the others as horizontal lines."""
    temperatures = list(dict.fromkeys(r["temperature"] for r in rows))
    fig, axes = plt.subplots(2, len(temperatures), figsize=(5 * len(temperatures), 7), squeeze=False)
    for col, temperature in enumerate(temperatures):
        mine = [r for r in rows if r["temperature"] == temperature]
        fixed = [r for r in mine if r["method"] == "ddtree" and r["budget"] != AUTO]
        for row, (key, name) in enumerate((("tau", "tau (tokens / round)"), ("speedup", "speedup vs ar"))):
            ax = axes[row][col]
            for compiled, (color, label) in ((False, ("tab:blue", "ddtree")), (True, _COMPILED_CURVE)):
                tree = sorted(
                    (r for r in fixed if bool(r.get("compiled")) == compiled), key=lambda r: r["budget"]
                )
                points = [(r["budget"], r[key]) for r in tree if r[key] is not None]
                if points:
                    ax.plot(*zip(*points, strict=True), "o-", color=color, label=label)
                    ax.set_xscale("log", base=2)
                    ax.set_xticks([b for b, _ in points], [str(b) for b, _ in points])
            # Reference lines often coincide (hf's tau is ar's 1.0; dflash's speedup can sit on ar's):
            # each is drawn thinner than the one before, so coinciding lines show as nested stripes,
            # and the legend gives every value.
            references = [r for r in mine if r not in fixed and r[key] is not None]
            for i, r in enumerate(references):
                color, style = _REFERENCE_STYLE.get(r["label"].removesuffix(COMPILED_SUFFIX), ("gray", "--"))
                if r.get("compiled"):  # its eager twin's colour, the other dash
                    style = "--" if style == ":" else ":"
                width = 1.2 + 1.2 * (len(references) - 1 - i)
                ax.axhline(
                    r[key], color=color, linestyle=style, linewidth=width, label=f"{r['label']} {r[key]:.2f}"
                )
            ax.set_xlabel("budget (tree nodes per round)")
            ax.set_ylabel(name)
            ax.set_title(f"{name}, T = {temperature:g}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance_histogram(rows: list[dict], path: Path) -> None:
    """Share of rounds per acceptance length, DFlash vs DDTree at its best budget; a panel per temperature."""
    temperatures = list(dict.fromkeys(r["temperature"] for r in rows))
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5 * len(temperatures), 3.5), squeeze=False)
    for col, temperature in enumerate(temperatures):
        ax = axes[0][col]
        chain = next((r for r in rows if r["temperature"] == temperature and r["method"] == "dflash"), None)
        shown = [r for r in (chain, best_ddtree(rows, temperature)) if r is not None]
        width = 0.8 / max(1, len(shown))
        longest = max((int(k) for r in shown for k in r["acceptance_fractions"]), default=1)
        for i, r in enumerate(shown):
            fractions = {int(k): v for k, v in r["acceptance_fractions"].items()}
            xs = sorted(fractions)
            offset = (i - (len(shown) - 1) / 2) * width
            label = r["label"] + (" (best budget)" if r["method"] == "ddtree" else "")
            label += f", tau {r['tau']:.2f}" if r["tau"] is not None else ""
            ax.bar([x + offset for x in xs], [fractions[x] for x in xs], width, label=label)
        ax.set_xticks(range(1, longest + 1))
        ax.set_xlabel("acceptance length (tokens per round)")
        ax.set_ylabel("share of rounds")
        ax.set_title(f"T = {temperature:g}")
        ax.grid(alpha=0.3, axis="y")
        if shown:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_throughput(records: list[dict], path: Path) -> None:
    """Output tokens/s of every configuration against the requests in flight; a panel per temperature."""
    temperatures = sorted({r["temperature"] for r in records})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(5.5 * len(temperatures), 4), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        rows = [r for r in records if r["temperature"] == temperature]
        for label in dict.fromkeys(r["label"] for r in rows):
            mine = sorted((r["concurrency"], r["tokens_per_second"]) for r in rows if r["label"] == label)
            style = "k--o" if label == "ar" else "-o"
            ax.plot([c for c, _ in mine], [t for _, t in mine], style, label=label, markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in flight (concurrency)")
        ax.set_ylabel("output tokens/s (all requests)")
        ax.set_title(f"T = {temperature:g}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
