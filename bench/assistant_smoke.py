"""A smoke check of the core scheduler's priorities: two models on one server, one busy with
long answers, the other answering short requests (what a completion model sees).

    python bench/assistant_smoke.py [--streams 8] [--tokens 192] [--requests 12]
    python bench/assistant_smoke.py --complete qwen2.5-coder-0.5b   # code completions (FIM)

Runs the same load twice on one in-process server of two engines (SmolLM2 for the long
answers, SmolLM2 or a FIM model for the short requests: a code completion's every step is
latency-bound, a plain completion's first only): with the cores
granted latency-bound steps first (as served), and granted in arrival order (every step
counted throughput-bound). Prints each short request's latency (p50, max) and the long
answers' tokens per second. Not the benchmark: the lead's ``assistant`` load is.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from functools import partial

import httpx
import trio
from hypercorn.config import Config as HypercornConfig

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.server.app import create_app, drain
from infer.server.config import ServerConfig
from infer.server.serve import serve


@contextmanager
def arrival_order() -> Iterator[None]:
    """Every step counts as throughput-bound: the cores go in arrival order."""
    latency_work = Engine.has_latency_work
    Engine.has_latency_work = lambda self: False  # type: ignore[method-assign]
    try:
        yield
    finally:
        Engine.has_latency_work = latency_work  # type: ignore[method-assign]


async def load(
    url: str, streams: int, tokens: int, requests: int, fim: bool
) -> tuple[list[float], float]:
    """The short requests' latencies, and the long answers' tokens per second."""
    long_body = {"model": "chat", "prompt": "Tell me a long story.", "max_tokens": tokens}
    long_body |= {"temperature": 0.8, "ignore_eos": True}
    short_body = {"model": "complete", "prompt": "def add(a, b):", "max_tokens": 8}
    short_body |= {"temperature": 0, "ignore_eos": True}
    if fim:  # a code completion: fill in the middle
        short_body |= {"suffix": "\n\nprint(add(1, 2))\n"}
    latencies: list[float] = []
    long_end = 0.0

    async def long_answer() -> None:
        nonlocal long_end
        (await client.post("/v1/generate", json=long_body)).raise_for_status()
        long_end = max(long_end, time.perf_counter())

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(streams):
                nursery.start_soon(long_answer)
            await trio.sleep(1.0)  # the long answers are decoding
            for _ in range(requests):
                sent = time.perf_counter()
                r = await client.post("/v1/completions", json=short_body)
                r.raise_for_status()
                latencies.append(time.perf_counter() - sent)
                await trio.sleep(0.2)  # a person typing
    return latencies, streams * tokens / (long_end - start)


async def main(args: argparse.Namespace) -> None:
    engine = EngineConfig(max_seq_len=1024, max_batch_size=16, kv_cache_gb=0.2)
    config = ServerConfig(models=("chat=default", f"complete={args.complete}"), engine=engine)
    app = create_app(config)
    hyper = HypercornConfig()
    hyper.bind = ["127.0.0.1:0"]
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        serving = partial(serve, app, hyper, shutdown_trigger=stop.wait, drain=partial(drain, app))
        [url] = await nursery.start(serving)
        async with httpx.AsyncClient(base_url=url) as client:  # both loaded before timing
            for model in ("chat", "complete"):
                body = {"model": model, "prompt": "x", "max_tokens": 1}
                while (await client.post("/v1/completions", json=body)).status_code != 200:
                    await trio.sleep(0.5)
        print("| cores granted | short p50 ms | short max ms | long answers tok/s |")
        print("|---|---|---|---|")
        modes = (("latency first", nullcontext()), ("arrival order", arrival_order()))
        for name, mode in modes:
            with mode:
                fim = args.complete != "default"
                lat, tok_s = await load(url, args.streams, args.tokens, args.requests, fim)
            p50, top = statistics.median(lat) * 1e3, max(lat) * 1e3
            print(f"| {name} | {p50:.0f} | {top:.0f} | {tok_s:.1f} |")
        stop.set()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=192)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--complete", default="default", help="the short requests' model")
    trio.run(main, parser.parse_args())
