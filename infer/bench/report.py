"""The benchmark report: one JSON file, one Markdown file with the tables, and two PNG charts.

A report is a plain dict (see :func:`infer.bench.main.run_bench`): ``meta``, ``workloads``,
``runs`` (one per system × workload × concurrency, each with its ``metrics``,
``ratio_vs_sequential`` and, when vLLM was measured, ``ratio_vs_vllm``: output tok/s and TTFT
p95 over vLLM's on the same load; an infer server's runs have ``drafts``: the draft tokens it
verified over the workload and how many it accepted; W1 runs of infer and llama.cpp have
``bandwidth``: bytes per token ÷ ITL p50 in GB/s and as a share of the read probe, run just
before and after them (``probes_gb_s``; its first reading is ``meta.bandwidth``)),
``unavailable`` systems with the reason, and ``goals``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from infer.bench.bandwidth import STEADY_SPREAD

Report = dict[str, Any]
Run = dict[str, Any]


def write_report(report: Report, out_dir: Path, stem: str) -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md``, ``<stem>-throughput.png`` and ``<stem>-latency.png``.

    Returns:
        The path of each file by kind (``json``, ``md``, ``throughput``, ``latency``).
    """
    # matplotlib takes a second to import: only a finished run pays for it, not every `infer`.
    from infer.bench.charts import latency_chart, throughput_chart

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "json": out_dir / f"{stem}.json",
        "md": out_dir / f"{stem}.md",
        "throughput": out_dir / f"{stem}-throughput.png",
        "latency": out_dir / f"{stem}-latency.png",
    }
    report["files"] = {kind: path.name for kind, path in paths.items()}
    throughput_chart(report["runs"], paths["throughput"])
    latency_chart(report["runs"], paths["latency"], focus_workload(report["runs"]))
    paths["md"].write_text(markdown(report))
    paths["json"].write_text(json.dumps(report, indent=2) + "\n")
    return paths


def focus_workload(runs: list[Run]) -> str | None:
    """The workload the latency chart shows: W2 when it ran, else the first one."""
    names = [r["workload"] for r in runs]
    return "W2" if "W2" in names else (names[0] if names else None)


def markdown(report: Report) -> str:
    """The whole report as Markdown: context, one table per workload, goals, charts."""
    meta = report["meta"]
    lines = [
        f"# infer serving benchmark, {meta['date']} on {meta['host']}",
        "",
        f"{meta['model']} ({meta['dtype']}), {meta['cpu']}, {meta['cpu_count']} cores, "
        f"torch {meta['torch']} with {meta['torch_threads']} threads, scale `{meta['scale']}`, "
        f"seed {meta['seed']}, load average {meta['load_average']} at the start. "
        f"Raw batch-1 decode forward at {meta.get('forward_step_context')} tokens of context: "
        f"{_num(meta.get('forward_step_ms'))} ms.",
        "",
        f"Rerun: `{meta['command']}`",
        "",
        *_startup(meta.get("startup_s") or {}),
        *_rss(meta.get("rss_mb") or {}),
        *[f"- {note}" for note in meta.get("notes", [])],
        "",
        tables(report),
        bandwidth_table(report),
        goals_table(report),
        *_unavailable(report.get("unavailable", [])),
        "## Charts",
        "",
        f"![throughput vs concurrency]({report['files']['throughput']})",
        f"![TTFT and ITL percentiles]({report['files']['latency']})",
        "",
    ]
    return "\n".join(lines)


def tables(report: Report) -> str:
    """The result tables alone (what ``infer bench`` prints)."""
    out: list[str] = []
    with_vllm = any("ratio_vs_vllm" in r for r in report["runs"])  # vLLM ran in this report
    for workload in report["workloads"]:
        name = workload["name"]
        runs = [r for r in report["runs"] if r["workload"] == name]
        if name == "sweep":
            out += _sweep_table(workload, runs, with_vllm)
        else:
            out += [
                f"## {name}: {workload['description']}",
                "",
                *_workload_table(runs, with_vllm),
                "",
            ]
    return "\n".join(out)


_HEADER = (
    "| system | output tok/s | × sequential | req/s | TTFT p50 / p95 / p99 ms "
    "| ITL p50 / p95 / p99 ms | TPOT p50 ms | E2E p50 / p95 / p99 ms | errors |"
)
_VLLM_HEADER = "× vLLM tok/s; TTFT p95 |"
_FOLLOW_UP_HEADER = " later turns TTFT p50 ms |"
_DRAFTS_HEADER = " drafts accepted |"


def _workload_table(runs: list[Run], with_vllm: bool = False) -> list[str]:
    """One row per run. Columns only some loads have: × vLLM (when vLLM ran), the TTFT of
    follow-up requests (a conversation's later turns), and the share of draft tokens an infer
    server accepted, of how many it drafted (speculative decoding; – for other systems)."""
    follow_ups = any("ttft_follow_up_ms" in r["metrics"] for r in runs)
    drafts = any("drafts" in r for r in runs)
    header = _HEADER.replace("| req/s", "| " + _VLLM_HEADER + " req/s") if with_vllm else _HEADER
    if follow_ups:
        header = header.replace(" | ITL", " |" + _FOLLOW_UP_HEADER + " ITL")
    if drafts:
        header += _DRAFTS_HEADER
    rows = [header, "|" + "---|" * (9 + with_vllm + follow_ups + drafts)]
    for run in runs:
        m = run["metrics"]
        errors = str(m["errors"])
        if m["errors"]:
            errors += " (" + ", ".join(f"{k}: {v}" for k, v in m["error_codes"].items()) + ")"
        if m.get("short"):
            errors += f"; {m['short']} short"
        vllm = f" {_vllm_ratio(run)} |" if with_vllm else ""
        later = f" {_num((m.get('ttft_follow_up_ms') or {}).get('p50'))} |" if follow_ups else ""
        accepted = f" {_drafts(run.get('drafts'))} |" if drafts else ""
        rows.append(
            f"| {_system(run)} | {_num(m['output_tok_s'])} | {_ratio(run)} |{vllm} "
            f"{_num(m['req_s'])} | {_pcts(m['ttft_ms'])} |{later} {_pcts(m['itl_ms'])} "
            f"| {_num(m['tpot_ms']['p50'])} | {_pcts(m['e2e_ms'])} | {errors} |{accepted}"
        )
    return rows


def _drafts(drafts: dict[str, Any] | None) -> str:
    """``62% of 1234``: accepted draft tokens, of those drafted; – without counters."""
    if drafts is None:
        return "–"
    if not drafts["drafted"]:
        return "none drafted"
    return f"{drafts['accepted'] / drafts['drafted']:.0%} of {drafts['drafted']}"


def _vllm_ratio(run: Run) -> str:
    """``0.52×; 1.90×``: output tok/s over vLLM's (higher is better), then TTFT p95 over
    vLLM's (lower is better); – where either is missing."""
    ratio = run.get("ratio_vs_vllm") or {}
    cells = [ratio.get("output_tok_s"), ratio.get("ttft_p95")]
    return "; ".join("–" if c is None else f"{c:.2f}×" for c in cells)


def _sweep_table(workload: dict[str, Any], runs: list[Run], with_vllm: bool = False) -> list[str]:
    levels = workload["levels"]
    out = [
        f"## Concurrency sweep: {workload['description']}",
        "",
        "Output tok/s (× sequential), TTFT p50 ms"
        + ("; × vLLM tok/s; TTFT p95" if with_vllm else "")
        + " below. A system marked *serial* handles one "
        "request at a time whatever the concurrency; it was measured once.",
        "",
        "| system | " + " | ".join(f"c={c}" for c in levels) + " |",
        "|---|" + "---|" * len(levels),
    ]
    for system in dict.fromkeys(r["system"] for r in runs):
        mine = [r for r in runs if r["system"] == system]
        by_level = {r["concurrency"]: r for r in mine}
        cells = []
        for c in levels:
            run = mine[0] if mine[0].get("serial") else by_level.get(c)
            if run is None:
                cells.append("–")
                continue
            m = run["metrics"]
            vllm = f"; {_vllm_ratio(run)}" if with_vllm else ""
            drafts = f"; drafts {_drafts(run['drafts'])}" if "drafts" in run else ""
            cells.append(
                f"{_num(m['output_tok_s'])} ({_ratio(run)}), {_num(m['ttft_ms']['p50'])} ms"
                f"{vllm}{drafts}"
            )
        out.append(f"| {_system(mine[0])} | " + " | ".join(cells) + " |")
    return [*out, ""]


def bandwidth_table(report: Report) -> str:
    """The read probe, the bytes a decode step reads, and each W1 run's bytes per token over
    its ITL p50 as a share of the probe (infer's and llama.cpp's systems)."""
    bw = report["meta"].get("bandwidth")
    if not bw:
        return ""
    out = ["## Memory bandwidth", ""]
    out.append(_probe_line(bw))
    if bw.get("bytes_per_token"):
        out.append(
            f"A decode step reads {bw['bytes_per_token'] / 1e6:.1f} MB of `{bw['gguf']}`: every "
            "tensor but the token embeddings, of which one row (all of them when they are the "
            "output head too); the same count for infer and llama.cpp."
        )
    else:
        out.append("No GGUF file: the bytes a decode step reads were not counted.")
    out += bw.get("notes", [])
    rows = [r for r in report["runs"] if "bandwidth" in r]
    if rows:
        out += [
            "",
            "Each share is over the mean of two probe readings, just before and just after "
            "that system's W1 (the memory of a VM can change speed for minutes at a time); "
            f"*moved* marks a run whose two readings differ by more than {STEADY_SPREAD:.0%}: "
            "its share is uncertain.",
            "",
            "| system | W1 ITL p50 ms | GB/s read (bytes per token ÷ ITL p50) "
            "| probe before / after, GB/s | of the probe |",
            "|---|---|---|---|---|",
        ]
        for run in rows:
            bw_run = run["bandwidth"]
            if bw_run.get("drafted"):
                out.append(f"| {run['system']} | drafted: not one step a token | – | – | – |")
                continue
            around = run.get("probes_gb_s") or []
            probes = " / ".join(f"{g:.1f}" for g in around) if around else "–"
            share = bw_run.get("of_probe")
            cell = "–" if share is None else f"{share:.0%}"
            if bw_run.get("steady") is False:
                cell += " (*moved*)"
            out.append(
                f"| {run['system']} | {_num(run['metrics']['itl_ms']['p50'])} "
                f"| {_num(bw_run.get('gb_s'))} | {probes} | {cell} |"
            )
    return "\n".join([*out, ""])


def _probe_line(bw: dict[str, Any]) -> str:
    """What the read probe measured, and where."""
    probe = bw.get("probe")
    if not probe:
        return f"Read probe: not measured ({bw.get('probe_error')})."
    llc, cache = bw.get("llc_bytes"), ""
    if llc:
        times, size = probe["bytes"] / llc, f"the {llc / 1e6:.0f} MB last-level cache"
        cache = f" ({times:.1f}× {size})" if times >= 1 else f" (less than {size})"
    return (
        f"Read probe (`bench/membw.cpp`): **{probe['gb_s']:.1f} GB/s** ({probe['plain_gb_s']:.1f} "
        f"with plain loads, {probe['prefetch_gb_s']:.1f} with software prefetch, best of "
        f"{probe['passes']} passes each), {probe['threads']} threads over "
        f"{probe['bytes'] / 1e9:.2f} GB{cache}, on {bw.get('cpu') or 'a CPU lscpu does not name'}."
    )


def goals_table(report: Report) -> str:
    """The serving goals with what this run measured (– where it did not measure them)."""
    goals = report.get("goals", [])
    if not goals:
        return ""
    out = ["## Goals", "", "| goal | measured | target | met |", "|---|---|---|---|"]
    for g in goals:
        met = "–" if g["met"] is None else ("yes" if g["met"] else "**no**")
        out.append(f"| {g['goal']} | {_num(g['value'])} | {g['target']} | {met} |")
    return "\n".join([*out, ""])


def _startup(startup_s: dict[str, float]) -> list[str]:
    if not startup_s:
        return []
    times = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in startup_s.items())
    return [f"Server start to ready: {times}.", ""]


def _rss(rss_mb: dict[str, float]) -> list[str]:
    if not rss_mb:
        return []
    sizes = ", ".join(f"{name} {mb / 1024:.2f} GB" for name, mb in rss_mb.items())
    return [f"Server resident memory (largest after a workload, all its processes): {sizes}.", ""]


def _unavailable(items: list[dict[str, str]]) -> list[str]:
    if not items:
        return []
    return ["## Not measured", "", *[f"- {u['system']}: {u['reason']}" for u in items], ""]


def _system(run: Run) -> str:
    return f"{run['system']} *(serial)*" if run.get("serial") else run["system"]


def _ratio(run: Run) -> str:
    ratio = run.get("ratio_vs_sequential")
    return "–" if ratio is None else f"{ratio:.2f}×"


def _pcts(stats: dict[str, float | None]) -> str:
    return " / ".join(_num(stats[k]) for k in ("p50", "p95", "p99"))


def _num(value: float | None) -> str:
    if value is None:
        return "–"
    size = abs(value)
    if size >= 100:
        return f"{value:.0f}"
    if size >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if size >= 1 else f"{value:.3g}"
