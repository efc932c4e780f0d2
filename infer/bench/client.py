"""The HTTP load generator: streams requests to a server and timestamps every token event.

Two stream dialects: ``native`` (infer's ``POST /v1/generate``: ``token`` events, then one
``done`` or ``error``) and ``openai`` (``POST /v1/completions`` with ``stream: true``: ``data:``
chunks, then ``data: [DONE]``), which is how llama.cpp's and vLLM's servers are measured.
Either way the prompt goes out as token ids, exactly the workload's.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import trio

from infer.bench.metrics import RequestResult
from infer.bench.sse import SSEEvent, SSEParser
from infer.bench.workloads import BenchRequest, Workload

ROUTES = {"native": "/v1/generate", "openai": "/v1/completions"}


@dataclass(frozen=True)
class Target:
    """A server to measure.

    Args:
        url: Base URL, e.g. ``http://127.0.0.1:8000``.
        api: ``native`` or ``openai`` (see the module docstring).
        extra: Fields added to every request body (``ignore_eos``, ``repeat_penalty``).
        predictions: Send each request's ``prediction`` (when it has one) as OpenAI's
            Predicted Outputs: ``{"type": "content", "content": text}``.
    """

    url: str
    api: str = "native"
    extra: dict[str, Any] = field(default_factory=dict)
    predictions: bool = False

    def body(self, request: BenchRequest) -> dict[str, Any]:
        """The JSON body of ``request`` for this server."""
        body: dict[str, Any] = {
            "prompt": list(request.prompt_ids),
            "max_tokens": request.max_new_tokens,
            "temperature": 0.0,
        }
        if self.predictions and request.prediction is not None:
            body["prediction"] = {"type": "content", "content": request.prediction}
        if self.api == "openai":
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body | self.extra


class _StreamState:
    """Turns a request's SSE events into timestamps on its :class:`RequestResult`."""

    def __init__(self, api: str, result: RequestResult) -> None:
        self.api = api
        self.result = result
        self.finished = False

    def on_event(self, event: SSEEvent, now: float) -> None:
        if self.api == "native":
            self._native(event, now)
        else:
            self._openai(event, now)

    def _native(self, event: SSEEvent, now: float) -> None:
        r = self.result
        if event.event == "token":
            r.token_times.append(now)
            r.output_tokens += 1
        elif event.event == "done":
            usage = json.loads(event.data).get("usage") or {}
            r.output_tokens = usage.get("completion_tokens", r.output_tokens)
            r.end, self.finished = now, True
        elif event.event == "error":
            error = json.loads(event.data)
            r.error = str(error.get("code") or "ERROR")
            r.end, self.finished = now, True
        # started, metrics, trace: nothing to time

    def _openai(self, event: SSEEvent, now: float) -> None:
        r = self.result
        if event.data.strip() == "[DONE]":
            r.end, self.finished = now, True
            return
        chunk = json.loads(event.data)
        if "error" in chunk:
            r.error = str((chunk["error"] or {}).get("code") or "ERROR")
            r.end, self.finished = now, True
            return
        for choice in chunk.get("choices") or []:
            if choice.get("text"):
                r.token_times.append(now)
                r.output_tokens += 1
        usage = chunk.get("usage")
        if usage and "completion_tokens" in usage:
            r.output_tokens = usage["completion_tokens"]


async def stream_request(
    client: httpx.AsyncClient, target: Target, request: BenchRequest
) -> RequestResult:
    """Send one request, read its stream to the end, and return its timestamps."""
    result = RequestResult(
        time.perf_counter(),
        prompt_tokens=len(request.prompt_ids),
        expected_tokens=request.max_new_tokens,
        label=request.label,
    )
    state = _StreamState(target.api, result)
    parser = SSEParser()
    try:
        url = target.url.rstrip("/") + ROUTES[target.api]
        async with client.stream("POST", url, json=target.body(request)) as response:
            if response.status_code != 200:
                await response.aread()
                result.error, result.end = f"HTTP_{response.status_code}", time.perf_counter()
                return result
            async for chunk in response.aiter_bytes():
                now = time.perf_counter()
                for event in parser.feed(chunk):
                    state.on_event(event, now)
                if state.finished:
                    break
    except httpx.HTTPError as e:
        result.error = type(e).__name__
    except (ValueError, KeyError, AttributeError):  # a malformed event
        result.error = "BAD_STREAM"
    if not state.finished and result.error is None:
        result.error = "INCOMPLETE"  # the stream ended without its terminal event
    if result.end is None:
        result.end = time.perf_counter()
    return result


async def run_workload(
    target: Target,
    workload: Workload,
    on_done: Callable[[RequestResult], None] | None = None,
    seed: int = 0,
    timeout_s: float = 900.0,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[RequestResult]:
    """Offer a workload's requests to a server and collect what each measured.

    At most ``workload.concurrency`` requests are in flight; with ``workload.rate`` each
    request is sent at its Poisson arrival time (or, when all streams are busy, as soon as
    one frees), else as soon as a stream is free.

    Args:
        target: The server.
        workload: The requests and how to offer them.
        on_done: Called with each finished request (progress bars).
        seed: Seed of the arrival times.
        timeout_s: Read timeout of a stream (a silent stream longer than this fails).
        transport: httpx transport to use instead of the network (tests).
    """
    results: list[RequestResult | None] = [None] * len(workload.requests)
    limiter = trio.CapacityLimiter(workload.concurrency)
    arrivals = random.Random(f"arrivals/{seed}")
    timeout = httpx.Timeout(timeout_s, connect=30.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=workload.concurrency)

    async def one(i: int, request: BenchRequest, client: httpx.AsyncClient) -> None:
        try:
            result = results[i] = await stream_request(client, target, request)
            if on_done is not None:
                on_done(result)
        finally:
            limiter.release_on_behalf_of(i)

    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        async with trio.open_nursery() as nursery:
            next_arrival = trio.current_time()
            for i, request in enumerate(workload.requests):
                if workload.rate:
                    next_arrival += arrivals.expovariate(workload.rate)
                    await trio.sleep_until(next_arrival)
                await limiter.acquire_on_behalf_of(i)
                nursery.start_soon(one, i, request, client)
    return [r for r in results if r is not None]


async def probe(target: Target, request: BenchRequest) -> tuple[int, str]:
    """Send one request without streaming it; return its status and body (warm-up, checks)."""
    url = target.url.rstrip("/") + ROUTES[target.api]
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0)) as client:
        response = await client.post(url, json=target.body(request))
        return response.status_code, response.text
