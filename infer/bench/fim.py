"""The ``fim`` load: one person typing, a code completion asked at several points of each
line, one at a time, through llama.cpp's ``/infill`` as llama.vim asks (the session:
:mod:`infer.bench.typing`).

Each system gets the same requests in the same order: infer, and llama.cpp's
``llama-server`` on the same GGUF file with its cache reuse on (``--cache-reuse 256``), one
slot (one person). What is reported per system: the latency of each completion (the whole
answer, as llama.vim waits for it), how often the ghost text's first line is what the person
typed next, and how many prompt tokens each request read and found cached (as each server
reports them in ``timings``).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from infer.bench.servers import (
    default_llama_server,
    infer_command,
    llama_server_command,
    running_server,
)
from infer.bench.typing import Keystroke, matches, ring, session
from infer.procs import free_port

# Retyped functions per scale (about 25 completions each)
FUNCTIONS = {"full": 12, "quick": 4, "smoke": 1}
SYSTEMS = ("infer-continuous", "llama.cpp")  # the systems that answer /infill
LLAMA_CTX = 8192  # one slot: the session's longest prompt (extra files, prefix, suffix) fits
LLAMA_FLAGS = ("--cache-reuse", "256")
GREEDY = {"temperature": 0.0, "samplers": ["temperature"]}
SMOKE_REQUESTS = 6  # smoke checks the pipeline only


@dataclass
class Completion:
    """One completion as a system answered it."""

    where: str
    latency_ms: float
    prompt_n: int
    cache_n: int
    predicted_n: int
    first_line_typed: bool
    content: str


def sampling(temperature: float, top_p: float) -> dict[str, Any]:
    """What every request sends about sampling (the same to every system): greedy, or a
    seeded sample with llama.vim's top-k and the given top-p."""
    if temperature <= 0:
        return dict(GREEDY)
    return {
        "temperature": temperature,
        "top_k": 40,
        "top_p": top_p,
        "seed": 1,
        "samplers": ["top_k", "top_p", "temperature"],
    }


def replay(
    url: str,
    keystrokes: list[Keystroke],
    extra: list[dict[str, str]],
    sampled: dict[str, Any],
    model: str = "",
    period_s: float = 0.0,
) -> list[Completion]:
    """Ask every keystroke's completion of the server at ``url``, one after the other (of
    ``model``; "": the server's default, as llama.vim sends it), each at least ``period_s``
    after the one before (a person's pace; 0: at once)."""
    done, started = [], -period_s
    with httpx.Client(base_url=url, timeout=600.0) as client:
        for k in keystrokes:
            time.sleep(max(0.0, started + period_s - time.perf_counter()))
            body = k.body(extra, sampled) | {"model": model}
            started = time.perf_counter()
            response = client.post("/infill", json=body)
            took = (time.perf_counter() - started) * 1000
            response.raise_for_status()
            answer = response.json()
            done.append(
                Completion(
                    k.where,
                    round(took, 1),
                    int(answer.get("timings/prompt_n", 0)),
                    int(answer.get("tokens_cached", 0)) - int(answer.get("timings/prompt_n", 0)),
                    int(answer.get("timings/predicted_n", 0)),
                    matches(k, str(answer["content"])),
                    str(answer["content"]),
                )
            )
    return done


def summary(completions: list[Completion]) -> dict[str, Any]:
    """Latency percentiles (of every request, and of those after the first in each file:
    the first reads the file's whole prompt), the first-line match rate and the mean tokens
    read per request."""
    latencies = sorted(c.latency_ms for c in completions)
    files = [c.where.split(":")[0] for c in completions]
    later = sorted(c.latency_ms for i, c in enumerate(completions) if files[i] in files[:i])
    return {
        "requests": len(completions),
        "p50_ms": round(statistics.median(latencies), 1),
        "p95_ms": _p95(latencies),
        "p95_in_file_ms": _p95(later) if later else None,
        "first_line_typed": round(
            sum(c.first_line_typed for c in completions) / len(completions), 3
        ),
        "prompt_read_mean": round(statistics.mean(c.prompt_n for c in completions), 1),
        "predicted_mean": round(statistics.mean(c.predicted_n for c in completions), 1),
    }


def _p95(ordered: list[float]) -> float:
    return round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 1)


@contextmanager
def server(system: str, model: str, gguf: Path | None, threads: int) -> Iterator[str]:
    """Start ``system`` on ``model`` and yield its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if system == "llama.cpp":
        binary = default_llama_server()
        if gguf is None or not binary.is_file():
            raise FileNotFoundError("llama.cpp needs its llama-server (make peers) and a GGUF")
        command = [*llama_server_command(binary, port, gguf, threads, 1, LLAMA_CTX), *LLAMA_FLAGS]
    else:
        command = infer_command(
            port, "continuous", model, "bfloat16", ["--num-threads", str(threads)]
        )
    with running_server(command, url, "/health", timeout_s=900):
        yield url


def run(
    model: str,
    gguf: Path | None,
    systems: list[str],
    scale: str,
    seed: int,
    threads: int,
    temperature: float = 0.0,
    top_p: float = 0.9,
) -> dict[str, Any]:
    """Replay one typing session on each system; each one's summary and completions."""
    keystrokes = session(FUNCTIONS[scale], seed=seed)[
        : SMOKE_REQUESTS if scale == "smoke" else None
    ]
    extra = ring(seed)
    sampled = sampling(temperature, top_p)
    report: dict[str, Any] = {"model": model, "sampling": sampled, "systems": {}}
    for system in systems:
        with server(system, model, gguf, threads) as url:
            replay(url, keystrokes[:1], extra, sampled)  # its first load: kernels, vocabulary
            completions = replay(url, keystrokes, extra, sampled)
        report["systems"][system] = {
            "summary": summary(completions),
            "completions": [asdict(c) for c in completions],
        }
    return report


def table(report: dict[str, Any]) -> str:
    """The report's summary as a Markdown table, with each system's ratio to llama.cpp."""
    rows = report["systems"]
    peer = rows.get("llama.cpp", {}).get("summary")
    lines = [
        f"fim load, {report['model']}, {json.dumps(report['sampling'])}",
        "",
        "| system | requests | p50 ms | p95 ms | p95 after a file's first | p50 vs llama.cpp "
        "| first line typed | prompt tokens read (mean) | tokens predicted (mean) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for system, row in rows.items():
        s = row["summary"]
        ratio = f"{s['p50_ms'] / peer['p50_ms']:.2f}x" if peer and peer["p50_ms"] else "-"
        in_file = f"{s['p95_in_file_ms']:.0f}" if s.get("p95_in_file_ms") else "-"
        lines.append(
            f"| {system} | {s['requests']} | {s['p50_ms']:.0f} | {s['p95_ms']:.0f} | {in_file} "
            f"| {ratio} "
            f"| {100 * s['first_line_typed']:.1f}% | {s['prompt_read_mean']:.0f} "
            f"| {s['predicted_mean']:.1f} |"
        )
    return "\n".join(lines)
