"""How every route reads its request's stream: one consumer, one terminal rule.

A route admits its request and hands the :class:`~infer.server.stream.RequestStream` to a
:class:`Writer` for its API (OpenAI chunks, native events, Responses events), then calls
:func:`respond`. Streamed or not, the same loop (:func:`frames`) reads the stream and asks
the writer for what each output becomes. It ends with exactly one terminal:

- every choice ended without an error: :meth:`Writer.finish`;
- a choice ended with an error (the others are aborted with the stream), or the server
  failed while writing (logged): :meth:`Writer.fail`.

A non-streamed response is that loop run to its end without heartbeats: its body is
:meth:`Writer.body`, or the failure is raised as the :class:`APIError` that answers it.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from quart import Response, jsonify

from infer.engine.request import Failure, StepOutput
from infer.server import sse
from infer.server.errors import APIError, ErrorCode
from infer.server.stream import RequestStream

log = logging.getLogger("infer.server")


class Writer(ABC):
    """What one API makes of a request's outputs (framed SSE bytes, or a whole body).

    Args:
        stream: The request's stream.
        streamed: Whether the client reads events (else one body is built).
    """

    def __init__(self, stream: RequestStream, streamed: bool) -> None:
        self.stream = stream
        self.streamed = streamed
        self.failure: APIError | None = None

    def start(self) -> bytes:
        """What goes out before any output."""
        return b""

    def is_error(self, out: StepOutput) -> bool:
        """Whether this output ends its choice with an error."""
        return isinstance(out.outcome, Failure)

    @abstractmethod
    async def output(self, index: int, out: StepOutput) -> bytes:
        """What one output of choice ``index`` becomes (not an error: :meth:`is_error`)."""

    @abstractmethod
    async def finish(self) -> bytes:
        """The terminal after every choice ended without an error."""

    def fail(self, error: APIError) -> bytes:
        """The terminal of a request that failed (kept to answer a non-streamed request)."""
        self.failure = error
        return self.failed(error)

    @abstractmethod
    def failed(self, error: APIError) -> bytes:
        """The terminal event of a failure."""

    def body(self) -> Any:
        """The whole response of a non-streamed request that did not fail."""
        raise NotImplementedError(f"{type(self).__name__} only streams")


async def frames(writer: Writer, heartbeat_s: float) -> AsyncGenerator[bytes, None]:
    """Framed events until the one terminal; a heartbeat after ``heartbeat_s`` of silence.

    Leaving early (a client that went away, a body never read) aborts the choices that
    have not ended.
    """
    stream = writer.stream
    with stream:
        yield writer.start()
        while True:
            try:
                item = await stream.next(heartbeat_s)
                if item is None:
                    yield sse.HEARTBEAT
                    continue
                index, out = item
                if writer.is_error(out):
                    assert isinstance(out.outcome, Failure)  # is_error says so
                    yield writer.fail(APIError(ErrorCode.of(out.outcome), out.message))
                    return
                data = await writer.output(index, out)
                if stream.finished:
                    data += await writer.finish()
            except Exception:  # noqa: BLE001 - the stream must still end with one terminal
                log.exception("stream %s failed", stream.id)
                stream.fail()
                yield writer.fail(APIError(ErrorCode.INFERENCE_FAILED))
                return
            yield data
            if stream.finished:
                return


async def respond(writer: Writer, heartbeat_s: float) -> Response:
    """The event stream, or the whole body once every choice has ended.

    Raises:
        APIError: A non-streamed request failed (its code gives the status).
    """
    if writer.streamed:
        return sse.stream_response(frames(writer, heartbeat_s))
    async with aclosing(frames(writer, math.inf)) as reading:
        async for _ in reading:
            pass
    if writer.failure is not None:
        raise writer.failure
    return jsonify(writer.body())
