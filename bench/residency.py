"""Three models in one server against each in a server of its own: resident memory, and how
long a model that is not loaded takes to give its first answer.

    python bench/residency.py [--threads 2]

For each of the assistant's models (the 0.5B for completion, the 1.5B for chat, MiniLM for
embeddings), alone: ``infer serve --model M``'s time to ready, its first answer's time and its
RSS after that answer. Then one ``infer serve`` with all three (the first loaded at start,
the others on demand): each other model's first answer, timed from the request (it loads the
model), and the RSS once all three have answered. Prints one table.
"""

from __future__ import annotations

import argparse
import time

import httpx

from infer.bench.servers import infer_command, running_server
from infer.procs import free_port

MODELS = {
    "complete": "qwen2.5-coder-0.5b",
    "chat": "qwen2.5-coder-1.5b",
    "embed": "all-minilm-l6-v2",
}


def first_answer(url: str, name: str) -> float:
    """Seconds for the first request that names model ``name`` (an embedding or 8 tokens)."""
    started = time.monotonic()
    if name == "embed":
        body = {"model": name, "input": "def add(a, b):\n    return a + b"}
        httpx.post(f"{url}/v1/embeddings", json=body, timeout=900).raise_for_status()
    else:
        body = {"model": name, "prompt": "def fib(n):", "max_tokens": 8, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=900).raise_for_status()
    return time.monotonic() - started


def command(port: int, models: dict[str, str], threads: int) -> list[str]:
    flags = [f for name, source in models.items() for f in ("--model", f"{name}={source}")]
    cmd = infer_command(
        port, "continuous", "default", "bfloat16", [*flags, "--num-threads", str(threads)]
    )
    at = cmd.index("--model")
    del cmd[at : at + 2]  # the models above name themselves
    return cmd


def alone(name: str, source: str, threads: int) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_server(command(port, {name: source}, threads), url, "/health", timeout_s=900) as s:
        answer = first_answer(url, name)
        return {"ready_s": s.startup_s, "first_s": answer, "rss_mb": s.rss_mb()}


def together(threads: int) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out: dict[str, float] = {}
    with running_server(command(port, MODELS, threads), url, "/health", timeout_s=900) as s:
        out["ready_s"] = s.startup_s
        for name in MODELS:
            out[f"{name}_first_s"] = first_answer(url, name)
        out["rss_mb"] = s.rss_mb()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    single = {name: alone(name, source, args.threads) for name, source in MODELS.items()}
    shared = together(args.threads)
    print("| model | alone: ready s | first answer s | RSS MB | in one server: first answer s |")
    print("|---|---|---|---|---|")
    for name, source in MODELS.items():
        r = single[name]
        print(
            f"| {source} | {r['ready_s']:.1f} | {r['first_s']:.2f} | {r['rss_mb']:.0f} "
            f"| {shared[f'{name}_first_s']:.2f} |"
        )
    total = sum(r["rss_mb"] for r in single.values())
    print(
        f"\nRSS: three alone {total:.0f} MB; one server of three {shared['rss_mb']:.0f} MB "
        f"({shared['rss_mb'] / total:.2f}x); that server ready in {shared['ready_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
