"""Edges with no other test: OpenAI disconnects, stop and seed over HTTP, 503 while the model
loads and after it failed to load, and SIGTERM to a real ``infer serve``."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest
import trio

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.server.app import create_app
from infer.server.config import ServerConfig
from support.server import (
    PROMPT,
    StepGate,
    iter_sse,
    metrics,
    running_server,
    step_until,
    step_until_idle,
    wait_for,
)


def body(max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens} | extra


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/responses"])
async def test_an_openai_client_that_leaves_aborts_its_request(
    tiny_app, path: str, stream: bool
) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate)
    if path == "/v1/responses":
        request = {"model": "tiny", "input": PROMPT, "max_output_tokens": 300, "stream": stream}
    else:
        request = body(300, stream=stream)
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        worker = app.extensions["infer"].worker
        with gate:
            gate.close()
            with trio.CancelScope() as leave:

                async def go_away_when_running() -> None:
                    await wait_for(lambda: gate.blocked and worker.running == 1)
                    await step_until(
                        gate, lambda: worker.engine.scheduler.running[0].output_ids != []
                    )
                    leave.cancel()

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(go_away_when_running)
                    await client.post(path, json=request)
            await wait_for(lambda: _counter_is(client, "infer_client_disconnects_total", 1))
            await step_until_idle(
                gate, lambda: not worker._choices and worker.running == 0, max_steps=3
            )
        stats = await metrics(client)
    assert stats['infer_requests_total{finish_reason="abort"}'] == 1


async def _counter_is(client: httpx.AsyncClient, name: str, value: float) -> bool:
    return (await metrics(client)).get(name) == value


async def test_stop_and_seed_over_http(tiny_app) -> None:
    app = tiny_app()
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):

        async def text(**extra: Any) -> dict[str, Any]:
            r = await client.post("/v1/completions", json=body(24, **extra))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        greedy = (await text(temperature=0))["text"]
        stop = greedy[len(greedy) // 2 : len(greedy) // 2 + 3]
        stopped = await text(temperature=0, stop=[stop])
        seeded = [(await text(temperature=1.0, seed=s))["text"] for s in (7, 7, 8)]
    assert stop and stop not in stopped["text"] and stopped["finish_reason"] == "stop"
    assert greedy.startswith(stopped["text"]) and len(stopped["text"]) < len(greedy)
    assert seeded[0] == seeded[1] != seeded[2]


@pytest.mark.parametrize("loads_its_model", [True, False], ids=["loads-its-model", "given-one"])
async def test_a_serving_app_freezes_the_startup_heap(
    monkeypatch, tiny_app, tmp_path, loads_its_model
) -> None:
    """Loading leaves ~400k objects the cycle collector would walk at every full collection
    (~200 ms with the engine and event loop stopped): a server freezes them (``gc.freeze``)
    while it serves, whether it loaded the model itself or was given it loaded (as `infer
    serve` does), and unfreezes them when it stops."""
    engine = tiny_app().extensions["infer"].engine
    config = ServerConfig(engine=EngineConfig(model=str(tmp_path / "tiny")))
    if loads_its_model:
        monkeypatch.setattr(Engine, "from_config", staticmethod(lambda config: engine))
        app = create_app(config)
    else:
        app = create_app(config, engine)
    before = gc.get_freeze_count()
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        await wait_for(lambda: app.extensions["infer"].status == "ready")
        frozen = gc.get_freeze_count()
        r = await client.post("/v1/completions", json=body(4))
        assert r.status_code == 200, r.text
    assert frozen > before + 1000
    assert gc.get_freeze_count() == before


async def test_503_while_loading_and_after_a_failed_load(monkeypatch, tmp_path) -> None:
    entered, release = threading.Event(), threading.Event()

    def slow_failing_load(config: EngineConfig) -> Engine:
        entered.set()
        release.wait(timeout=120)
        raise FileNotFoundError(f"model path does not exist: {config.model}")

    monkeypatch.setattr(Engine, "from_config", staticmethod(slow_failing_load))
    app = create_app(ServerConfig(engine=EngineConfig(model=str(tmp_path / "missing"))))
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        await wait_for(entered.is_set)
        loading = [await client.get("/health"), await client.post("/v1/completions", json=body(4))]
        release.set()
        await wait_for(lambda: app.extensions["infer"].status == "failed")
        failed = [await client.get("/health"), await client.post("/v1/completions", json=body(4))]
    assert [r.status_code for r in loading + failed] == [503] * 4
    assert loading[0].json()["status"] == "loading" and failed[0].json()["status"] == "failed"
    for r in (loading[1], failed[1]):
        assert r.json()["error"]["code"] == "not_ready" and r.headers["retry-after"]


async def test_sigterm_to_infer_serve_ends_open_streams_and_exits_0() -> None:
    """The real command line on the default model: SIGTERM mid-stream drains, then exits 0."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infer",
            "serve",
            "--port",
            "0",
            "--max-seq-len",
            "512",
            "--max-batch-size",
            "4",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    try:
        url = await trio.to_thread.run_sync(_bound_url, proc)
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            await wait_for(lambda: _ready(client), timeout_s=120)
            events = []
            async with client.stream(
                "POST",
                "/v1/generate",
                json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True},
            ) as r:
                async for event in iter_sse(r):
                    events.append(event)
                    if sum(e.event == "token" for e in events) == 3:
                        proc.send_signal(signal.SIGTERM)
        status = await trio.to_thread.run_sync(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    terminals = [e for e in events if e.event in ("done", "error")]
    assert len(terminals) == 1 and terminals[0].json()["code"] == "CANCELLED"
    assert status == 0


def _bound_url(proc: subprocess.Popen[str]) -> str:
    """Read the server's stderr until Hypercorn says where it listens (then keep draining)."""
    assert proc.stderr is not None
    for line in proc.stderr:
        if "Running on http://" in line:
            url = line.split("Running on ", 1)[1].split()[0]
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return url
    raise AssertionError(f"infer serve exited with {proc.wait()} before listening")


async def _ready(client: httpx.AsyncClient) -> bool:
    return (await client.get("/health")).status_code == 200
