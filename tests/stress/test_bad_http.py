"""Bad HTTP against a real Hypercorn: oversized and malformed bodies. Every case is a 4xx with
a stable code (never a 5xx, never a hang), and the server keeps serving afterwards."""

from __future__ import annotations

import httpx
import trio

from support.server import PROMPT, running_server, wait_for


async def test_413_closes_or_drains_the_connection(tiny_app) -> None:
    """The next request on the same keep-alive client is answered, not left waiting."""
    app = tiny_app(max_body_bytes=4096)
    big = b'{"prompt": "' + b"x" * 10_000_000 + b'"}'
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        r = await client.post(
            "/v1/generate", content=big, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        health = await client.get("/health")
        assert health.status_code == 200
        ok = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 3}
        )
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


async def test_deeply_nested_json_is_a_400(tiny_app) -> None:
    app = tiny_app(max_body_bytes=1_000_000)
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        for path in (
            "/v1/generate",
            "/v1/completions",
            "/v1/chat/completions",
            "/v1/inspect/attention",
        ):
            for body in (b"[" * 100_000, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
                r = await client.post(
                    path, content=body, headers={"Content-Type": "application/json"}
                )
                assert r.status_code == 400, (path, r.text)
                assert r.json()["error"]["code"] == "invalid_json"
        ok = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        )
        assert ok.status_code == 200


async def _raw(port: int, data: bytes, close_write: bool = False) -> bytes:
    """Send raw bytes on a new connection; return what comes back before the server closes
    it (bounded: a server that never answers gives b"")."""
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    with sock:
        try:
            await sock.send(data)
            if close_write:
                sock.shutdown(trio.socket.SHUT_WR)
        except OSError:  # the server may close before it has read everything
            pass
        received = b""
        with trio.move_on_after(30):
            while True:
                try:
                    chunk = await sock.recv(65536)
                except OSError:
                    break
                if not chunk:
                    break
                received += chunk
    return received


def _status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response.startswith(b"HTTP/1.1 ") else 0


async def test_malformed_http_gets_4xx_and_the_server_keeps_serving(tiny_app) -> None:
    app = tiny_app()
    post = b"POST /v1/generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    attacks = {
        "garbage request line": b"\x00\xffGARBAGE \x01\r\n\r\n",
        "200 KB header": b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: "
        + b"a" * 200_000
        + b"\r\n\r\n",
        "negative Content-Length": post + b"Content-Length: -5\r\n\r\n{}",
        "broken chunked encoding": post + b"Transfer-Encoding: chunked\r\n\r\n"
        b"ZZ\r\n{}\r\n0\r\n\r\n",
        "two Content-Lengths": post + b"Content-Length: 2\r\nContent-Length: 9\r\n\r\n{}",
    }
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        port = int(server.url.rsplit(":", 1)[1])
        results = {name: _status(await _raw(port, data)) for name, data in attacks.items()}
        short = await _raw(
            port, post + b'Content-Length: 1000\r\n\r\n{"prompt": "hi"', close_write=True
        )
        health = await client.get("/health")
        ok = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        )
        state = app.extensions["infer"]
        await wait_for(lambda: not state.worker._open and not state.worker._choices)
    assert all(400 <= status < 500 for status in results.values()), results
    assert short == b"" or 400 <= _status(short) < 500  # a body that never came: no answer
    assert health.status_code == 200 and ok.status_code == 200


async def test_stalled_half_headers_do_not_block_health(tiny_app) -> None:
    app = tiny_app()
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=30) as client,
    ):
        port = int(server.url.rsplit(":", 1)[1])
        stalled = []
        try:
            for _ in range(100):
                sock = trio.socket.socket()
                await sock.connect(("127.0.0.1", port))
                await sock.send(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Half: ")
                stalled.append(sock)
            during = [await client.get("/health") for _ in range(5)]
        finally:
            for sock in stalled:
                sock.close()
        after = await client.get("/health")
    assert all(r.status_code == 200 for r in during) and after.status_code == 200
    latencies_ms = [round(r.elapsed.total_seconds() * 1000, 1) for r in [*during, after]]
    print(f"/health with 100 stalled half-header connections: {latencies_ms} ms")
