"""Server-sent events: framing, heartbeats and the streaming response.

An event is ``event: <name>`` (optional) and one ``data:`` line of compact JSON, ended by a
blank line. JSON never holds a raw newline, so one data line always suffices. A heartbeat is
a comment line, which every SSE client (``EventSource``, the ``openai`` client) ignores.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from quart import Response

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


def stream_response(body: AsyncIterator[bytes]) -> Response:
    """A ``text/event-stream`` response with no timeout, sent as ``body`` yields.

    Args:
        body: Async iterator of already framed events.

    Returns:
        The response; Quart streams it chunk by chunk.
    """
    response = Response(body, status=200, content_type="text/event-stream")
    response.headers.update(HEADERS)
    response.timeout = None  # a stream runs as long as generation does
    return response
