"""How every route reads its request's stream: one consumer, one terminal rule.

A route admits its request and hands the :class:`~infer.server.host.stream.RequestStream`
with its protocol's :class:`~infer.api.writer.Writer` to :func:`relay`, which reads the
stream and asks the writer what each output becomes. It ends with exactly one terminal:

- every choice ended without an error: :meth:`Writer.finish`;
- a choice ended with an error (the others are aborted with the stream), or the server
  failed while writing (logged): :meth:`Writer.fail`.

Work a writer asks for (its :data:`~infer.api.writer.Job`) runs in a thread, never on the
event loop.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator

import trio

from infer.api.errors import APIError, ErrorCode
from infer.api.writer import Event, Job, Writer
from infer.engine.request import Failure
from infer.server.host.stream import RequestStream

log = logging.getLogger("infer.server")


async def relay(
    stream: RequestStream, writer: Writer, heartbeat_s: float
) -> AsyncGenerator[list[Event] | None, None]:
    """The writer's events until the one terminal; ``None`` after ``heartbeat_s`` of silence.

    Leaving early (a client that went away, a body never read) aborts the choices that
    have not ended.
    """
    with stream:
        try:
            await _run(writer.start_work())
            yield writer.start()
        except Exception:  # noqa: BLE001 - the stream must still end with one terminal
            yield _failed(stream, writer)
            return
        while True:
            try:
                item = await stream.next(heartbeat_s)
                if item is None:
                    yield None
                    continue
                index, out = item
                if writer.is_error(out):
                    assert isinstance(out.outcome, Failure)  # is_error says so
                    error = APIError(ErrorCode.of(out.outcome), out.message)
                    yield writer.fail(error, stream.counts())
                    return
                await _run(writer.work(index, out))
                events = writer.output(index, out)
                if stream.finished:
                    await _run(writer.finish_work())
                    events += writer.finish(stream.counts())
            except Exception:  # noqa: BLE001 - the stream must still end with one terminal
                yield _failed(stream, writer)
                return
            yield events
            if stream.finished:
                return


def _failed(stream: RequestStream, writer: Writer) -> list[Event]:
    log.exception("stream %s failed", stream.id)
    stream.fail()
    return writer.fail(APIError(ErrorCode.INFERENCE_FAILED), stream.counts())


async def _run(job: Job | None) -> None:
    if job is not None:
        await trio.to_thread.run_sync(job)
