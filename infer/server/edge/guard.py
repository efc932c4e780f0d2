"""An ASGI wrapper around the app: what must happen when a request ends, however it ends.

**Cleanup.** Code handling a request registers callbacks with :func:`on_request_end`; they
run when the ASGI call for that request returns, whether the response was sent, failed, or
was cancelled by a client disconnect, and whether or not its body was ever iterated.

**Unread bodies.** When the app answers before it has read the whole request body (413 for
a body over the limit, 401 before a body is looked at), two things go wrong under
Hypercorn's trio worker:

- Hypercorn only recycles a keep-alive connection once the client has sent its whole
  request; until then the next request on the connection waits, unanswered.
- Quart-trio cancels the request's task as soon as Hypercorn reports the stream closed,
  which happens *inside* the app's last ``send``; that cancellation lands in the middle of
  Hypercorn closing the socket, so the connection is neither recycled nor closed.

So before the last ``send`` of such a response, the wrapper waits (bounded in bytes and time)
for the rest of the body, which Quart's own receiver reads and throws away; then the
connection is recycled normally. A body that goes on past the bound, or a client that stalls
mid-body, gets ``Connection: close`` instead. The last ``send`` is shielded from the
cancellation either way, so Hypercorn always finishes what it does at the end of a response;
for at most ``DISCARD_WAIT_S``: on an HTTP/2 connection that has closed, the last send waits
for a send task that no longer runs, and only a cancellation ends it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import trio

log = logging.getLogger("infer.server")

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[..., Awaitable[None]]

# How much of an unread body is received and discarded, and for how long, before the
# connection is closed instead.
DISCARD_LIMIT_BYTES = 64 * 1024 * 1024
DISCARD_WAIT_S = 5.0

_CLEANUP_KEY = "infer.on_request_end"


def on_request_end(scope: MutableMapping[str, Any], callback: Callable[[], None]) -> None:
    """Run ``callback`` (synchronous, quick) when the request of ``scope`` ends.

    Args:
        scope: The request's ASGI scope (``quart.request.scope``).
        callback: Called once, in the request's task, after the app's ASGI call returns.
    """
    scope.setdefault(_CLEANUP_KEY, []).append(callback)


class RequestGuard:
    """Wrap an ASGI app (``app.asgi_app = RequestGuard(app.asgi_app)``).

    Args:
        app: The ASGI callable to wrap.
        discard_limit_bytes: Most unread body bytes to receive and drop before closing.
        discard_wait_s: Longest to wait for the rest of the body before closing.
    """

    def __init__(
        self,
        app: ASGIApp,
        discard_limit_bytes: int = DISCARD_LIMIT_BYTES,
        discard_wait_s: float = DISCARD_WAIT_S,
    ) -> None:
        self.app = app
        self.discard_limit_bytes = discard_limit_bytes
        self.discard_wait_s = discard_wait_s

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(receive, send, self.discard_limit_bytes, self.discard_wait_s)
        try:
            await self.app(scope, exchange.receive, exchange.send)
        finally:
            _run_cleanup(scope)


def _run_cleanup(scope: MutableMapping[str, Any]) -> None:
    for callback in scope.pop(_CLEANUP_KEY, ()):
        try:
            callback()
        except Exception:  # noqa: BLE001 - one failing callback must not skip the others
            log.exception("request cleanup failed")


class _Exchange:
    """One request's receive and send, watching how much of the body has arrived."""

    def __init__(self, receive: Receive, send: Send, limit: int, wait_s: float) -> None:
        self._receive = receive
        self._send = send
        self._limit = limit
        self._wait_s = wait_s
        self._body_done = trio.Event()
        self._received = 0
        self._started: Message | None = None

    async def receive(self) -> Message:
        message = await self._receive()
        if message["type"] == "http.request":
            self._received += len(message.get("body", b""))
            if not message.get("more_body", False):
                self._body_done.set()
        elif message["type"] == "http.disconnect":
            self._body_done.set()
        if self._received > self._limit:
            self._body_done.set()  # stop waiting; the response will close the connection
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and not self._body_done.is_set():
            self._started = message  # held until we know whether to add Connection: close
            return
        last = message["type"] == "http.response.body" and not message.get("more_body", False)
        if last and not self._body_done.is_set():
            with trio.move_on_after(self._wait_s):
                await self._body_done.wait()
        await self._flush_start(close=last and not self._complete)
        if last:
            # Shielded, but bounded: see the module docstring.
            with trio.CancelScope(shield=True, deadline=trio.current_time() + self._wait_s):
                await self._send(message)
        else:
            await self._send(message)

    @property
    def _complete(self) -> bool:
        return self._body_done.is_set() and self._received <= self._limit

    async def _flush_start(self, close: bool) -> None:
        if self._started is None:
            return
        start, self._started = self._started, None
        if close:
            headers = [h for h in start.get("headers", []) if h[0].lower() != b"connection"]
            start = {**start, "headers": [*headers, (b"connection", b"close")]}
        await self._send(start)
