"""A burst of clients that give up early must never stop the server for everyone else."""

from __future__ import annotations

import httpx
import trio

from support.server import PROMPT, running_server


async def _give_up_after(client: httpx.AsyncClient, path: str, body: dict, wait_s: float) -> None:
    with trio.move_on_after(wait_s):
        async with client.stream("POST", path, json=body) as r:
            async for _ in r.aiter_bytes():
                pass


async def _close_after_headers(client: httpx.AsyncClient, path: str, body: dict) -> None:
    async with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200  # leave without reading: httpx closes the connection


async def test_disconnect_burst_keeps_the_server_serving(tiny_app) -> None:
    app = tiny_app(engine={"max_batch_size": 4, "max_waiting_requests": 64})
    body = {"prompt": PROMPT, "max_tokens": 300, "temperature": 0}
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 300,
        "stream": True,
    }
    routes = [
        ("/v1/generate", body),
        ("/v1/completions", body | {"model": "tiny", "stream": True}),
        ("/v1/chat/completions", chat),
    ]
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        async with trio.open_nursery() as nursery:
            for i in range(12):
                path, b = routes[i % 3]
                nursery.start_soon(_give_up_after, client, path, b, 0.05 + 0.025 * i)
        async with trio.open_nursery() as nursery:
            for i in range(12):
                path, b = routes[i % 3]
                nursery.start_soon(_close_after_headers, client, path, b)
        await trio.sleep(1.5)  # let the server see every disconnect
        health = await client.get("/health")
        after = await client.post("/v1/completions", json=body | {"model": "tiny", "max_tokens": 5})
    assert health.status_code == 200 and health.json()["status"] == "ready"
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 5
