"""Two replicas behind a real SGLang Model Gateway (``sglang-router``), under 64 streams.

The gateway probes each replica (``/health``, HTTP/2 with prior knowledge, its own info
routes), adds its sampling extras to every body, and then carries the load. A replica of
this server once died at the gateway's first contact.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from support.server import PROMPT, metrics, running_server, wait_for

STREAMS = 64
GATEWAY = Path(sys.executable).with_name("sglang-router")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _chat(client: httpx.AsyncClient, i: int, texts: list[str]) -> None:
    body = {
        "model": "tiny",
        "stream": True,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": f"{PROMPT} ({i})"}],
    }
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        texts.append("".join([chunk async for chunk in r.aiter_text()]))


async def _gateway_ready(client: httpx.AsyncClient) -> bool:
    try:
        r = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1}
        )
    except httpx.TransportError:
        return False
    return r.status_code == 200


async def test_two_replicas_behind_the_gateway_carry_64_streams(tiny_app) -> None:
    port, prometheus = _free_port(), _free_port()
    async with (
        running_server(tiny_app(engine={"max_batch_size": 32})) as one,
        running_server(tiny_app(engine={"max_batch_size": 32})) as two,
    ):
        gateway = subprocess.Popen(
            [
                str(GATEWAY),
                "launch",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--worker-urls",
                one.url,
                two.url,
                "--policy",
                "cache_aware",
                "--prometheus-port",
                str(prometheus),
                "--log-level",
                "warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            async with httpx.AsyncClient(
                base_url=f"http://127.0.0.1:{port}", timeout=120
            ) as client:
                await wait_for(lambda: _gateway_ready(client), timeout_s=120, poll_s=0.5)
                models = (await client.get("/v1/models")).json()
                texts: list[str] = []
                async with trio.open_nursery() as nursery:
                    for i in range(STREAMS):
                        nursery.start_soon(_chat, client, i, texts)
        finally:
            gateway.terminate()
            await trio.to_thread.run_sync(gateway.wait, 30)
        served = []
        for server in (one, two):
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                assert (await client.get("/health")).status_code == 200
                stats = await metrics(client)
                served.append(stats['infer_requests_total{finish_reason="length"}'])
    assert "tiny" in [m["id"] for m in models["data"]]  # the workers' name, not "unknown"
    assert len(texts) == STREAMS
    for text in texts:
        assert text.endswith("data: [DONE]\n\n") and text.count("data: [DONE]") == 1
        assert text.count('"finish_reason":"length"') == 1
    assert sum(served) == STREAMS + 1  # every stream, and the probe that found it ready
