"""Resumable, idempotent native streams: ``/v1/generate`` with a client ``request_id``.

Every event of a native stream carries an SSE ``id:`` (its sequence number in the request,
from 0). With a ``request_id`` the generation does not belong to one connection: a producer
task in the app's nursery reads it into an event log, and connections *read* that log. A
client that disconnects leaves the request running for ``resume_window_s``; a POST with the
same ``request_id`` and body replays the events after its ``Last-Event-ID`` and continues
live, so the text read across connections equals an uninterrupted run's, with one terminal.
A second reader takes over from a first one still open (the first ends ``SUPERSEDED``); the
same ``request_id`` with another body is a 409 while it is known. Once no reader has been
attached for the window, a running request is aborted and a finished one forgotten.
``DELETE /v1/generate/<request_id>`` stops it at once: its log ends with a ``stopped`` error.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import trio

from infer.api.errors import APIError, ErrorCode
from infer.api.native import bodies as native
from infer.server.edge import framing as sse


def fingerprint(body: Any) -> str:
    """What makes two POSTs with one ``request_id`` the same request: the validated body."""
    dumped = json.dumps(body.model_dump(mode="json"), sort_keys=True, default=str)
    return hashlib.sha256(dumped.encode()).hexdigest()


def _error(code: ErrorCode, seq: int | None = None) -> bytes:
    return sse.event(*native.error(code.name, code.message, code.retryable, None), seq)


SUPERSEDED = _error(ErrorCode.SUPERSEDED)
TERMINAL_EVENTS = (b"event: done\n", b"event: error\n")


class ResumableStream:
    """One request's event log and who reads it.

    Args:
        request_id: The client's id.
        key: :func:`fingerprint` of its body.
        window_s: How long it outlives its last reader.
        heartbeat_s: Quiet time after which a reader gets a heartbeat.
    """

    def __init__(self, request_id: str, key: str, window_s: float, heartbeat_s: float) -> None:
        self.request_id = request_id
        self.key = key
        self.window_s = window_s
        self.heartbeat_s = heartbeat_s
        self.events: list[bytes] = []  # index = event id
        self.finished = False
        self.stopped = False
        self.expires_at = trio.current_time() + window_s  # until the first reader attaches
        self.producer = trio.CancelScope()
        self._reader: object | None = None
        self._changed = trio.Event()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def produce(self, source: AsyncIterator[bytes]) -> None:
        """Read the generation's events into the log (cancelled: the request is aborted).

        The source numbers its events from 0, so an event's place in the log is its id.
        """
        with self.producer:
            async for blob in source:
                self.events += sse.split(blob)
                self._notify()
        if self.stopped and not self._ended():
            self.events.append(_error(ErrorCode.STOPPED, len(self.events)))
        self.finished = True
        self._notify()

    def stop(self) -> None:
        """Abort the request now; the log ends with a ``stopped`` error (unless it had ended)."""
        self.stopped = True
        self.producer.cancel()

    def _ended(self) -> bool:
        return bool(self.events) and any(tag in self.events[-1] for tag in TERMINAL_EVENTS)

    async def read(self, after: int) -> AsyncIterator[bytes]:
        """The events after id ``after``, then live ones, until the end or a takeover."""
        token = object()
        self._reader = token
        self._notify()  # a reader already attached sees it is superseded
        position = after + 1
        try:
            while True:
                if self._reader is not token:
                    yield SUPERSEDED
                    return
                if position < len(self.events):
                    # Take the slice before yielding: the producer appends while we are
                    # suspended in the yield, and those events must not be skipped.
                    pending = self.events[position:]
                    position += len(pending)
                    yield b"".join(pending)
                elif self.finished:
                    return
                elif not await self._wait(self.heartbeat_s):
                    yield sse.HEARTBEAT
        finally:
            if self._reader is token:
                self._reader = None
                self.expires_at = trio.current_time() + self.window_s
                self._notify()

    async def _wait(self, timeout_s: float) -> bool:
        changed = self._changed
        with trio.move_on_after(timeout_s):
            await changed.wait()
            return True
        return False

    async def expire(self) -> None:
        """Return once no reader has been attached for the window."""
        while self._reader is not None or trio.current_time() < self.expires_at:
            deadline = math.inf if self._reader is not None else self.expires_at
            changed = self._changed
            with trio.move_on_at(deadline):
                await changed.wait()


class ResumeRegistry:
    """The resumable requests a server knows, by ``request_id``."""

    def __init__(self, window_s: float, heartbeat_s: float) -> None:
        self.window_s = window_s
        self.heartbeat_s = heartbeat_s
        self._streams: dict[str, ResumableStream] = {}
        self._scopes: set[trio.CancelScope] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self._streams)

    def find(self, request_id: str, key: str) -> ResumableStream | None:
        """The known request with this id, or ``None``.

        Raises:
            APIError: 409 ``request_id_conflict``, the id is known with another body.
        """
        stream = self._streams.get(request_id)
        if stream is not None and stream.key != key:
            raise APIError(
                ErrorCode.REQUEST_ID_CONFLICT,
                f"request_id {request_id!r} is in use by another request",
            )
        return stream

    def open(
        self, nursery: trio.Nursery, request_id: str, key: str, source: AsyncIterator[bytes]
    ) -> ResumableStream:
        """Start producing ``source`` (the native event stream, ids from 0) under ``request_id``."""
        stream = ResumableStream(request_id, key, self.window_s, self.heartbeat_s)
        self._streams[request_id] = stream
        nursery.start_soon(self._run, stream, source)
        return stream

    async def _run(self, stream: ResumableStream, source: AsyncIterator[bytes]) -> None:
        scope = trio.CancelScope()
        self._scopes.add(scope)
        if self._closed:
            scope.cancel()
        try:
            with scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(stream.produce, source)
                    await stream.expire()
                    stream.producer.cancel()  # aborts the request if it still runs
        finally:
            self._scopes.discard(scope)
            if self._streams.get(stream.request_id) is stream:
                del self._streams[stream.request_id]

    def stop(self, request_id: str) -> None:
        """Stop the request ``request_id`` (its readers get the terminal ``stopped`` error).

        Raises:
            APIError: 404 ``request_not_found``, no such request is known.
        """
        stream = self._streams.get(request_id)
        if stream is None:
            raise APIError(ErrorCode.REQUEST_NOT_FOUND, f"no request {request_id!r} is known")
        stream.stop()

    def close(self) -> None:
        """Stop every producer and forget every request (at shutdown, after the drain)."""
        self._closed = True
        for scope in self._scopes:
            scope.cancel()


def last_event_id(header: str | None) -> int:
    """The ``Last-Event-ID`` header as an event id; -1 (replay everything) when absent.

    Raises:
        APIError: 400, the header is not a non-negative integer.
    """
    if header is None or not header.strip():
        return -1
    try:
        value = int(header.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise APIError(ErrorCode.INVALID_LAST_EVENT_ID)
    return value
