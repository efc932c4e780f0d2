"""``infer bench``: run the workloads on every system, write the report, print the tables."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from infer.bench import bandwidth
from infer.bench.baselines import forward_step_ms, gguf_file
from infer.bench.metrics import summarize
from infer.bench.report import Report, Run, bandwidth_table, goals_table, tables, write_report
from infer.bench.servers import ServerError
from infer.bench.systems import (
    DEFAULT_SYSTEMS,
    LLAMA_AVX2,
    LLAMA_DRAFT_FLAGS,
    LLAMA_NGRAM_FLAGS,
    LLAMA_SPECULATIVE,
    SERIAL,
    SYSTEMS,
    URL_SYSTEM,
    Settings,
    Unavailable,
    llama_variants,
    open_system,
    reads_gguf,
    warm_up,
)
from infer.bench.workloads import (
    DEFAULT_WORKLOADS,
    SCALE_SIZES,
    SCALES,
    WORKLOAD_NAMES,
    Workload,
    build_workloads,
)
from infer.engine.config import DTYPES
from infer.models.config import ModelKind
from infer.models.errors import LoadError
from infer.models.loader import LoadedModel, load_model

# fim (code completion) and assistant (three models at once) have runners of their own
WORKLOADS = (*WORKLOAD_NAMES, "fim", "assistant")
# Not being able to measure these is expected on many machines; it does not fail the run.
OPTIONAL_SYSTEMS = frozenset(
    {"hf", "hf-batched", "llama.cpp", LLAMA_AVX2, *LLAMA_SPECULATIVE, "vllm"}
)
DEFAULT_BYTES_NOTE = (
    "infer serves the default model from its bf16 copy (converted once from the file), which "
    "reads more bytes a step than the file holds: infer's share of the probe is understated."
)
SMOKE_PROBE_BYTES = 64 << 20  # smoke checks the pipeline: a buffer the cache may hold
PEER = "vllm"  # the system every run is also compared with, when it was measured
TOKEN_COUNT_NOTE = (
    "Output tokens: the count each server reports in its final usage (infer's `done` event, "
    "the OpenAI stream's usage chunk), and the tokens generated for in-process systems; every "
    "request asks for an exact count with EOS ignored, so a *short* request is one that "
    "stopped early"
)

DRAFTS_NOTE = (
    "Drafts accepted: of the draft tokens an infer server verified during the load (its "
    "/metrics counters read before and after it), the share the model agreed with, and how "
    "many it verified; infer-nospec drafts none"
)

BURSTS_NOTE = (
    "Speculative decoding gives a request several tokens in one step, and they arrive together: "
    "its ITL mixes near-zero gaps with whole steps; TPOT, E2E and output tok/s compare it"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``infer bench`` options."""
    p.add_argument(
        "--systems",
        type=_names,
        help=f"comma-separated, from: {', '.join(SYSTEMS)} (default: "
        f"{','.join(DEFAULT_SYSTEMS)}; with --url: sequential,url)",
    )
    p.add_argument(
        "--workloads",
        type=_names,
        default=list(DEFAULT_WORKLOADS),
        help=f"comma-separated, from: {', '.join(WORKLOADS)} (default: "
        f"{','.join(DEFAULT_WORKLOADS)})",
    )
    p.add_argument(
        "--scale",
        choices=SCALES,
        default="full",
        help="full: the specified sizes; quick: minutes on 2 cores; smoke: seconds, "
        "checks the pipeline only (default: %(default)s)",
    )
    p.add_argument(
        "--quick", dest="scale", action="store_const", const="quick", help="same as --scale quick"
    )
    p.add_argument(
        "--concurrency", type=_levels, help="sweep levels, e.g. 1,4,16,64 (default: by scale)"
    )
    p.add_argument(
        "--rate",
        type=float,
        help="Poisson arrivals at this many requests/s for W2 and the sweep "
        "(default: all requests offered at once, up to the concurrency)",
    )
    _add_server_arguments(p)
    _add_llama_arguments(p)
    p.add_argument("--model", default="default", help="(default: %(default)s)")
    p.add_argument(
        "--dtype", choices=list(DTYPES), default="bfloat16", help="(default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default: %(default)s)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="report directory (default: the checkout's bench/results)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(command=run_bench)


def _add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the servers measured and of what is sent to them."""
    p.add_argument("--url", help="measure the infer server running here instead of starting one")
    p.add_argument(
        "--api",
        choices=["native", "openai"],
        default="native",
        help="stream dialect of --url: /v1/generate or /v1/completions",
    )
    p.add_argument(
        "--predictions",
        action="store_true",
        help="send --url each request's prediction (the edit load's file), as "
        "infer-prediction does",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra `infer serve` argument for the servers started, e.g. "
        "--server-arg=--max-batch-size=32 (repeatable)",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="torch threads for every system, servers included (default: torch's, "
        "one per core; 1 is steadier on a machine others are using)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature sent to every server (default: 0, greedy; the "
        "in-process baselines stay greedy)",
    )
    p.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="top-p sent to every server with --temperature (default: 1, none)",
    )


def _add_llama_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of llama.cpp's speculative systems."""
    p.add_argument(
        "--llama-spec",
        action="append",
        metavar="FLAGS",
        help="llama-server flags of llama.cpp-ngram, in one string (--llama-spec='...'); "
        "repeated, each setting is its own system (llama.cpp-ngram, llama.cpp-ngram-2, ...) "
        f"(default: '{LLAMA_NGRAM_FLAGS}')",
    )
    p.add_argument(
        "--llama-draft",
        action="append",
        metavar="FLAGS",
        help="llama-server flags of llama.cpp-draft besides its draft model, likewise "
        f"(default: '{LLAMA_DRAFT_FLAGS}')",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """``python bench/bench_serving.py``: the same as ``infer bench``."""
    parser = argparse.ArgumentParser(prog="bench_serving.py", description=__doc__)
    add_arguments(parser)
    return run_bench(parser.parse_args(argv))


def run_bench(args: argparse.Namespace) -> int:
    """Run the benchmark; return 0, or 1 when a request failed or an infer server did not run.

    Raises:
        ValueError: Unknown systems or workloads, or matplotlib is missing (checked before
            anything runs, not when the charts are drawn at the end).
    """
    systems = _systems(args)
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("infer bench draws its charts with matplotlib: pip install matplotlib")
    if args.threads:
        torch.set_num_threads(args.threads)  # the servers get --num-threads
    if "fim" in args.workloads:
        _run_fim(args, systems)
    if "assistant" in args.workloads:
        _run_assistant(args, systems)
    args.workloads = [w for w in args.workloads if w not in ("fim", "assistant")]
    if not args.workloads:
        return 0
    loaded = load_model(args.model, DTYPES[args.dtype], kind=ModelKind.GENERATE)
    workloads = build_workloads(
        loaded.tokenizer, args.workloads, args.scale, args.seed, args.concurrency, args.rate
    )
    settings = _settings(args, loaded, workloads)
    systems = _with_variants(systems, settings.llama_flags)
    meta = _meta(args, loaded.name)
    scale = SCALE_SIZES[args.scale]
    meta["forward_step_context"] = context = scale.w1_prompt + scale.w1_new // 2  # mid-W1
    # Measured before and after everything else; other load only ever adds time, so the
    # smaller of the two is the better estimate of the step itself.
    samples = [forward_step_ms(loaded, context)]
    runs, unavailable = _run_systems(args, systems, settings, workloads, meta)
    samples.append(forward_step_ms(loaded, context))
    meta["forward_step_samples_ms"], meta["forward_step_ms"] = samples, min(samples)
    meta["notes"] = [TOKEN_COUNT_NOTE, *settings.notes]
    meta["startup_s"] = settings.startup_s
    meta["rss_mb"] = settings.rss_mb
    meta["llama_flags"] = {s: f for s, f in settings.llama_flags.items() if s in systems}
    if any("drafts" in r for r in runs):
        meta["notes"].append(DRAFTS_NOTE)
    if any(_speculated(r) for r in runs):
        meta["notes"].append(BURSTS_NOTE)
    add_ratios(runs)
    bandwidth.add_shares(runs, meta["bandwidth"], reads_gguf, _speculated)
    report: Report = {
        "meta": meta,
        "workloads": _describe(workloads),
        "runs": runs,
        "unavailable": unavailable,
    }
    report["goals"] = goals(runs, meta["forward_step_ms"])
    _write(report, args.out)
    failed = any(r["metrics"]["errors"] for r in runs) or any(
        _variant_of(u["system"]) not in OPTIONAL_SYSTEMS for u in unavailable
    )
    return 1 if failed else 0


def _run_fim(args: argparse.Namespace, systems: list[str]) -> None:
    """The code-completion load on the systems that answer ``/infill``; its report beside
    the others (``<date>-<host>-fim-<model>.json`` and ``.md``)."""
    from infer.bench import fim

    chosen = [s for s in systems if s in fim.SYSTEMS] if args.systems else list(fim.SYSTEMS)
    if not chosen:
        raise ValueError(f"the fim load runs on {', '.join(fim.SYSTEMS)}")
    threads = args.threads or torch.get_num_threads()
    report = fim.run(
        args.model,
        _gguf(args.model),
        chosen,
        args.scale,
        args.seed,
        threads,
        args.temperature,
        args.top_p,
    )
    meta = _meta(args, args.model)
    report["meta"] = {k: meta[k] for k in ("date", "host", "cpu", "scale") if k in meta}
    _write_side_report(
        args, report, f"{report_stem(meta)}-fim-{_safe(args.model)}", fim.table(report)
    )


def _run_assistant(args: argparse.Namespace, systems: list[str]) -> None:
    """The three-model load on infer and on llama.cpp's three processes; its report beside
    the others (``<date>-<host>-assistant.json`` and ``.md``)."""
    from infer.bench import assistant

    chosen = ["infer" if s.startswith("infer") else s for s in systems if s in _ASSISTANT]
    chosen = list(dict.fromkeys(chosen)) if args.systems else ["infer", "llama.cpp"]
    threads = args.threads or torch.get_num_threads()
    report = assistant.run(chosen, args.scale, args.seed, threads)
    meta = _meta(args, "assistant")
    report["meta"] = {k: meta[k] for k in ("date", "host", "cpu", "scale") if k in meta}
    _write_side_report(args, report, f"{report_stem(meta)}-assistant", assistant.table(report))


_ASSISTANT = ("infer-continuous", "infer-nospec", "llama.cpp")


def _write_side_report(
    args: argparse.Namespace, report: dict[str, Any], stem: str, text: str
) -> None:
    out = args.out if args.out is not None else default_results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    text = f"{text}\n\nCPU: {report['meta'].get('cpu')}\n"
    (out / f"{stem}.md").write_text(text)
    print(text)


def _settings(args: argparse.Namespace, loaded: LoadedModel, workloads: list[Workload]) -> Settings:
    """What every system is run with: the model, the servers' flags, the sampling."""
    settings = Settings(
        loaded, args.model, args.dtype, args.seed, args.url, args.api, args.server_arg, args.threads
    )
    settings.predictions = args.predictions
    settings.longest = max(
        (len(r.prompt_ids) + r.max_new_tokens for w in workloads for r in w.requests), default=0
    )
    settings.llama_flags = {
        **llama_variants("llama.cpp-ngram", args.llama_spec or [LLAMA_NGRAM_FLAGS]),
        **llama_variants("llama.cpp-draft", args.llama_draft or [LLAMA_DRAFT_FLAGS]),
    }
    if args.temperature > 0:
        # As a chat client samples: a request ends at EOS (or its token limit).
        settings.sampling = {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "ignore_eos": False,
        }
        settings.notes.append(
            f"Sampled: every server request asks for temperature {args.temperature:g} and "
            f"top_p {args.top_p:g} (no seed) and ends at EOS, so requests may be *short*; "
            "the in-process baselines decode greedily"
        )
    return settings


def _run_systems(
    args: argparse.Namespace,
    systems: list[str],
    settings: Settings,
    workloads: list[Workload],
    meta: dict[str, Any],
) -> tuple[list[Run], list[dict[str, str]]]:
    """Every system's runs beside the bandwidth probe, and the systems that could not run."""
    probe_bytes = SMOKE_PROBE_BYTES if args.scale == "smoke" else bandwidth.probe_bytes()
    threads = args.threads or torch.get_num_threads()
    runs: list[Run] = []
    unavailable: list[dict[str, str]] = []
    with bandwidth.Probe(threads, probe_bytes) as probe:
        meta["bandwidth"] = bandwidth.measure(_gguf(args.model), probe)
        if args.model == "default":
            meta["bandwidth"]["notes"] = [DEFAULT_BYTES_NOTE]
        counted = meta["bandwidth"]["bytes_per_token"] is not None
        for system in systems:
            # W1 between two readings of the probe, where it becomes a share of them
            around = probe if counted and reads_gguf(system) else None
            try:
                runs += _measure(system, settings, workloads, args.no_progress, around)
            except (Unavailable, ServerError) as e:
                unavailable.append({"system": system, "reason": str(e)})
    return runs, unavailable


def _write(report: Report, out: Path | None) -> None:
    """Write the report's files and print its tables."""
    out_dir = out if out is not None else default_results_dir()
    paths = write_report(report, out_dir, report_stem(report["meta"]))
    print(tables(report))
    print(bandwidth_table(report))
    print(goals_table(report))
    for u in report["unavailable"]:
        print(f"not measured: {u['system']}: {u['reason']}")
    print("report: " + ", ".join(str(p) for p in paths.values()))


def _speculated(run: Run) -> bool:
    """Whether a run's tokens may have come several a step (drafts kept)."""
    drafts = run.get("drafts") or {}
    return bool(drafts.get("accepted")) or _variant_of(run["system"]) in LLAMA_SPECULATIVE


def _with_variants(systems: list[str], llama_flags: dict[str, str]) -> list[str]:
    """``systems``, each speculative llama.cpp one replaced by the names of its settings."""
    return [
        name
        for system in systems
        for name in (
            [v for v in llama_flags if _variant_of(v) == system]
            if system in LLAMA_SPECULATIVE
            else [system]
        )
    ]


def _variant_of(system: str) -> str:
    """The system a speculative llama.cpp setting's name stands for (``llama.cpp-ngram-2``:
    ``llama.cpp-ngram``); any other name as it is."""
    base = re.sub(r"-\d+$", "", system)
    return base if base in LLAMA_SPECULATIVE else system


def _measure(
    system: str,
    settings: Settings,
    workloads: list[Workload],
    quiet: bool,
    probe: bandwidth.Probe | None = None,
) -> list[Run]:
    """Each workload on ``system``; W1 between two readings of ``probe`` when there is one."""
    runs: list[Run] = []
    if not quiet:
        tqdm.write(f"{system}: setting up", file=sys.stderr)
    with open_system(system, settings) as measure:
        warm_up(measure, settings)
        for workload in workloads:
            serial = system in SERIAL
            if serial and workload.name == "sweep" and any(r["workload"] == "sweep" for r in runs):
                continue  # one request at a time: every concurrency level is the same run
            label = workload.name
            if workload.name == "sweep":
                label += f" c={workload.concurrency}"
            with tqdm(
                total=len(workload.requests),
                desc=f"{system:>16} {label:<10}",
                unit="req",
                disable=True if quiet else None,
                leave=False,
                file=sys.stderr,
            ) as bar:
                around = probe if workload.name == "W1" else None
                results, probes = bandwidth.bracket(
                    around, partial(measure, workload, lambda r: bar.update())
                )
            run: Run = {
                "system": system,
                "workload": workload.name,
                "concurrency": 1 if serial else workload.concurrency,
                "rate": workload.rate,
                "serial": serial,
                "metrics": summarize(results, workload.follow_ups),
            }
            if probes:
                run["probes_gb_s"] = probes
            drafts = settings.drafts.pop(system, None)
            if drafts is not None:
                run["drafts"] = drafts | {"acceptance": _share(drafts)}
            runs.append(run)
    return runs


def _share(drafts: dict[str, int]) -> float | None:
    """Accepted draft tokens over drafted ones (``None`` when none were drafted)."""
    return round(drafts["accepted"] / drafts["drafted"], 4) if drafts["drafted"] else None


def add_ratios(runs: list[Run]) -> None:
    """Each run's output tok/s over the sequential baseline's on the same workload, and,
    when vLLM was measured, its output tok/s and TTFT p95 over vLLM's on the same workload
    and concurrency (``ratio_vs_vllm``; ``None`` where vLLM has no such run)."""
    base = {
        r["workload"]: r["metrics"]["output_tok_s"] for r in runs if r["system"] == "sequential"
    }
    peer = {(r["workload"], r["concurrency"]): r["metrics"] for r in runs if r["system"] == PEER}
    for run in runs:
        rate, ref = run["metrics"]["output_tok_s"], base.get(run["workload"])
        run["ratio_vs_sequential"] = _ratio(rate, ref)
        if peer:
            run["ratio_vs_vllm"] = vllm_ratio(
                run["metrics"], peer.get((run["workload"], run["concurrency"]))
            )


def vllm_ratio(metrics: dict[str, Any], peer: dict[str, Any] | None) -> dict[str, Any] | None:
    """``output_tok_s`` (higher is better) and ``ttft_p95`` (lower is better) of a run over
    vLLM's on the same load; ``None`` without a vLLM run."""
    if peer is None:
        return None
    return {
        "output_tok_s": _ratio(metrics["output_tok_s"], peer["output_tok_s"]),
        "ttft_p95": _ratio(metrics["ttft_ms"]["p95"], peer["ttft_ms"]["p95"]),
    }


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def goals(runs: list[Run], forward_ms: float | None) -> list[dict[str, Any]]:
    """The serving goals for this machine, each with what was measured."""

    def tok_s(system: str) -> float | None:
        return _metric(runs, system, "W2", "output_tok_s")

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    itl = _metric(runs, "infer-continuous", "W1", "itl_ms")
    measured = [
        (
            "W2 output tok/s, continuous ÷ sequential generate()",
            "≥ 3×",
            3.0,
            False,
            ratio(tok_s("infer-continuous"), tok_s("sequential")),
        ),
        (
            "W1 ITL p50 (continuous server) ÷ raw decode forward",
            "≤ 1.25×",
            1.25,
            True,
            ratio(itl["p50"] if itl else None, forward_ms),
        ),
        (
            "W2 output tok/s, continuous ÷ static",
            "≥ 1.3×",
            1.3,
            False,
            ratio(tok_s("infer-continuous"), tok_s("infer-static")),
        ),
    ]
    return [
        {
            "goal": goal,
            "target": target,
            "value": value,
            "met": None if value is None else (value <= bound if at_most else value >= bound),
        }
        for goal, target, bound, at_most, value in measured
    ]


def report_stem(meta: dict[str, Any]) -> str:
    """``<date>-<host>``, plus ``-<scale>`` below full scale (a quick run keeps a full report)."""
    stem = f"{meta['date'][:10]}-{_safe(meta['host'])}"
    return stem if meta["scale"] == "full" else f"{stem}-{meta['scale']}"


def _metric(runs: list[Run], system: str, workload: str, name: str) -> Any:
    for run in runs:
        if run["system"] == system and run["workload"] == workload:
            return run["metrics"][name]
    return None


def default_results_dir() -> Path:
    """``bench/results`` of the source checkout this package runs from, else of the cwd."""
    checkout = Path(__file__).resolve().parents[2]
    if (checkout / "bench").is_dir() and (checkout / "infer").is_dir():
        return checkout / "bench" / "results"
    return Path("bench") / "results"


def _systems(args: argparse.Namespace) -> list[str]:
    systems = args.systems or (["sequential", URL_SYSTEM] if args.url else list(DEFAULT_SYSTEMS))
    if args.url and URL_SYSTEM not in systems:
        systems.append(URL_SYSTEM)
    unknown = [s for s in systems if s not in (*SYSTEMS, URL_SYSTEM)]
    if unknown or (URL_SYSTEM in systems and not args.url):
        raise ValueError(
            f"unknown systems: {', '.join(unknown) or URL_SYSTEM + ' (needs --url)'}"
            f"; choose from {', '.join(SYSTEMS)}"
        )
    unknown_workloads = set(args.workloads) - set(WORKLOADS)
    if unknown_workloads:
        raise ValueError(f"unknown workloads: {', '.join(sorted(unknown_workloads))}")
    return systems


def _describe(workloads: list[Workload]) -> list[dict[str, Any]]:
    described: dict[str, dict[str, Any]] = {}
    for w in workloads:
        entry = described.setdefault(
            w.name,
            {
                "name": w.name,
                "description": w.description,
                "requests": len(w.requests),
                "output_tokens": w.output_tokens,
                "rate": w.rate,
                "levels": [],
            },
        )
        entry["levels"].append(w.concurrency)
    return list(described.values())


def _meta(args: argparse.Namespace, model_name: str) -> dict[str, Any]:
    now = dt.datetime.now().astimezone()
    return {
        "date": now.isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": args.threads or torch.get_num_threads(),
        "transformers": _version("transformers"),
        "infer": _version("infer"),
        "git_commit": _git("rev-parse", "--short", "HEAD"),
        # Tracked files that differ from that commit (the code measured is not exactly it).
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "model": model_name,
        "dtype": args.dtype,
        "scale": args.scale,
        "seed": args.seed,
        "server_args": args.server_arg,
        "url": args.url,
        "api": args.api if args.url else None,
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def _gguf(model: str) -> Path | None:
    """The GGUF file the systems load for ``model`` (``None``: not a GGUF model)."""
    try:
        return gguf_file(model)
    except LoadError:
        return None


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    """The CPU's model name and, on x86, its family and model (a VM often names only the
    vendor: "AMD EPYC")."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def _git(*args: str) -> str | None:
    """Output of a git command in this package's checkout (None outside one)."""
    try:
        out = subprocess.run(
            ["git", *args],
            capture_output=True,
            text=True,
            cwd=Path(__file__).parent,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _names(text: str) -> list[str]:
    return [t.strip().lower() for t in text.split(",") if t.strip()]


def _levels(text: str) -> list[int]:
    try:
        levels = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return levels


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name) or "host"
