"""Helpers for testing the server for real: Hypercorn on a free port, SSE reading, and a
model wrapper that lets a test hold the engine between steps.

Tests drive the real stack (Hypercorn's trio worker, the app, the worker thread, the engine)
and use :class:`StepGate` to make timing-sensitive cases deterministic: while the gate is
closed the engine thread waits at the start of its next forward, so "the queue is full" or
"the stream is quiet" are states a test can hold and observe instead of race against.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import httpx
import torch
import trio
from hypercorn.config import Config as HypercornConfig
from quart_trio import QuartTrio
from torch import nn

from infer.bench.sse import SSEEvent, SSEParser
from infer.bench.sse import parse as parse_sse
from infer.server.app import drain
from infer.server.serve import KEEP_ALIVE_TIMEOUT_S, serve

__all__ = ["SSEEvent", "parse_sse"]  # the one SSE parser, re-exported for the tests


@dataclass
class ServerHandle:
    """A server started by :func:`running_server`."""

    url: str
    stop: trio.Event

    def shutdown(self) -> None:
        """Begin the graceful shutdown (what SIGTERM does under ``infer serve``)."""
        self.stop.set()


@asynccontextmanager
async def running_server(
    app: QuartTrio, graceful_timeout_s: float = 5.0
) -> AsyncIterator[ServerHandle]:
    """Serve ``app`` with Hypercorn on 127.0.0.1 and a free port until the block ends.

    Shutting down (leaving the block, or :meth:`ServerHandle.shutdown`) first drains the
    app: every open stream gets its terminal event. Then Hypercorn closes the connections
    and the engine thread ends; leaving the block waits for all of it.

    Args:
        app: A fresh app from ``create_app``.
        graceful_timeout_s: Hypercorn's wait for open connections after the drain.

    Yields:
        The running server (``url`` is ``http://127.0.0.1:<port>``).
    """
    config = HypercornConfig()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = graceful_timeout_s
    # as `infer serve`: with Hypercorn's 5 s, a client idle between rounds on a loaded machine
    # could send its next request as the server closed the connection (a broken pipe)
    config.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        serving = partial(serve, app, config, shutdown_trigger=stop.wait, drain=partial(drain, app))
        urls = await nursery.start(serving)
        try:
            yield ServerHandle(urls[0], stop)
        finally:
            # A test that failed with its gate closed would otherwise wait here forever:
            # the engine thread cannot stop while it waits at the gate.
            _open_gate(app)
            stop.set()


async def served(app: QuartTrio, fn: Callable[[str], Any]) -> Any:
    """Serve ``app`` (as :func:`running_server`) while ``fn(url)``, a blocking client, runs
    on a thread; its result."""
    async with running_server(app) as server:
        return await trio.to_thread.run_sync(fn, server.url)


@contextmanager
def stop_on_failure(nursery: trio.Nursery, gate: StepGate | None = None) -> Iterator[None]:
    """Cancel ``nursery`` (a server runs in it) and open ``gate`` if the block raises.

    A test that serves without :func:`running_server` (``serve_app`` until the engine
    fails) would otherwise hang when an assertion fails: the nursery waits for a server that
    nothing stops, and a closed gate keeps the engine thread from ending.
    """
    try:
        yield
    except BaseException:
        if gate is not None:
            gate.open()
        nursery.cancel_scope.cancel()
        raise


def _open_gate(app: QuartTrio) -> None:
    """Open the :class:`StepGate` of ``app``'s model, if it has one."""
    state = app.extensions.get("infer")
    model = getattr(getattr(state, "engine", None), "model", None)
    if isinstance(model, GatedModel):
        model.gate.open()


async def wait_for(
    predicate: Callable[[], Any], timeout_s: float = 60.0, poll_s: float = 0.01
) -> None:
    """Poll ``predicate`` (sync or async) until it is true.

    Raises:
        trio.TooSlowError: It stayed false for ``timeout_s`` (a generous bound, not a
            timing assertion).
    """
    with trio.fail_after(timeout_s):
        while True:
            result = predicate()
            if hasattr(result, "__await__"):
                result = await result
            if result:
                return
            await trio.sleep(poll_s)


async def iter_sse(response: httpx.Response) -> AsyncIterator[SSEEvent]:
    """Events and comments of a streamed httpx response, as they arrive."""
    parser = SSEParser(comments=True)
    async for chunk in response.aiter_bytes():
        for event in parser.feed(chunk):
            yield event


class StepGate:
    """Lets a test hold the engine thread at the start of each forward.

    Open, it lets everything through. Closed, a forward waits until the test opens it or
    :meth:`allow` grants single forwards. Use it as a context manager to be sure it is open
    again when the test ends (a closed gate would keep the engine thread from stopping).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._credits = 0
        self.passed = 0  # forwards let through
        self.blocked = False  # a forward is waiting at the gate now

    def close(self) -> None:
        with self._cond:
            self._open = False

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def allow(self, n: int = 1) -> None:
        """Let ``n`` more forwards through a closed gate."""
        with self._cond:
            self._credits += n
            self._cond.notify_all()

    def wait_turn(self) -> None:
        """Called by the model at each forward (engine thread)."""
        with self._cond:
            while not self._open and self._credits == 0:
                self.blocked = True
                self._cond.wait()
            self.blocked = False
            if not self._open:
                self._credits -= 1
            self.passed += 1

    def __enter__(self) -> StepGate:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.open()


class GatedModel(nn.Module):
    """A causal LM whose every forward first waits at a :class:`StepGate`.

    Args:
        model: The model to wrap (its config, dtype and device are passed through).
        gate: The gate; a new open one by default.
    """

    def __init__(self, model: nn.Module, gate: StepGate | None = None) -> None:
        super().__init__()
        self.inner = model
        self.config = model.config
        self.gate = gate or StepGate()

    @property
    def dtype(self) -> torch.dtype:
        return cast(torch.dtype, self.inner.dtype)

    @property
    def device(self) -> torch.device:
        return cast(torch.device, self.inner.device)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.gate.wait_turn()
        return self.inner(*args, **kwargs)

    def forward_paged(self, *args: Any, **kwargs: Any) -> Any:
        self.gate.wait_turn()
        return self.inner.forward_paged(*args, **kwargs)  # type: ignore[operator]


@dataclass
class Stream:
    """What a client saw of one streamed request."""

    status: int | None = None
    headers: dict[str, str] = field(default_factory=dict)
    error: dict[str, Any] | None = None  # the JSON body of a refused request
    events: list[SSEEvent] = field(default_factory=list)
    ended: bool = False

    def named(self, name: str) -> list[dict[str, Any]]:
        return [e.json() for e in self.events if e.event == name]

    def terminals(self) -> list[str]:
        return [e.event for e in self.events if e.event in ("done", "error")]

    def text(self) -> str:
        return "".join(t["token"] for t in self.named("token"))


# The prompt and native request body the server tests share.
PROMPT = "The quick brown fox jumps over the lazy dog"


def native(max_tokens: int, prompt: str = PROMPT, **extra: Any) -> dict[str, Any]:
    """A greedy ``/v1/generate`` body."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0} | extra


async def read_stream(client: httpx.AsyncClient, path: str, body: dict, out: Stream) -> None:
    """POST and record the status, then every event until the server ends the stream."""
    async with client.stream("POST", path, json=body) as r:
        out.status, out.headers = r.status_code, dict(r.headers)
        if r.status_code != 200:
            out.error = json.loads(await r.aread())
        else:
            async for event in iter_sse(r):
                out.events.append(event)
    out.ended = True


async def metrics(client: httpx.AsyncClient, model: str | None = None) -> dict[str, float]:
    """The server's ``/metrics`` as ``{name{labels}: value}`` (see :func:`parse_metrics`)."""
    return parse_metrics((await client.get("/metrics")).text, model)


_MODEL_LABEL = re.compile(r'model="((?:[^"\\]|\\.)*)",?')


def parse_metrics(text: str, model: str | None = None) -> dict[str, float]:
    """Prometheus text exposition as ``{name{labels}: value}``, without the ``model`` label
    every series carries: ``model``'s series, or (``None``) every model's summed, as
    ``sum without (model)`` would (on a server of one model, its own)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        label = _MODEL_LABEL.search(key)
        if model is not None and (label is None or label.group(1) != model):
            continue
        if label is not None:
            key = (key[: label.start()] + key[label.end() :]).replace(",}", "}").replace("{}", "")
        values[key] = values.get(key, 0.0) + float(value)
    return values


async def step_until(
    gate: StepGate, done: Callable[[], Awaitable[bool] | bool], max_steps: int = 100
) -> int:
    """Let single engine steps through a closed gate until ``done``; return how many."""
    steps = 0
    while True:
        result = done()
        if not isinstance(result, bool):
            result = await result
        if result:
            return steps
        if steps >= max_steps:
            raise AssertionError(f"condition not reached in {max_steps} steps")
        await step_once(gate)
        steps += 1


async def step_once(gate: StepGate) -> None:
    """Let one engine step through a closed gate and wait until the next one is held.

    The step's outputs have left the engine then, but a client may not have read them yet.
    """
    before = gate.passed
    gate.allow(1)
    await wait_for(partial(_passed_and_blocked, gate, before))


def _passed_and_blocked(gate: StepGate, before: int) -> bool:
    return gate.passed > before and gate.blocked


async def step_until_idle(gate: StepGate, idle: Callable[[], bool], max_steps: int) -> int:
    """Let single steps through a closed gate until ``idle`` (the engine stops asking for
    forwards, so the gate cannot tell when a step has ended); return how many.

    Raises:
        AssertionError: Still not idle after ``max_steps`` steps.
    """
    for steps in range(max_steps + 1):
        if idle():
            return steps
        if steps == max_steps:
            break
        before = gate.passed
        gate.allow(1)
        await wait_for(partial(_idle_or_stepped, idle, gate, before))
    raise AssertionError(f"still running after {max_steps} steps")


def _idle_or_stepped(idle: Callable[[], bool], gate: StepGate, before: int) -> bool:
    return idle() or _passed_and_blocked(gate, before)


@contextmanager
def server_thread(app: QuartTrio, graceful_timeout_s: float = 5.0) -> Iterator[str]:
    """Serve ``app`` from its own trio loop in a background thread (for synchronous tests,
    such as hypothesis ones, that send many requests to one server).

    Yields:
        The server's URL. Leaving the block drains the app and waits for the thread.
    """
    urls: list[str] = []
    ready = threading.Event()
    control: dict[str, Any] = {}

    async def main() -> None:
        control["token"], control["stop"] = trio.lowlevel.current_trio_token(), trio.Event()
        async with running_server(app, graceful_timeout_s) as server:
            urls.append(server.url)
            ready.set()
            await control["stop"].wait()

    thread = threading.Thread(target=trio.run, args=(main,), name="test-server")
    thread.start()
    try:
        if not ready.wait(timeout=120):
            raise RuntimeError("the server did not start")
        yield urls[0]
    finally:
        if "stop" in control:
            trio.from_thread.run_sync(control["stop"].set, trio_token=control["token"])
        thread.join(timeout=120)
