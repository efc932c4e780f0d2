"""Throughput of 64 concurrent chat requests against one server URL: to compare one replica
with several behind a gateway (SGLang Model Gateway refuses token-id prompts, which
``infer bench`` sends, so this client sends text).

    .venv/bin/infer serve --port 8201 --max-batch-size 64 &
    .venv/bin/python bench/replicas.py http://127.0.0.1:8201
    .venv/bin/infer cluster --replicas 2 --port 8202 -- --max-batch-size 64 &
    .venv/bin/python bench/replicas.py http://127.0.0.1:8202
"""

from __future__ import annotations

import sys
import time

import httpx
import trio

TOPICS = ["rivers", "volcanoes", "bread", "chess", "bees", "trains", "comets", "tea"]
REQUESTS = 64


async def _one(client: httpx.AsyncClient, i: int, out: list[int]) -> None:
    content = f"Write a short note about {TOPICS[i % len(TOPICS)]} for reader number {i}."
    body = {
        "model": "default",
        "max_tokens": 128,
        "ignore_eos": True,
        "temperature": 0.7,
        "seed": i,
        "messages": [{"role": "user", "content": content}],
    }
    r = await client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    out.append(r.json()["usage"]["completion_tokens"])


async def main(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await _one(client, 999, [])  # warm up
        for rnd in range(2):
            out: list[int] = []
            start = time.perf_counter()
            async with trio.open_nursery() as nursery:
                for i in range(REQUESTS):
                    nursery.start_soon(_one, client, i + 100 * rnd, out)
            elapsed = time.perf_counter() - start
            print(
                f"{url}: {REQUESTS} chats, {sum(out)} tokens in {elapsed:.1f} s = "
                f"{sum(out) / elapsed:.0f} tok/s"
            )


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
