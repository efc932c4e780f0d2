"""Bad HTTP against a real Hypercorn: oversized and malformed bodies. Every case is a 4xx with
a stable code (never a 5xx, never a hang), and the server keeps serving afterwards."""

from __future__ import annotations

import httpx

from infer.server.testing import running_server

PROMPT = "The quick brown fox jumps over the lazy dog"


async def test_413_closes_or_drains_the_connection(tiny_app) -> None:
    """The next request on the same keep-alive client is answered, not left waiting."""
    app = tiny_app(max_body_bytes=4096)
    big = b'{"prompt": "' + b"x" * 10_000_000 + b'"}'
    async with running_server(app) as server, httpx.AsyncClient(
            base_url=server.url, timeout=30) as client:
        r = await client.post("/v1/generate", content=big,
                              headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        health = await client.get("/health")
        assert health.status_code == 200
        ok = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


async def test_deeply_nested_json_is_a_400(tiny_app) -> None:
    app = tiny_app(max_body_bytes=1_000_000)
    async with running_server(app) as server, httpx.AsyncClient(
            base_url=server.url, timeout=30) as client:
        for path in ("/v1/generate", "/v1/completions", "/v1/chat/completions",
                     "/v1/inspect/attention"):
            for body in (b"[" * 100_000, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
                r = await client.post(path, content=body,
                                      headers={"Content-Type": "application/json"})
                assert r.status_code == 400, (path, r.text)
                assert r.json()["error"]["code"] == "invalid_json"
        ok = await client.post("/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 2})
        assert ok.status_code == 200
