"""One load, several rounds, systems in alternating order: a ratio this noisy machine can hold.

    python bench/rounds.py --model qwen2.5-coder-1.5b --systems infer-continuous,llama.cpp \
        --workload w1 --rounds 6 [--scale quick] [--temperature 0.7 --top-p 0.9] [--out FILE.md]

Each round is one ``infer bench`` run of the one workload on every system (each server
started afresh); odd rounds run the systems in reverse order, so a slow minute of the machine
falls on each of them in turn. Prints, per round, each system's output tok/s, ITL p50 and
TTFT p50, and the first system's tok/s over each other's; then the median and range of each
ratio. The rounds' full reports stay in a temporary directory (printed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--systems", default="infer-continuous,llama.cpp")
    p.add_argument("--workload", default="w1")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--scale", default="full", help="infer bench's --scale (full, quick, smoke)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--out", type=Path, help="also write the table here (Markdown)")
    args = p.parse_args()
    systems = args.systems.split(",")
    scratch = Path(tempfile.mkdtemp(prefix="infer-rounds-"))
    rows: list[dict[str, dict[str, float]]] = []
    for i in range(args.rounds):
        order = systems if i % 2 == 0 else systems[::-1]
        out = scratch / f"round{i}"
        command = [sys.executable, "-m", "infer", "bench", "--model", args.model]
        command += ["--systems", ",".join(order), "--workloads", args.workload]
        command += ["--scale", args.scale]
        command += ["--out", str(out), "--no-progress"]
        if args.temperature > 0:
            command += ["--temperature", str(args.temperature), "--top-p", str(args.top_p)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        (report,) = out.glob("*.json")
        runs = json.loads(report.read_text())["runs"]
        rows.append({r["system"]: _figures(r) for r in runs})
        print(f"round {i + 1}: " + _line(rows[-1], systems), file=sys.stderr, flush=True)
    table = _table(rows, systems, args)
    print(table)
    print(f"reports: {scratch}")
    if args.out:
        args.out.write_text(table + "\n")
    return 0


def _figures(run: dict[str, Any]) -> dict[str, float]:
    metrics, share = run["metrics"], run.get("bandwidth") or {}
    figures = {
        "tok_s": metrics["output_tok_s"],
        "itl": metrics["itl_ms"]["p50"],
        "ttft": metrics["ttft_ms"]["p50"],
    }
    if share.get("of_probe"):  # W1: its share of the probe readings around it
        figures["share"] = share["of_probe"]
        figures["steady"] = float(share.get("steady", True))
    return figures


def _line(row: dict[str, dict[str, float]], systems: list[str]) -> str:
    return ", ".join(f"{s} {row[s]['tok_s']:.1f} tok/s" for s in systems if s in row)


def _table(
    rows: list[dict[str, dict[str, float]]], systems: list[str], args: argparse.Namespace
) -> str:
    first, others = systems[0], systems[1:]
    mode = "greedy"
    if args.temperature:
        mode = f"temperature {args.temperature:g}, top-p {args.top_p:g}"
    head = ["round", "order"]
    for s in systems:
        head += [f"{s} tok/s", "ITL p50 ms", "TTFT p50 ms"]
    head += [f"{first} ÷ {s}" for s in others]
    lines = [
        f"{args.model}, {args.workload} ({args.scale}), {mode}, {len(rows)} rounds",
        "",
        "Rerun: `python bench/rounds.py " + " ".join(sys.argv[1:]) + "`",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    ratios: dict[str, list[float]] = {s: [] for s in others}
    for i, row in enumerate(rows):
        cells = [str(i + 1), "as listed" if i % 2 == 0 else "reversed"]
        for s in systems:
            f = row.get(s)
            if f:
                cells += [f"{f['tok_s']:.1f}", f"{f['itl']:.1f}", f"{f['ttft']:.0f}"]
            else:
                cells += ["–"] * 3
        for s in others:
            if first in row and s in row and row[s]["tok_s"]:
                ratios[s].append(row[first]["tok_s"] / row[s]["tok_s"])
                cells.append(f"{ratios[s][-1]:.2f}×")
            else:
                cells.append("–")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for s, values in ratios.items():
        if values:
            lines.append(
                f"{first} ÷ {s}, output tok/s: median {statistics.median(values):.2f}×, "
                f"range {min(values):.2f}–{max(values):.2f}× over {len(values)} rounds"
            )
    for s in systems:
        shares = [(row[s]["share"], row[s]["steady"]) for row in rows if "share" in row.get(s, {})]
        steady = [v for v, ok in shares if ok]
        if shares:
            lines.append(
                f"{s}, bytes per token ÷ ITL p50 over the probe read just before and after its "
                f"run: median {statistics.median(v for v, _ in shares):.0%} over {len(shares)} "
                + (
                    f"rounds, {statistics.median(steady):.0%} over the {len(steady)} whose "
                    "readings agreed"
                    if steady
                    else "rounds, none whose readings agreed"
                )
            )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
