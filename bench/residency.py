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

from infer.bench.assistant import CHAT, COMPLETE, EMBED, serve_models
from infer.bench.servers import running_server
from infer.procs import free_port

MODELS = {"complete": COMPLETE, "chat": CHAT, "embed": EMBED}


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


def alone(name: str, source: str, threads: int) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = serve_models(port, {name: source}, threads)
    with running_server(command, url, "/health", timeout_s=900) as s:
        answer = first_answer(url, name)
        return {"ready_s": s.startup_s, "first_s": answer, "rss_mb": s.rss_mb()}


def together(threads: int) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out: dict[str, float] = {}
    with running_server(serve_models(port, MODELS, threads), url, "/health", timeout_s=900) as s:
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
