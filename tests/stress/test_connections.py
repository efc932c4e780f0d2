"""No connection, however it behaves, may end the server or disturb another client.

Streams run concurrently over HTTP/1.1 and h2c (HTTP/2 without TLS, as gateways speak it)
while other clients half-close, reset streams, ping, send GOAWAY or garbage, and vanish.
The well-behaved clients must each see a complete stream with exactly one terminal event,
and the server must keep serving with nothing left running.
"""

from __future__ import annotations

import json
import random

import h2.config
import h2.connection
import h2.events
import httpx
import trio
import trio.testing
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData
from hypercorn.trio.worker_context import WorkerContext

from infer.server.serve import Connection
from support.server import (
    PROMPT,
    Stream,
    metrics,
    native,
    read_stream,
    running_server,
    wait_for,
)

ROUNDS = 10
# GOAWAY mid-stream is how the gateway's probe ended the server: it comes most often.
H2_WAYS = ("half-close", "reset", "ping", "goaway", "goaway", "goaway", "vanish")
BODY = json.dumps(native(48, ignore_eos=True)).encode()


def _h2_request(conn: h2.connection.H2Connection, port: int, body: bytes) -> int:
    stream_id = conn.get_next_available_stream_id()
    conn.send_headers(
        stream_id,
        [
            (":method", "POST"),
            (":path", "/v1/generate"),
            (":scheme", "http"),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
        ],
    )
    conn.send_data(stream_id, body, end_stream=True)
    return stream_id


async def _h2_misbehave(port: int, how: str, rng: random.Random) -> None:
    """Open a few h2c streams, read a little, then misbehave in way ``how``."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    ids = [_h2_request(conn, port, BODY) for _ in range(rng.randint(1, 12))]
    try:
        await stream.send_all(conn.data_to_send())
        frames, ended = 0, set()
        with trio.move_on_after(30):
            target = rng.randint(1, 40)
            # (streams that end before `target` frames leave the connection open: done)
            while frames < target and len(ended) < len(ids):
                data = await stream.receive_some(65536)
                if not data:
                    return
                for event in conn.receive_data(data):
                    if isinstance(event, h2.events.DataReceived):
                        conn.acknowledge_received_data(
                            event.flow_controlled_length, event.stream_id
                        )
                        frames += 1
                    elif isinstance(event, h2.events.StreamEnded | h2.events.StreamReset):
                        ended.add(event.stream_id)
                if how == "ping":
                    conn.ping(rng.randbytes(8))
                await stream.send_all(conn.data_to_send())
        if how == "reset":
            for stream_id in ids:
                conn.reset_stream(stream_id)
        elif how == "goaway":
            conn.close_connection()
        if conn.data_to_send():
            await stream.send_all(conn.data_to_send())
        if how in ("half-close", "goaway"):
            await stream.send_eof()
            with trio.move_on_after(rng.random() * 0.2):
                while await stream.receive_some(65536):
                    pass
    except (trio.BrokenResourceError, trio.ClosedResourceError, h2.exceptions.ProtocolError):
        pass  # the server closed first
    finally:
        await stream.aclose()


async def _h1_misbehave(port: int, how: str, rng: random.Random) -> None:
    """Start an HTTP/1.1 stream, then half-close, send garbage or vanish part-way."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    head = (
        f"POST /v1/generate HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode()
    try:
        await stream.send_all(head + BODY)
        with trio.move_on_after(rng.random() * 0.3):
            await stream.receive_some(65536)
        if how == "half-close":
            await stream.send_eof()
        elif how == "garbage":
            await stream.send_all(b"\x00\xffNOT HTTP\r\n\r\n" * 4)
        with trio.move_on_after(rng.random() * 0.3):
            while await stream.receive_some(65536):
                pass
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await stream.aclose()


async def _idle(client: httpx.AsyncClient) -> bool:
    """Nothing runs or waits: every cut request has been aborted (at the next step)."""
    health = (await client.get("/health")).json()
    return health["running"] == 0 and health["waiting"] == 0


async def test_misbehaving_connections_never_end_the_server(tiny_app) -> None:
    app = tiny_app(engine={"max_batch_size": 16, "max_waiting_requests": 256})
    rng = random.Random(7)
    good: list[Stream] = []
    async with running_server(app) as server:
        port = int(server.url.rsplit(":", 1)[1])
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=120) as h1,
            httpx.AsyncClient(base_url=server.url, timeout=120, http1=False, http2=True) as h2c,
        ):
            for _ in range(ROUNDS):
                async with trio.open_nursery() as nursery:
                    for client in (h1, h2c, h2c):
                        s = Stream()
                        good.append(s)
                        nursery.start_soon(read_stream, client, "/v1/generate", native(24), s)
                    for how in H2_WAYS:
                        nursery.start_soon(_h2_misbehave, port, how, rng)
                    for how in ("half-close", "garbage", "vanish"):
                        nursery.start_soon(_h1_misbehave, port, how, rng)
            await wait_for(lambda: _idle(h1))
            health = await h1.get("/health")
            after = await h2c.post(
                "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4}
            )
            stats = await metrics(h1)
    assert health.status_code == 200 and health.json()["running"] == 0
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    for s in good:
        assert s.status == 200 and s.terminals() == ["done"], s.events[-3:]
        assert len(s.named("token")) == 24
    assert stats["infer_kv_blocks_used"] == 0


async def test_a_bad_h2c_upgrade_closes_only_its_connection(tiny_app) -> None:
    """An ``HTTP2-Settings`` header that is not base64 makes h2 raise inside Hypercorn's
    connection handler: contained, it ends that connection and nothing else."""
    app = tiny_app()
    request = (
        b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: !!!notbase64\r\n\r\n"
    )
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as client,
    ):
        port = int(server.url.rsplit(":", 1)[1])
        s = Stream()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stream, client, "/v1/generate", native(16), s)
            for _ in range(3):
                stream = await trio.open_tcp_stream("127.0.0.1", port)
                async with stream:
                    await stream.send_all(request)
                    with trio.fail_after(30):  # the server closes it
                        while await stream.receive_some(65536):
                            pass
        health = await client.get("/health")
    assert health.status_code == 200
    assert s.terminals() == ["done"] and len(s.named("token")) == 16


class _Protocol:
    """What a :class:`Connection` tells its protocol: only that it closed."""

    async def handle(self, event: object) -> None:
        assert isinstance(event, Closed)


async def _send_after(go: trio.Event, connection: Connection) -> None:
    await go.wait()
    await connection.protocol_send(RawData(b"data"))


async def test_a_close_never_races_a_send() -> None:
    """Hypercorn's close half-closes the socket, and trio's ``send_eof`` checkpoints while it
    holds the send side: a send scheduled in that instant raised ``BusyResourceError``."""
    for _ in range(50):
        ours, theirs = trio.socket.socketpair()
        with theirs:
            connection = Connection(
                None, HypercornConfig(), WorkerContext(None), {}, trio.SocketStream(ours)
            )
            connection.protocol = _Protocol()
            go = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_send_after, go, connection)
                await trio.testing.wait_all_tasks_blocked()
                go.set()
                await trio.lowlevel.checkpoint()  # the sender takes the lock meanwhile
                await connection._close()  # the sender's send may run in its checkpoint
