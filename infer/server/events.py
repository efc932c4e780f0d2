"""``POST /v1/generate``: the native event stream.

``started`` → (``token`` [``trace``])* with ``metrics`` every N tokens → exactly one of
``done`` or ``error``. A comment heartbeat goes out whenever the stream has been quiet for
``heartbeat_s``. Output coalesced for a slow reader arrives as one ``token`` event carrying
several tokens' text (``count`` > 1, ``i`` the index of the last one).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, cast

import trio
from quart import Blueprint, Response, current_app, request
from quart_trio import QuartTrio

from infer.engine.request import StepOutput, TraceSpec
from infer.server import resume, sse
from infer.server.errors import APIError
from infer.server.generation import (
    RETRYABLE,
    Generation,
    Submission,
    outcome,
    parse_body,
    start,
)
from infer.server.schemas import GenerateRequest
from infer.server.state import ServerState, get_state
from infer.server.structured import compile_format

log = logging.getLogger("infer.server")

blueprint = Blueprint("events", __name__)

DEFAULT_MAX_TOKENS = 256

@blueprint.post("/v1/generate")
async def generate() -> Response:
    """Start a generation and stream its events (or resume one, given its ``request_id``)."""
    arrival = trio.current_time()
    state = get_state()
    body = await parse_body(GenerateRequest)
    if body.request_id is not None:
        return await _resumable(state, body, arrival)
    gen = await start(state, await _submission(state, body), arrival)
    return sse.stream_response(_events(gen, body.metrics_every))


async def _submission(state: ServerState, body: GenerateRequest) -> Submission:
    trace = TraceSpec(body.trace.top_k, body.trace.layer) if body.trace else None
    grammar = await compile_format(state, body)
    return Submission(body.prompt, body.messages, body, body.max_tokens, DEFAULT_MAX_TOKENS,
                      trace=trace, timeout_s=body.timeout_s, grammar=grammar)


async def _resumable(state: ServerState, body: GenerateRequest, arrival: float) -> Response:
    """Read the request ``body.request_id`` names, starting it if it is not known yet."""
    assert body.request_id is not None  # checked by the caller
    key = resume.fingerprint(body)
    after = resume.last_event_id(request.headers.get("Last-Event-ID"))
    stream = state.resumable.find(body.request_id, key)
    if stream is None:
        gen = await start(state, await _submission(state, body), arrival, guard=False)
        try:  # another POST with this id may have started it while we tokenized
            stream = state.resumable.find(body.request_id, key)
        except APIError:
            gen.close()
            raise
        if stream is None:
            nursery = cast(QuartTrio, current_app).nursery  # outlives this HTTP request
            events = _events(gen, body.metrics_every)
            stream = state.resumable.open(nursery, body.request_id, key, events)
            return sse.stream_response(stream.read(after))
        gen.close()
    state.metrics.stream_resumes += 1
    return sse.stream_response(stream.read(after))


async def _events(gen: Generation, metrics_every: int | None) -> AsyncIterator[bytes]:
    """The stream's events, each with its ``id:`` (its number in the stream, from 0)."""
    with gen:
        created = datetime.fromtimestamp(gen.created, UTC).isoformat()
        yield sse.event({"id": gen.request_id, "model": gen.state.model_name,
                         "created": created}, "started", 0)
        seq = 1
        heartbeat_s = gen.state.config.heartbeat_s
        while True:
            try:
                out = await gen.next(heartbeat_s)
                if out is None:
                    yield sse.HEARTBEAT
                    continue
                events = _payloads(gen, out, metrics_every)
            except Exception:  # noqa: BLE001 - the stream must still end with one terminal
                log.exception("stream %s failed", gen.request_id)
                gen.fail()
                yield sse.event({"code": "INFERENCE_FAILED", "message": "inference failed"},
                                "error", seq)
                return
            yield b"".join(sse.event(data, name, seq + i)
                           for i, (data, name) in enumerate(events))
            seq += len(events)
            if gen.finished:
                return


def _payloads(gen: Generation, out: StepOutput, metrics_every: int | None
               ) -> list[tuple[dict[str, Any], str]]:
    """The events (payload, name) for one output, the last one terminal if it finished."""
    events: list[tuple[dict[str, Any], str]] = []
    if gen.new_tokens or out.text_delta:
        token: dict[str, Any] = {"i": gen.tokens - 1, "token": out.text_delta,
                                 "token_id": out.token_id}
        if gen.new_tokens > 1:
            token["count"] = gen.new_tokens
        events.append((token, "token"))
    if out.trace is not None:
        events.append(({"i": gen.tokens - 1, **out.trace}, "trace"))
    if metrics_every and gen.new_tokens and _crossed(gen, metrics_every):
        events.append((_metrics(gen), "metrics"))
    if out.finished:
        end = outcome(out)
        if end.code is None:
            events.append(({"finish_reason": end.finish_reason, "usage": gen.usage()}, "done"))
        else:
            error = {"code": end.code, "message": end.message,
                     "retryable": end.code in RETRYABLE, "usage": gen.usage()}
            events.append((error, "error"))
    return events


def _crossed(gen: Generation, every: int) -> bool:
    """Whether the last output's tokens passed a multiple of ``every``."""
    return gen.tokens // every > (gen.tokens - gen.new_tokens) // every


def _metrics(gen: Generation) -> dict[str, Any]:
    now = trio.current_time()
    first = gen.first_token_at if gen.first_token_at is not None else now
    decode_s = now - first
    rate = (gen.tokens - 1) / decode_s if gen.tokens > 1 and decode_s > 0 else 0.0
    return {"tokens": gen.tokens, "tokens_per_sec": round(rate, 3),
            "ttft_ms": round((first - gen.arrival) * 1000, 3)}
