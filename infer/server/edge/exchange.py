"""One HTTP exchange: the body in (:func:`parse_body`), the answer out (:func:`respond`).

:func:`parse_body` validates the JSON body against its protocol's model (the only place
input is checked). :func:`answer` admits the engine request it became and answers with the
protocol's writer: :func:`respond` streams the request's events in its framing, or, for a
client that does not stream, runs the same relay to its end and answers the writer's body
(or raises the failure as the :class:`APIError` that answers it).
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Callable, MutableMapping
from contextlib import aclosing
from typing import Any, TypeVar, cast

from pydantic import BaseModel, ValidationError
from quart import Response, jsonify, request

from infer.api.engine_request import EngineRequest
from infer.api.errors import APIError, ErrorCode
from infer.api.writer import Ticket, Writer
from infer.server.edge.framing import SSE, Framing, stream_response
from infer.server.edge.guard import on_request_end
from infer.server.host.admission import admit
from infer.server.host.relay import relay
from infer.server.host.state import get_state
from infer.server.host.stream import RequestStream

Body = TypeVar("Body", bound=BaseModel)


async def parse_body(model: type[Body]) -> Body:
    """Read and validate the JSON body of the current request.

    Raises:
        APIError: ``INVALID_JSON`` for malformed JSON or a body that is not an object,
            ``INVALID_VALUE`` for fields that fail validation (unknown fields included);
            ``BODY_TOO_LARGE`` comes from the body limit.
    """
    raw = await request.get_data(as_text=False)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(ErrorCode.INVALID_JSON, f"malformed JSON body: {e}") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise APIError(ErrorCode.INVALID_JSON, "the JSON body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(ErrorCode.INVALID_JSON, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise APIError(ErrorCode.INVALID_VALUE, validation_message(e)) from None


def validation_message(error: ValidationError) -> str:
    """A one-line summary of pydantic's errors, named by the client's field names."""
    parts = []
    for err in error.errors()[:3]:
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown field {loc!r}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def at_request_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current HTTP request ends, however it ends."""
    on_request_end(cast(MutableMapping[str, Any], request.scope), callback)


async def answer(
    request: EngineRequest,
    arrival: float,
    writer: Callable[[Ticket], Writer],
    framing: Framing = SSE,
) -> Response:
    """Admit ``request`` and answer it with the writer its protocol builds for it.

    Args:
        request: The engine request the body became.
        arrival: ``trio.current_time()`` when the HTTP request arrived.
        writer: Builds the protocol's writer from what admission settled.
        framing: How a stream's events go on the wire.
    """
    state = get_state()
    admitted = await admit(state, request, arrival, at_request_end)
    answer = writer(admitted.ticket)
    return await respond(admitted.stream, answer, state.config.heartbeat_s, framing)


async def frames(
    stream: RequestStream, writer: Writer, heartbeat_s: float, framing: Framing = SSE
) -> AsyncIterator[bytes]:
    """The request's events framed, a heartbeat after ``heartbeat_s`` of silence."""
    async with aclosing(relay(stream, writer, heartbeat_s)) as events:
        async for batch in events:
            if batch is not None:
                yield framing.frame(batch)
            elif framing.heartbeat:
                yield framing.heartbeat


async def respond(
    stream: RequestStream, writer: Writer, heartbeat_s: float, framing: Framing = SSE
) -> Response:
    """The event stream, or the whole body once every choice has ended.

    Raises:
        APIError: A non-streamed request failed (its code gives the status).
    """
    if writer.streamed:
        return stream_response(frames(stream, writer, heartbeat_s, framing), framing)
    async with aclosing(relay(stream, writer, math.inf)) as reading:
        async for _ in reading:
            pass
    if writer.failure is not None:
        raise writer.failure
    return jsonify(writer.body(stream.counts()))
