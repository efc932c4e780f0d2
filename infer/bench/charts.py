"""Two small PNG charts of a report's runs.

Drawn on bare :class:`matplotlib.figure.Figure` objects, which render PNG through Agg without
pyplot: no display, no global figure state, no backend to select.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

Run = dict[str, Any]
SIZE = (7.5, 3.6)
DPI = 90
# One colour per system in every chart (matplotlib's default cycle, by position, then named
# colours; grey for any other).
COLORS = {
    "sequential": "C0",
    "hf": "C1",
    "hf-batched": "C2",
    "infer-static": "C3",
    "infer-continuous": "C4",
    "llama.cpp": "C5",
    "url": "C6",
    "infer-noprefix": "C8",
    "vllm": "C9",
    "infer-nospec": "black",
    "infer-prediction": "gold",
    "llama.cpp-ngram": "darkred",
    "llama.cpp-draft": "magenta",
    "infer-avx2": "teal",
    "infer-avx2-nospec": "darkcyan",
    "llama.cpp-avx2": "olive",
}
# Without a sweep, these workloads' runs are the throughput chart's points (at most one per
# system and concurrency, the first listed): prefix measures TTFT, not throughput.
THROUGHPUT_WORKLOADS = ("W2-serial", "W1", "W2", "chat64")
PERCENTILE_SHADES = {"p50": 1.0, "p95": 0.65, "p99": 0.35}


def throughput_chart(runs: list[Run], path: Path) -> None:
    """Output tok/s against concurrency, one line per system.

    Uses the sweep's runs when there are any, else the runs of
    :data:`THROUGHPUT_WORKLOADS` at their concurrency. A serial system (one request at a time)
    is a dashed horizontal line at its measured rate.
    """
    sweep = [r for r in runs if r["workload"] == "sweep"]
    points = sweep or _one_per_level(runs)
    levels = sorted({r["concurrency"] for r in points if not r.get("serial")} or {1})
    fig = Figure(figsize=SIZE, dpi=DPI)
    ax = fig.subplots()
    for system in dict.fromkeys(r["system"] for r in points):
        mine = sorted(
            (r for r in points if r["system"] == system and r["metrics"]["output_tok_s"]),
            key=lambda r: r["concurrency"],
        )
        if not mine:
            continue
        color = COLORS.get(system, "C7")
        if mine[0].get("serial"):
            rate = mine[0]["metrics"]["output_tok_s"]
            ax.plot(
                [levels[0], levels[-1]], [rate, rate], "--", color=color, label=f"{system} (serial)"
            )
        else:
            xs = [r["concurrency"] for r in mine]
            ax.plot(
                xs, [r["metrics"]["output_tok_s"] for r in mine], "o-", color=color, label=system
            )
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput vs concurrency" + (" (sweep)" if sweep else ""))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a small run may have plotted nothing here
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)


def _one_per_level(runs: list[Run]) -> list[Run]:
    chosen: dict[tuple[str, int], Run] = {}
    for name in THROUGHPUT_WORKLOADS:
        for r in runs:
            if r["workload"] == name:
                chosen.setdefault((r["system"], r["concurrency"]), r)
    return list(chosen.values()) or runs


def latency_chart(runs: list[Run], path: Path, workload: str | None) -> None:
    """TTFT and ITL p50/p95/p99 per system on one workload, as grouped bars (log scale).

    Each system keeps its colour; p50, p95 and p99 are its bars from solid to faint.
    """
    mine = [r for r in runs if r["workload"] == workload]
    fig = Figure(figsize=SIZE, dpi=DPI)
    axes = fig.subplots(1, 2)
    for ax, metric, title in zip(axes, ("ttft_ms", "itl_ms"), ("TTFT", "ITL"), strict=True):
        width = 0.8 / 3
        names = [r["system"] for r in mine]
        colors = [COLORS.get(name, "C7") for name in names]
        for k, (pct, alpha) in enumerate(PERCENTILE_SHADES.items()):
            values = [r["metrics"][metric][pct] or 0.0 for r in mine]
            xs = [i + (k - 1) * width for i in range(len(mine))]
            ax.bar(xs, values, width, color=colors, alpha=alpha, label=pct)
        ax.set_xticks(range(len(mine)), names, rotation=30, ha="right", fontsize=7)
        if any(r["metrics"][metric]["p50"] for r in mine):
            ax.set_yscale("log")  # systems differ by orders of magnitude
        ax.set_ylabel("ms")
        ax.set_title(f"{title} percentiles ({workload})", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    legend = axes[0].legend(fontsize=7)
    for handle in legend.legend_handles:  # the legend explains shades, not systems
        if handle is not None:
            handle.set_color("0.3")
    fig.tight_layout()
    fig.savefig(path)
