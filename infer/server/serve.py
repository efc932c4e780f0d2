"""Run the server in this process: Hypercorn's trio worker, drained on SIGINT or SIGTERM.

:func:`serve` is ``hypercorn.trio.serve`` with each connection contained: whatever one
connection raises is logged and ends that connection alone (Hypercorn's own worker lets it
end the whole process), and Hypercorn's close no longer races its own sends (see
:class:`Connection`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState
from hypercorn.utils import repr_socket_addr, wrap_app
from quart_trio import QuartTrio

from infer.engine import residency
from infer.engine.config import EngineConfig
from infer.engine.embed import Embedder
from infer.engine.engine import Engine
from infer.server.app import create_app, drain
from infer.server.config import ServerConfig
from infer.server.host.state import ServerState

log = logging.getLogger("infer.server")

# glibc malloc arenas the server may use (see limit_malloc_arenas).
MALLOC_ARENAS = 2

# After the drain, Hypercorn's own wait for connections to close.
GRACEFUL_TIMEOUT_S = 5.0
# How long an idle keep-alive connection stays open (Hypercorn's default is 5 s: a client
# that pauses longer between requests races the close with its next request).
KEEP_ALIVE_TIMEOUT_S = 75.0


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> bool:
    """Cap glibc's malloc arenas, unless ``MALLOC_ARENA_MAX`` already says how many.

    glibc gives each thread that allocates its own arena (up to 8 per core) and rarely hands
    their free pages back; with the event loop and the engine thread both allocating, the
    resident size kept creeping up round after round of requests (README, Memory). Call it
    before the server starts its threads. A no-op where the C library is not glibc.

    Returns:
        Whether the cap was set.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_ARENA_MAX, arenas))
    except (OSError, AttributeError):
        return False


M_ARENA_MAX = -8  # glibc's mallopt parameter number


def hypercorn_config(
    config: ServerConfig, access_log: bool = False, path: str | None = None
) -> HypercornConfig:
    """Hypercorn settings: ``config``'s one bind and no read timeout (it would cut streams),
    or those of a Hypercorn TOML file.

    Args:
        config: Server settings (host, port).
        access_log: Log one line per request to stderr.
        path: A Hypercorn TOML file (``hypercorn.toml``); its settings, bind included, are
            used as written (``workers`` aside: the engine lives in this one process).

    Returns:
        The Hypercorn config.
    """
    if path is not None:
        return HypercornConfig.from_toml(path)
    hyper = HypercornConfig()
    hyper.bind = [
        f"[{config.host}]:{config.port}" if ":" in config.host else f"{config.host}:{config.port}"
    ]
    hyper.accesslog = "-" if access_log else None
    hyper.errorlog = "-"
    hyper.graceful_timeout = GRACEFUL_TIMEOUT_S
    hyper.keep_alive_timeout = KEEP_ALIVE_TIMEOUT_S
    return hyper


def run(config: ServerConfig, access_log: bool = False, hypercorn_toml: str | None = None) -> int:
    """Load the model, then serve until SIGINT or SIGTERM; open streams end cleanly.

    Args:
        config: Server settings, the engine's included.
        access_log: Log one line per request.
        hypercorn_toml: Take Hypercorn's settings from this TOML file.

    Returns:
        The exit status: 0 after a signal, 1 when the engine failed (every open stream got
        an error event first; a supervisor should restart the server).

    Raises:
        LoadError: The default model cannot be loaded.
        ValueError: A ``--model`` or the models file is invalid.
    """
    default = config.model_specs()[0]
    log.info("loading model %s", default.source)
    engine = load_off_thread(default.engine)
    app = create_app(config, engine)
    return trio.run(serve_app, app, hypercorn_config(config, access_log, hypercorn_toml))


def load_off_thread(config: EngineConfig) -> Engine | Embedder:
    """Load a model in a short-lived thread, so that this thread never runs torch work.

    Every thread that runs a parallel torch op owns an OpenMP team, and an idle team may
    spin. The loader's team ends with its thread; the event loop thread (this one) never
    gets one, and the engine thread builds its own on its first step.

    Raises:
        LoadError: The model cannot be loaded.
    """
    result: list[Engine | Embedder] = []
    errors: list[BaseException] = []

    def load() -> None:
        try:
            result.append(residency.load(config))
        except BaseException as e:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(e)

    thread = threading.Thread(target=load, name="infer-load")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


async def serve_app(
    app: QuartTrio,
    hyper: HypercornConfig,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> int:
    """Serve ``app`` until SIGINT, SIGTERM or an engine failure, then drain it.

    Args:
        app: An app from :func:`create_app`.
        hyper: Hypercorn settings.
        task_status: Receives the bound URLs once listening.

    Returns:
        0 after a signal, 1 when the engine failed.
    """
    state: ServerState = app.extensions["infer"]

    async def signal_or_failure() -> None:
        async with trio.open_nursery() as nursery:
            for wait in (_signalled, state.failed.wait):
                nursery.start_soon(_first, wait, nursery.cancel_scope)
        if state.failed.is_set():
            log.error("the engine failed; shutting down")

    await serve(
        app,
        hyper,
        shutdown_trigger=signal_or_failure,
        drain=partial(drain, app),
        task_status=task_status,
    )
    return 1 if state.failed.is_set() else 0


async def serve(
    app: QuartTrio,
    hyper: HypercornConfig,
    shutdown_trigger: Callable[[], Awaitable[object]],
    drain: Callable[[], Awaitable[object]] | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``app`` on plain TCP until ``shutdown_trigger`` returns (``hypercorn.trio.serve``
    with every connection a :class:`Connection`).

    Then ``drain`` runs while every connection is still open (the app ends its streams,
    each with its terminal event), no new connection is taken, open connections get
    ``hyper.graceful_timeout`` to finish, and the app's lifespan ends.

    Args:
        app: The ASGI app.
        hyper: Hypercorn settings (its ``bind``, timeouts, logs; no TLS).
        shutdown_trigger: Returns when the server should stop.
        drain: Ends the app's open work before connections close.
        task_status: Receives the bound URLs once listening.
    """
    if hyper.ssl_enabled:
        raise ValueError("TLS is not served here: put a proxy that terminates TLS in front")
    asgi = wrap_app(app, hyper.wsgi_max_body_size, "asgi")
    lifespan_state: dict[str, object] = {}
    lifespan = Lifespan(asgi, hyper, lifespan_state)
    context = WorkerContext(None)
    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        async with trio.open_nursery() as connections:
            sockets = hyper.create_sockets().insecure_sockets
            listeners = []
            for sock in sockets:
                sock.listen(hyper.backlog)
                listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
            binds = [f"http://{repr_socket_addr(s.family, s.getsockname())}" for s in sockets]
            for bind in binds:
                await hyper.log.info(f"Running on {bind} (CTRL + C to quit)")
            handler = partial(_serve_connection, asgi, hyper, context, lifespan_state)
            task_status.started(binds)
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(
                        partial(
                            trio.serve_listeners, handler, listeners, handler_nursery=connections
                        )
                    )
                    await shutdown_trigger()
                    if drain is not None:  # new requests meanwhile get 503 shutting_down
                        await drain()
                    nursery.cancel_scope.cancel()  # stop accepting
            finally:
                await context.terminated.set()
                connections.cancel_scope.deadline = trio.current_time() + hyper.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _serve_connection(
    app: Any,
    hyper: HypercornConfig,
    context: WorkerContext,
    lifespan_state: dict[str, object],
    stream: trio.SocketStream,
) -> None:
    # Hypercorn annotates the stream as TLS, and takes a plain one as its own worker does.
    await Connection(app, hyper, context, ConnectionState(lifespan_state.copy()), stream).run()  # type: ignore[arg-type]


class Connection(TCPServer):
    """Hypercorn's trio connection, contained: what it raises ends this connection only.

    It also removes a race in Hypercorn 0.18: ``TCPServer._close`` half-closes the socket
    outside the send lock, and trio's ``send_eof`` checkpoints while it holds the stream's
    send side; a task that starts sending in that instant (an h2 connection's send task,
    when the client sends GOAWAY mid-stream) gets ``BusyResourceError``, which ended the
    whole server. Here a close half-closes only under the send lock, and while another
    task sends it closes the socket outright, which ends that send.
    """

    async def run(self) -> None:
        peer = _peer(self.stream)
        try:
            await super().run()
        except* Exception as errors:  # Cancelled is not an Exception: it goes on up
            log.error("connection from %s failed; closing it", peer, exc_info=errors)
            with trio.CancelScope(shield=True):
                await self.stream.aclose()

    async def _close(self) -> None:
        with trio.CancelScope(shield=True):  # a close must finish, cancelled or not
            if self.send_lock.locked():
                await self.stream.aclose()
                return
            async with self.send_lock:
                await super()._close()


def _peer(stream: Any) -> str:
    try:
        return repr_socket_addr(stream.socket.family, stream.socket.getpeername())
    except (OSError, AttributeError):
        return "a client that is gone"


async def _first(wait: Callable[[], Awaitable[object]], scope: trio.CancelScope) -> None:
    await wait()
    scope.cancel()


async def _signalled() -> None:
    """Return at the first SIGINT or SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s; draining open streams", signal.Signals(signum).name)
            return
