"""Faults inside the engine, over a real Hypercorn with a tiny model: a failure in one
request's post-processing ends only that request; a failure of the engine loop itself ends
every stream with an error, turns ``/health`` to ``failed`` and stops ``infer serve`` with a
non-zero status. A :class:`StepGate` holds the engine while a test plants the fault."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import trio
from hypercorn.config import Config as HypercornConfig

from infer.api.native import bodies as native_events
from infer.api.openai import bodies as openai
from infer.server.serve import serve_app
from support.server import (
    StepGate,
    Stream,
    metrics,
    native,
    read_stream,
    running_server,
    step_until,
    stop_on_failure,
    wait_for,
)


class BrokenDetokenizer:
    """Stands in for one request's detokenizer and fails as a bug in it would."""

    stopped = False

    def add(self, token: int) -> str:
        raise ValueError("detokenizer bug")

    def finish(self, drop_partial: bool = False) -> str:
        raise ValueError("detokenizer bug")


def _running(app: Any) -> dict[str, Any]:
    """The engine's running requests by id (read while the gate holds the engine thread)."""
    return {r.request_id: r for r in app.extensions["infer"].engine.scheduler.running}


async def test_a_failure_after_the_forward_ends_only_that_request(tiny_app) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate)
    victim, other, alone = Stream(), Stream(), Stream()
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        await read_stream(client, "/v1/generate", native(12), alone)
        with gate:
            gate.close()
            async with trio.open_nursery() as nursery:
                for s in (victim, other):
                    nursery.start_soon(read_stream, client, "/v1/generate", native(12), s)
                await wait_for(lambda: gate.blocked)
                await step_until(gate, lambda: bool(victim.named("token") and other.named("token")))
                request = _running(app)[victim.named("started")[0]["id"]]
                request.detokenizer = BrokenDetokenizer()  # the engine thread waits at the gate
                gate.open()
        after = await client.post("/v1/completions", json=native(4, model="tiny"))
        health = await client.get("/health")
    assert victim.terminals() == ["error"]
    assert victim.named("error")[0]["code"] == "INFERENCE_FAILED"
    assert "detokenizer bug" not in str(victim.events)
    assert other.terminals() == ["done"] and other.text() == alone.text()
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4
    assert health.json()["status"] == "ready"
    engine = app.extensions["infer"].engine
    assert engine.blocks.num_used == 0 and not engine.blocks.tables


class LoopBug(RuntimeError):
    pass


def _break_the_loop(app: Any) -> None:
    """Make the engine loop itself raise at its next step (outside any one request)."""

    def schedule() -> Any:
        raise LoopBug("scheduler bug")

    app.extensions["infer"].engine.scheduler.schedule = schedule


async def _open_streams_then_break(
    app: Any, gate: StepGate, client: httpx.AsyncClient, runs: list[Stream]
) -> None:
    """Stream a native and an OpenAI request; once both have output, break the loop."""
    bodies = [
        ("/v1/generate", native(300)),
        ("/v1/completions", native(300, model="tiny", stream=True)),
    ]
    gate.close()
    async with trio.open_nursery() as streams:
        for (path, body), s in zip(bodies, runs, strict=True):
            streams.start_soon(read_stream, client, path, body, s)
        await wait_for(lambda: gate.blocked)
        await step_until(gate, lambda: all(len(s.events) > 1 for s in runs))
        _break_the_loop(app)
        gate.open()


def _assert_error_terminals(runs: list[Stream]) -> None:
    native_run, openai_run = runs
    assert native_run.terminals() == ["error"]
    assert native_run.named("error")[0]["code"] == "INFERENCE_FAILED"
    chunks = [e.data for e in openai_run.events]
    assert chunks[-1] == "[DONE]" and '"code":"inference_failed"' in str(chunks[-2])


async def test_an_engine_loop_failure_ends_every_stream_and_fails_health(tiny_app, caplog) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate)
    runs = [Stream(), Stream()]
    with gate, caplog.at_level(logging.ERROR, logger="infer.server"):
        async with (
            running_server(app) as server,
            httpx.AsyncClient(base_url=server.url, timeout=120) as client,
        ):
            await _open_streams_then_break(app, gate, client, runs)
            health = await client.get("/health")
            late = await client.post("/v1/generate", json=native(4))
    _assert_error_terminals(runs)
    assert health.status_code == 503 and health.json()["status"] == "failed"
    assert late.status_code == 503 and late.json()["error"]["code"] == "not_ready"
    logged = [r for r in caplog.records if r.exc_info and "engine loop failed" in r.message]
    assert logged and logged[0].exc_info is not None and logged[0].exc_info[0] is LoopBug


async def test_an_engine_loop_failure_stops_infer_serve_with_status_1(tiny_app) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate)
    hyper = HypercornConfig()
    hyper.bind = ["127.0.0.1:0"]
    hyper.graceful_timeout = 5.0
    runs = [Stream(), Stream()]
    exit_status: list[int] = []

    async def serve(task_status: trio.TaskStatus[list[str]]) -> None:
        exit_status.append(await serve_app(app, hyper, task_status=task_status))

    with gate:
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(serve)
            with stop_on_failure(nursery, gate):
                async with httpx.AsyncClient(base_url=urls[0], timeout=120) as client:
                    await _open_streams_then_break(app, gate, client, runs)
                await wait_for(lambda: exit_status, timeout_s=60)  # no signal was sent
    assert exit_status == [1]
    _assert_error_terminals(runs)


async def test_a_failing_assertion_with_the_gate_closed_fails_instead_of_hanging(tiny_app) -> None:
    """The harness itself: a server nothing signals, a held engine, a failed assertion."""
    gate = StepGate()
    app = tiny_app(gate=gate)
    hyper = HypercornConfig()
    hyper.bind = ["127.0.0.1:0"]
    run = Stream()
    failed = False
    with trio.fail_after(60):
        try:
            with gate:
                async with trio.open_nursery() as nursery:
                    urls = await nursery.start(serve_app, app, hyper)
                    with stop_on_failure(nursery, gate):
                        async with (
                            httpx.AsyncClient(base_url=urls[0], timeout=120) as client,
                            trio.open_nursery() as reads,
                        ):
                            gate.close()
                            reads.start_soon(read_stream, client, "/v1/generate", native(40), run)
                            await wait_for(lambda: gate.blocked)
                            raise AssertionError("a check failed while the engine was held")
        except* AssertionError:
            failed = True
    assert failed


async def test_a_server_error_in_a_stream_is_not_a_client_disconnect(tiny_app, monkeypatch) -> None:
    def broken(*args: Any) -> bytes:
        raise RuntimeError("a bug while framing events")

    monkeypatch.setattr(native_events, "events", broken)
    monkeypatch.setattr(openai, "output_chunks", broken)
    app = tiny_app()
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        native_run = await client.post("/v1/generate", json=native(20))
        openai_run = await client.post(
            "/v1/completions", json=native(20, model="tiny", stream=True)
        )
        stats = await metrics(client)
    assert native_run.text.count("event: error") == 1
    assert '"code":"INFERENCE_FAILED"' in native_run.text
    assert openai_run.text.endswith("data: [DONE]\n\n")
    assert stats["infer_client_disconnects_total"] == 0
    assert stats['infer_requests_total{finish_reason="error"}'] == 2
