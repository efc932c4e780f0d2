"""How events go on the wire: server-sent events or newline-delimited JSON, and the streaming
response that carries them.

An SSE event is ``id:`` and ``event: <name>`` (each optional) and one ``data:`` line of
compact JSON, ended by a blank line. JSON never holds a raw newline, so one data line always
suffices. A heartbeat is a comment line, which every SSE client (``EventSource``, the
``openai`` client) ignores, or an event where a protocol names one (Anthropic's ``ping``).
An NDJSON event is its JSON on one line; it has no names, ids or heartbeats.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from quart import Response

from infer.api.writer import Event

HEARTBEAT = b": keep-alive\n\n"
DONE = b"data: [DONE]\n\n"
HEADERS = {
    "Cache-Control": "no-cache, no-transform",
    "X-Accel-Buffering": "no",
}


def dumps(data: Any) -> str:
    """Compact JSON with non-ASCII text left as UTF-8."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def event(data: Any, name: str | None = None, seq: int | None = None) -> bytes:
    """One SSE event.

    Args:
        data: JSON-serializable payload.
        name: The ``event:`` field; ``None`` leaves it out (OpenAI chunks).
        seq: The ``id:`` field (a native stream's event number); ``None`` leaves it out.

    Returns:
        The event's bytes, blank line included.
    """
    head = f"event: {name}\n" if name else ""
    if seq is not None:
        head = f"id: {seq}\n{head}"
    return f"{head}data: {dumps(data)}\n\n".encode()


def split(blob: bytes) -> list[bytes]:
    """The events of a run of framed ones, each with its blank line (comments left out)."""
    return [
        block + b"\n\n"
        for block in blob.split(b"\n\n")[:-1]
        if block and not block.startswith(b":")
    ]


@dataclass(frozen=True)
class Framing(ABC):
    """One way of putting events on the wire."""

    content_type: str
    heartbeat: bytes  # what a quiet stream sends (b"": nothing)

    @abstractmethod
    def frame(self, events: Sequence[Event]) -> bytes:
        """The bytes of ``events``, in order."""


class SSEFraming(Framing):
    def frame(self, events: Sequence[Event]) -> bytes:
        return b"".join(
            f"data: {e.data}\n\n".encode() if e.raw else event(e.data, e.name, e.id) for e in events
        )


class NDJSONFraming(Framing):
    def frame(self, events: Sequence[Event]) -> bytes:
        return b"".join((e.data if e.raw else dumps(e.data)).encode() + b"\n" for e in events)


SSE = SSEFraming("text/event-stream", HEARTBEAT)
NDJSON = NDJSONFraming("application/x-ndjson", b"")


def sse_with_heartbeat(heartbeat: Event) -> Framing:
    """SSE whose heartbeat is ``heartbeat``, an event, rather than a comment."""
    return SSEFraming(SSE.content_type, SSE.frame([heartbeat]))


def stream_response(body: AsyncIterator[bytes], framing: Framing = SSE) -> Response:
    """A streaming response with no timeout, sent as ``body`` yields.

    Args:
        body: Async iterator of already framed events.
        framing: How they are framed (its content type).

    Returns:
        The response; Quart streams it chunk by chunk.
    """
    response = Response(body, status=200, content_type=framing.content_type)
    response.headers.update(HEADERS)
    response.timeout = None  # a stream runs as long as generation does
    return response
