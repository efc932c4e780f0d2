"""Disconnects, slow readers, a full queue, heartbeats, timeouts, failures and shutdown, over
a real Hypercorn with a tiny model. A :class:`StepGate` holds the engine between steps where
a test needs a state to last (a full queue, a quiet stream), so nothing depends on timing.
"""

from __future__ import annotations

import json
import socket
from typing import Any

import httpx
import trio

from support.server import (
    GatedModel,
    StepGate,
    Stream,
    iter_sse,
    metrics,
    native,
    read_stream,
    running_server,
    step_once,
    step_until,
    wait_for,
)


async def test_disconnect_aborts_within_a_few_steps(tiny_app) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate)
    streams = {name: Stream() for name in "ABC"}
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        alone = Stream()
        await read_stream(client, "/v1/generate", native(40), alone)
        a_scope = trio.CancelScope()
        with gate:
            gate.close()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_read_in, a_scope, client, native(40), streams["A"])
                for name in "BC":
                    nursery.start_soon(
                        read_stream, client, "/v1/generate", native(40), streams[name]
                    )
                await wait_for(lambda: gate.blocked)
                await step_until(gate, lambda: all(s.named("token") for s in streams.values()))
                assert (await metrics(client))["infer_requests_running"] == 3
                a_scope.cancel()  # client A goes away mid-stream
                await wait_for(lambda: streams["A"].ended)
                await wait_for(lambda: _counter(client, "infer_client_disconnects_total", 1))
                steps = await step_until(
                    gate, lambda: _counter(client, "infer_requests_running", 2)
                )
                assert steps <= 3
                gate.open()
        stats = await metrics(client)
        assert app.extensions["infer"].worker._choices == {}  # nothing left per request
    assert streams["A"].terminals() == []
    for name in "BC":
        s = streams[name]
        assert s.terminals() == ["done"] and s.named("done")[0]["finish_reason"] == "length"
        assert s.text() == alone.text()
    assert stats["infer_client_disconnects_total"] == 1
    assert stats['infer_requests_total{finish_reason="abort"}'] == 1
    assert stats['infer_requests_total{finish_reason="length"}'] == 3


async def _read_in(
    scope: trio.CancelScope, client: httpx.AsyncClient, body: dict, out: Stream
) -> None:
    with scope:
        await read_stream(client, "/v1/generate", body, out)
    out.ended = True


async def _counter(client: httpx.AsyncClient, name: str, value: float) -> bool:
    return (await metrics(client)).get(name) == value


async def test_slow_reader_is_ended_and_never_slows_the_others(tiny_app) -> None:
    gate = StepGate()
    # One token per stream per step (no drafts): the steps below count them.
    engine = {"max_seq_len": 2048, "draft_tokens": 0}
    app = tiny_app(gate=gate, engine=engine, output_buffer=4, max_pending_tokens=200)
    # Traces make each event large, so the reader's socket buffers fill within a few hundred
    # tokens; a small receive buffer helps. After that, the server's pending output grows.
    slow_body = native(1900, trace={"layer": 0, "top_k": 20})
    small = httpx.AsyncHTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
    others = [Stream() for _ in range(3)]
    with gate:
        async with (
            running_server(app) as server,
            httpx.AsyncClient(base_url=server.url, timeout=120) as client,
            httpx.AsyncClient(base_url=server.url, timeout=120, transport=small) as slow_client,
        ):
            worker = app.extensions["infer"].worker
            async with slow_client.stream("POST", "/v1/generate", json=slow_body) as slow:
                assert slow.status_code == 200  # and then it stops reading
                await wait_for(lambda: any(s.pending for s in worker.streams))
                gate.close()  # the slow reader is stalled: its output piles up server-side
                async with trio.open_nursery() as nursery:
                    for s in others:
                        nursery.start_soon(read_stream, client, "/v1/generate", native(32), s)
                    await wait_for(lambda: gate.blocked)
                    await step_until(gate, lambda: all(s.named("token") for s in others))
                    engine = app.extensions["infer"].engine
                    for _ in range(10):  # every step gives every other stream a token
                        await wait_for(lambda: all(_caught_up(engine, s) for s in others))
                        counts = [len(s.named("token")) for s in others]
                        await step_once(gate)
                        await wait_for(lambda: all(_caught_up(engine, s) for s in others))
                        assert [len(s.named("token")) for s in others] == [n + 1 for n in counts]
                    assert worker.running == 4  # the slow reader was in every one of them
                    gate.open()
                await wait_for(lambda: worker.running == 0)
                stuck = [e async for e in iter_sse(slow)]  # now read it all
            stats = await metrics(client)
            assert worker._choices == {}
    for s in others:
        assert s.terminals() == ["done"] and len(s.named("token")) == 32
    names = [e.event for e in stuck]
    assert names[0] == "started" and names[-1] == "error"
    assert sum(n in ("done", "error") for n in names) == 1
    error = stuck[-1].json()
    assert error["code"] == "OVERLOADED" and error["retryable"] is True
    assert error["usage"]["completion_tokens"] < 1900
    assert stats['infer_requests_total{finish_reason="error"}'] == 1


def _caught_up(engine, stream: Stream) -> bool:
    """Whether the client has read every token the engine made for this stream so far."""
    request = engine.scheduler.find(stream.named("started")[0]["id"])
    tokens = stream.named("token")
    return request is not None and bool(tokens) and tokens[-1]["i"] + 1 == len(request.output_ids)


async def test_queue_full_is_503_at_once_and_the_rest_complete(tiny_app) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate, engine={"max_batch_size": 1, "max_waiting_requests": 2})
    streams = [Stream() for _ in range(8)]
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        with gate:
            gate.close()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_stream, client, "/v1/generate", native(8), streams[0])
                await wait_for(lambda: gate.blocked)  # the first runs: its one slot is taken
                for s in streams[1:]:
                    nursery.start_soon(read_stream, client, "/v1/generate", native(8), s)
                # Every client has its answer while the engine has not finished one step.
                await wait_for(lambda: all(s.status is not None for s in streams))
                assert gate.passed == 0
                gate.open()
        stats = await metrics(client)
    accepted = [s for s in streams if s.status == 200]
    rejected = [s for s in streams if s.status == 503]
    assert len(accepted) == 3 and len(rejected) == 5  # one running, two waiting
    for s in rejected:
        assert s.error is not None and s.error["error"]["code"] == "queue_full"
        assert int(s.headers["retry-after"]) >= 1
    for s in accepted:
        assert s.terminals() == ["done"] and len(s.named("token")) == 8
    assert stats['infer_requests_rejected_total{code="queue_full"}'] == len(rejected)


async def test_heartbeats_on_a_quiet_stream(tiny_app) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate, heartbeat_s=0.05)
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        for path, body in (
            ("/v1/generate", native(5)),
            ("/v1/completions", native(5, model="tiny", stream=True)),
        ):
            with gate:
                gate.close()
                events = []
                async with client.stream("POST", path, json=body) as r:
                    async for event in iter_sse(r):
                        events.append(event)
                        if sum(e.comment is not None for e in events) == 3:
                            gate.open()  # three heartbeats while nothing else could happen
            beats = [i for i, e in enumerate(events) if e.comment is not None]
            assert len(beats) >= 3 and all(events[i].comment == "keep-alive" for i in beats)
            data = [e for e in events if e.comment is None]
            if path == "/v1/generate":
                assert [e.event for e in data][-1] == "done" and len(data) == 7
            else:
                assert data[-1].data == "[DONE]"


async def test_timeout_is_capped_by_the_server(tiny_app) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate, max_timeout_s=0.5)
    runs = [Stream(), Stream()]
    bodies = [
        ("/v1/generate", native(400, timeout_s=1000)),
        (
            "/v1/completions",
            native(400, model="tiny", stream=True, stream_options={"include_usage": True}),
        ),
    ]
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        worker = app.extensions["infer"].worker
        with gate:
            gate.close()
            async with trio.open_nursery() as nursery:
                for (path, body), s in zip(bodies, runs, strict=True):
                    nursery.start_soon(read_stream, client, path, body, s)
                await wait_for(lambda: len(worker._choices) == 2 and gate.blocked)
                # The engine is held until both requests are past the server's cap (neither
                # asked for less): only the cap can end them before 400 tokens.
                await wait_for(
                    lambda: all(trio.current_time() >= s.deadline for s in worker.streams)
                )
                gate.open()
        assert worker._choices == {}
    native_run, openai_run = runs
    assert native_run.terminals() == ["error"]
    error = native_run.named("error")[0]
    assert error["code"] == "TIMEOUT" and error["usage"]["completion_tokens"] < 400
    chunks = [e.data for e in openai_run.events]
    assert chunks[-1] == "[DONE]"
    assert json.loads(chunks[-3])["choices"][0]["finish_reason"] == "length"
    assert json.loads(chunks[-2])["usage"]["completion_tokens"] < 400


async def test_graceful_shutdown_ends_every_stream(tiny_app) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate)
    runs = [Stream(), Stream(), Stream()]
    bodies = [
        ("/v1/generate", native(400)),
        ("/v1/generate", native(300)),
        (
            "/v1/chat/completions",
            {
                "model": "tiny",
                "stream": True,
                "max_tokens": 300,
                "messages": [{"role": "user", "content": "hi"}],
            },
        ),
    ]
    with gate:
        async with (
            running_server(app) as server,
            httpx.AsyncClient(base_url=server.url, timeout=120) as client,
        ):
            gate.close()
            async with trio.open_nursery() as nursery:
                for (path, body), s in zip(bodies, runs, strict=True):
                    nursery.start_soon(read_stream, client, path, body, s)
                await wait_for(lambda: gate.blocked)
                await step_until(gate, lambda: all(len(s.events) > 2 for s in runs))
                server.shutdown()  # what SIGTERM does under `infer serve`
                await wait_for(lambda: _status_is(client, "draining"))
                late = await client.post("/v1/generate", json=native(4))
                assert late.status_code == 503
                assert late.json()["error"]["code"] == "shutting_down"
                gate.open()
    for s in runs[:2]:
        assert s.terminals() == ["error"] and s.events[-1].event == "error"
        assert s.named("error")[0]["code"] == "CANCELLED"
    chunks = [e.data for e in runs[2].events]
    assert chunks[-1] == "[DONE]" and chunks.count("[DONE]") == 1
    assert json.loads(chunks[-2])["error"]["code"] == "cancelled"


async def _status_is(client: httpx.AsyncClient, status: str) -> bool:
    r = await client.get("/health")
    return r.status_code == 503 and r.json()["status"] == status


class FailingModel(GatedModel):
    """A model whose forward raises, as a broken kernel would."""

    def forward_paged(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret detail from /opt/private/weights.bin")


async def test_inference_failure_is_a_clean_error(tiny_app, tiny_model) -> None:
    app = tiny_app(model=FailingModel(tiny_model))
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        events = await client.post("/v1/generate", json=native(5))
        whole = await client.post("/v1/completions", json=native(5, model="tiny"))
        chunks = await client.post("/v1/completions", json=native(5, model="tiny", stream=True))
        stats = await metrics(client)
    for r in (events, whole, chunks):
        assert "secret" not in r.text and "Traceback" not in r.text
    assert events.text.count("event: error") == 1 and "event: done" not in events.text
    assert '"code":"INFERENCE_FAILED"' in events.text
    assert whole.status_code == 500 and whole.json()["error"]["code"] == "inference_failed"
    assert chunks.text.endswith("data: [DONE]\n\n") and '"code":"inference_failed"' in chunks.text
    assert stats['infer_requests_total{finish_reason="error"}'] == 3


async def test_shutdown_drains_before_any_connection_is_closed(tiny_app) -> None:
    """The shutdown signal drains the app at once: streams end long before Hypercorn's
    graceful timeout would close their connections."""
    gate = StepGate()
    app = tiny_app(gate=gate)
    runs = [Stream(), Stream()]
    with gate:
        # A long graceful timeout: were the app not drained, streams would hang that long.
        async with (
            running_server(app, graceful_timeout_s=120) as server,
            httpx.AsyncClient(base_url=server.url, timeout=120) as client,
        ):
            gate.close()
            async with trio.open_nursery() as nursery:
                for s in runs:
                    nursery.start_soon(read_stream, client, "/v1/generate", native(400), s)
                await wait_for(lambda: gate.blocked)
                await step_until(gate, lambda: all(len(s.events) > 1 for s in runs))
                server.shutdown()
                await wait_for(lambda: app.extensions["infer"].status == "draining")
                gate.open()
    for s in runs:
        assert s.terminals() == ["error"] and s.named("error")[0]["code"] == "CANCELLED"
