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


def throughput_chart(runs: list[Run], path: Path) -> None:
    """Output tok/s against concurrency, one line per system.

    Uses the sweep's runs when there are any, else every run at its concurrency. A serial
    system (one request at a time) is a dashed horizontal line at its measured rate.
    """
    sweep = [r for r in runs if r["workload"] == "sweep"]
    points = sweep or runs
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
        if mine[0].get("serial"):
            rate = mine[0]["metrics"]["output_tok_s"]
            ax.plot([levels[0], levels[-1]], [rate, rate], "--", label=f"{system} (serial)")
        else:
            xs = [r["concurrency"] for r in mine]
            ax.plot(xs, [r["metrics"]["output_tok_s"] for r in mine], "o-", label=system)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("output tokens/s")
    ax.set_title("Throughput vs concurrency" + (" (sweep)" if sweep else ""))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path)


def latency_chart(runs: list[Run], path: Path, workload: str | None) -> None:
    """TTFT and ITL p50/p95/p99 per system on one workload, as grouped bars (log scale)."""
    mine = [r for r in runs if r["workload"] == workload]
    fig = Figure(figsize=SIZE, dpi=DPI)
    axes = fig.subplots(1, 2)
    for ax, metric, title in zip(axes, ("ttft_ms", "itl_ms"), ("TTFT", "ITL"), strict=True):
        width = 0.8 / 3
        names = [r["system"] for r in mine]
        for k, pct in enumerate(("p50", "p95", "p99")):
            values = [r["metrics"][metric][pct] or 0.0 for r in mine]
            xs = [i + (k - 1) * width for i in range(len(mine))]
            ax.bar(xs, values, width, label=pct)
        ax.set_xticks(range(len(mine)), names, rotation=30, ha="right", fontsize=7)
        if any(r["metrics"][metric]["p50"] for r in mine):
            ax.set_yscale("log")  # systems differ by orders of magnitude
        ax.set_ylabel("ms")
        ax.set_title(f"{title} percentiles ({workload})", fontsize=9)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
