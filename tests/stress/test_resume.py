"""Resumable, idempotent native streams over a real Hypercorn: SSE ids, a reconnect with
Last-Event-ID, a takeover (SUPERSEDED), a conflicting body (409), the resume window."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from support.server import (
    PROMPT,
    SSEEvent,
    StepGate,
    iter_sse,
    metrics,
    parse_sse,
    running_server,
    wait_for,
)


def body(max_tokens: int = 40, **extra: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0} | extra


def text(events: list[SSEEvent]) -> str:
    return "".join(e.json()["token"] for e in events if e.event == "token")


def terminals(events: list[SSEEvent]) -> list[str]:
    return [e.event for e in events if e.event in ("done", "error")]


async def read_some(
    client: httpx.AsyncClient, payload: dict, n: int, headers: dict[str, str] | None = None
) -> list[SSEEvent]:
    """Read events until ``n`` tokens have arrived, then drop the connection."""
    events: list[SSEEvent] = []
    async with client.stream("POST", "/v1/generate", json=payload, headers=headers) as r:
        assert r.status_code == 200
        async for event in iter_sse(r):
            events.append(event)
            if sum(e.event == "token" for e in events) == n:
                break
    return events


async def read_into(client: httpx.AsyncClient, payload: dict, events: list[SSEEvent]) -> None:
    """Read the stream to its end, appending each event to ``events`` as it arrives."""
    async with client.stream("POST", "/v1/generate", json=payload) as r:
        async for event in iter_sse(r):
            events.append(event)


async def read_all(
    client: httpx.AsyncClient, payload: dict, headers: dict[str, str] | None = None
) -> list[SSEEvent]:
    r = await client.post("/v1/generate", json=payload, headers=headers)
    assert r.status_code == 200, r.text
    return parse_sse(r.text)


async def test_every_native_event_has_a_sequence_id(tiny_app) -> None:
    async with (
        running_server(tiny_app(resume_window_s=120)) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        plain = await client.post("/v1/generate", json=body(6, metrics_every=2))
        resumable = await client.post(
            "/v1/generate", json=body(6, metrics_every=2, request_id="job-0")
        )
    for r in (plain, resumable):
        events = [e for e in parse_sse(r.text) if e.comment is None]
        ids = [e.id for e in events]
        assert ids == [str(i) for i in range(len(ids))] and len(ids) >= 8
        lines = r.text.splitlines()
        assert sum(line.startswith("id:") for line in lines) == len(events)  # one id each


async def test_a_reconnect_resumes_where_the_client_left(tiny_app) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate, resume_window_s=120)
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        whole = await read_all(client, body())
        with gate:
            gate.close()
            gate.allow(4)  # the first connection sees a few tokens, then the engine waits
            first = await read_some(client, body(request_id="job-1"), 3)
            gate.open()
            last_id = first[-1].id
            assert last_id is not None
            rest = await read_all(client, body(request_id="job-1"), {"Last-Event-ID": last_id})
        stats = await metrics(client)
        assert app.extensions["infer"].engine.has_work() is False
    assert [e.id for e in rest if e.comment is None][0] == str(int(last_id) + 1)
    assert text(first) + text(rest) == text(whole)
    assert terminals(first) == [] and terminals(rest) == ["done"]
    assert stats["infer_stream_resumes_total"] == 1
    assert stats['infer_requests_total{finish_reason="length"}'] == 2  # one generation each


async def test_the_same_request_again_replays_without_generating_again(tiny_app) -> None:
    async with (
        running_server(tiny_app(resume_window_s=120)) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        once = await read_all(client, body(request_id="job-2"))
        again = await read_all(client, body(request_id="job-2"))
        conflict = await client.post("/v1/generate", json=body(41, request_id="job-2"))
        stats = await metrics(client)
    assert [(e.id, e.data) for e in again] == [(e.id, e.data) for e in once]
    assert conflict.status_code == 409
    assert conflict.json()["error"]["code"] == "request_id_conflict"
    assert stats['infer_requests_total{finish_reason="length"}'] == 1


async def test_a_second_connection_supersedes_the_first(tiny_app) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate, resume_window_s=120)
    first: list[SSEEvent] = []
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        whole = await read_all(client, body())
        with gate:
            gate.close()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_into, client, body(request_id="job-3"), first)
                await wait_for(lambda: any(e.event == "started" for e in first))
                second_task: list[list[SSEEvent]] = []

                async def read_second() -> None:
                    second_task.append(await read_all(client, body(request_id="job-3")))

                nursery.start_soon(read_second)
                await wait_for(lambda: terminals(first) != [])  # taken over at once
                gate.open()
    second = second_task[0]
    assert terminals(first) == ["error"] and first[-1].json()["code"] == "SUPERSEDED"
    assert terminals(second) == ["done"] and text(second) == text(whole)


async def test_after_the_window_the_request_is_aborted_and_its_id_free(tiny_app) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate, resume_window_s=0.2)
    state = app.extensions["infer"]
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        with gate:
            gate.close()
            gate.allow(2)
            await read_some(client, body(300, request_id="job-4"), 1)
            await wait_for(lambda: len(state.resumable) == 0)  # nobody came back in time
            gate.open()
        await wait_for(lambda: not state.engine.has_work() and not state.worker._choices)
        fresh = await read_all(client, body(5, request_id="job-4"))  # another body: allowed
        stats = await metrics(client)
    assert terminals(fresh) == ["done"]
    assert stats['infer_requests_total{finish_reason="abort"}'] == 1


async def test_delete_stops_a_resumable_request_and_its_reader_gets_one_terminal(tiny_app) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate, resume_window_s=120)
    state = app.extensions["infer"]
    events: list[SSEEvent] = []
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        with gate:
            gate.close()
            gate.allow(3)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_into, client, body(300, request_id="job-5"), events)
                await wait_for(lambda: sum(e.event == "token" for e in events) >= 2)
                stopped = await client.delete("/v1/generate/job-5")
                await wait_for(lambda: terminals(events) != [])
            gate.open()
        await wait_for(lambda: not state.engine.has_work() and len(state.resumable) == 1)
        again = await read_all(client, body(300, request_id="job-5"))  # a late reader: replay
        unknown = await client.delete("/v1/generate/job-6")
        stats = await metrics(client)
    assert stopped.status_code == 200 and stopped.json() == {"request_id": "job-5", "stopped": True}
    assert terminals(events) == ["error"] and events[-1].json()["code"] == "STOPPED"
    assert terminals(again) == ["error"] and text(again) == text(events)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "request_not_found"
    assert stats['infer_requests_total{finish_reason="abort"}'] == 1
