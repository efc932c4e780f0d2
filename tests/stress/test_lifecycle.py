"""A request's life at the edges: submitted while the server stops, a response never read,
a drain that begins mid-step. Real Hypercorn, a tiny model, and gates that hold the
tokenizer or the engine so that each edge is a state the test holds, not a race."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import trio
from quart import request
from transformers import PreTrainedTokenizerBase

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.models.base import CausalLM
from infer.server.app import create_app
from infer.server.config import ServerConfig
from support.server import (
    PROMPT,
    StepGate,
    Stream,
    metrics,
    native,
    read_stream,
    running_server,
    step_until,
    step_until_idle,
    wait_for,
)

HOLD = "HOLD "  # a prompt starting with this waits in the tokenizer until released


class HeldTokenizer:
    """The real tokenizer, except that encoding a prompt that starts with HOLD waits."""

    def __init__(self, inner: PreTrainedTokenizerBase) -> None:
        self._inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, text: Any, *args: Any, **kwargs: Any) -> list[int]:
        if isinstance(text, str) and text.startswith(HOLD):
            self.entered.set()
            self.release.wait(timeout=120)
        return list(self._inner.encode(text, *args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


async def test_a_request_tokenizing_when_the_drain_begins_is_refused(
    tiny_model: CausalLM, default_tokenizer: PreTrainedTokenizerBase
) -> None:
    tokenizer = HeldTokenizer(default_tokenizer)
    config = EngineConfig(max_seq_len=512, max_batch_size=4)
    engine = Engine(config, tiny_model, tokenizer, [], "tiny")  # type: ignore[arg-type]
    app = create_app(ServerConfig(engine=config), engine)
    state = app.extensions["infer"]
    held = Stream()
    # A long graceful timeout: Hypercorn waits for the held request instead of cutting it.
    async with (
        running_server(app, graceful_timeout_s=120) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(read_stream, client, "/v1/generate", native(50, HOLD + PROMPT), held)
            await wait_for(tokenizer.entered.is_set)
            server.shutdown()
            await wait_for(lambda: state.worker is not None and not state.worker.ready)
            tokenizer.release.set()
    assert held.status == 503, held
    assert held.error is not None and held.error["error"]["code"] == "shutting_down"
    assert state.worker._choices == {}


async def test_a_response_never_sent_aborts_its_request(tiny_app) -> None:
    """A failure between submission and the response body (here an after_request hook)
    means the body is never iterated; the request must still be aborted at once."""
    gate = StepGate()
    app = tiny_app(gate=gate)

    @app.after_request
    async def _break(response: Any) -> Any:
        if request.headers.get("X-Break"):
            raise RuntimeError("a bug after the route returned")
        return response

    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        with gate:
            gate.close()
            for path, body in (
                ("/v1/generate", native(300)),
                ("/v1/completions", native(300, model="tiny", stream=True)),
            ):
                r = await client.post(path, json=body, headers={"X-Break": "1"})
                assert r.status_code == 500
                # Aborted within a step or two, not decoded to max_tokens with no reader.
                await step_until_idle(gate, lambda: _idle(app), max_steps=3)
        stats = await metrics(client)
    assert stats['infer_requests_total{finish_reason="error"}'] == 2
    assert stats["infer_client_disconnects_total"] == 0


def _idle(app: Any) -> bool:
    """No request is left: none known to the worker, none in the engine."""
    state = app.extensions["infer"]
    return not state.worker._choices and not state.engine.has_work()


async def test_waiting_counts_only_what_waits(tiny_app) -> None:
    """Requests admitted this step are running, not waiting: no early 503, true gauges."""
    gate = StepGate()
    app = tiny_app(gate=gate, engine={"max_batch_size": 4, "max_waiting_requests": 2})
    runs = [Stream() for _ in range(4)]
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        with gate:
            gate.close()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_stream, client, "/v1/generate", native(8), runs[0])
                await wait_for(lambda: gate.blocked)  # the first one is in its first forward
                for s in runs[1:3]:
                    nursery.start_soon(read_stream, client, "/v1/generate", native(8), s)
                await wait_for(lambda: _gauges(app)[1] == 2)  # two wait in the queue
                before = gate.passed
                gate.allow(1)  # the next step admits both: three run, none waits
                await wait_for(lambda: gate.passed > before and gate.blocked)
                assert _gauges(app) == (3, 0)
                health = (await client.get("/health")).json()
                assert (health["running"], health["waiting"]) == (3, 0)
                stats = await metrics(client)
                assert (stats["infer_requests_running"], stats["infer_requests_waiting"]) == (3, 0)
                nursery.start_soon(read_stream, client, "/v1/generate", native(8), runs[3])
                await wait_for(lambda: runs[3].status is not None or _gauges(app) == (3, 1))
                gate.open()
    for s in runs:
        assert s.status == 200 and s.terminals() == ["done"], s.error


def _made(app: Any, max_tokens: int) -> int:
    """Tokens made so far by the running request that asked for ``max_tokens``."""
    running = app.extensions["infer"].engine.scheduler.running
    return sum(len(r.output_ids) for r in running if r.params.max_new_tokens == max_tokens)


def _gauges(app: Any) -> tuple[int, int]:
    worker = app.extensions["infer"].worker
    return worker.running, worker.waiting


async def test_a_drain_mid_step_delivers_that_step_and_admits_nothing(tiny_app) -> None:
    gate = StepGate()
    app = tiny_app(gate=gate)
    state = app.extensions["infer"]
    ending, running, queued = Stream(), Stream(), Stream()
    with gate:
        async with (
            running_server(app) as server,
            httpx.AsyncClient(base_url=server.url, timeout=120) as client,
        ):
            gate.close()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_stream, client, "/v1/generate", native(3), ending)
                nursery.start_soon(read_stream, client, "/v1/generate", native(300), running)
                await wait_for(lambda: gate.blocked)
                # `running` may have joined a step later: only `ending`'s count matters. Count
                # in the engine (exact while it waits at the gate): a client that has not read
                # the last step yet would let one step too many through.
                await step_until(gate, lambda: _made(app, 3) == 2 and _made(app, 300) >= 1)
                await wait_for(lambda: len(ending.named("token")) == 2)
                # The engine waits in the step that ends `ending`; `queued` comes meanwhile.
                nursery.start_soon(read_stream, client, "/v1/generate", native(5), queued)
                await wait_for(lambda: queued.status is not None)
                server.shutdown()
                await wait_for(lambda: state.status == "draining")
                passed = gate.passed
                gate.open()
            forwards_after_drain = gate.passed - passed
    assert ending.terminals() == ["done"] and len(ending.named("token")) == 3
    assert running.terminals() == ["error"]
    assert running.named("error")[0]["code"] == "CANCELLED"
    assert queued.status == 200 and queued.terminals() == ["error"]
    assert queued.named("error")[0]["code"] == "CANCELLED" and not queued.named("token")
    assert forwards_after_drain == 1  # only the step already under way
