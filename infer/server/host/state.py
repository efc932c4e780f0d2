"""The server's shared state and the engines' lifetime inside the app's nursery.

``while_serving`` starts :meth:`ServerState.run_engine` in ``app.nursery`` under a cancel
scope the state owns: quart-trio would otherwise wait its background-task timeout before
cancelling. It serves the default model (ready once it is loaded), and every other model of
the catalog as requests call for it (:mod:`infer.server.host.registry`). Shutdown is two
steps. First :meth:`ServerState.drain`, called by the server once its shutdown signal fires
and before any connection is closed, refuses new work and stops the workers, which end every
open request with a ``CANCELLED`` output, and waits until each stream has read its terminal
output. Then :meth:`ServerState.stop` (after serving) makes sure every engine thread has
ended.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum

import trio
from quart import current_app

from infer.api.errors import APIError, ErrorCode
from infer.engine.embed import Embedder
from infer.engine.engine import Engine
from infer.server.config import ServerConfig
from infer.server.host.registry import ModelRegistry, SlotStatus
from infer.server.host.resume import ResumeRegistry
from infer.server.host.store import ResponseStore
from infer.server.host.worker import EngineWorker

log = logging.getLogger("infer.server")


class Status(StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class ServerState:
    """What every route shares: config, the served models, and open streams.

    Args:
        config: Server settings.
        engine: The default model, loaded (an engine, or an embedder); ``None`` to load it
            once serving starts.
    """

    def __init__(self, config: ServerConfig, engine: Engine | Embedder | None = None) -> None:
        self.config = config
        self.models = ModelRegistry(config.model_specs(), config, self._fail)
        self.status = Status.LOADING
        self.failed = trio.Event()  # set when loading or an engine loop failed
        self.resumable = ResumeRegistry(config.resume_window_s, config.heartbeat_s)
        self.responses = ResponseStore(config.stored_responses, config.stored_response_ttl_s)
        self._preloaded = engine
        if isinstance(engine, Engine):  # its name and engine are known before it serves
            self.models.default.engine = engine
        self._scope = trio.CancelScope()
        self._stopped: trio.Event | None = None

    @property
    def engine(self) -> Engine | None:
        """The default model's engine, while it is loaded."""
        return self.models.default.engine

    @property
    def worker(self) -> EngineWorker | None:
        """The default model's worker, while it is loaded."""
        return self.models.default.worker

    @property
    def model_name(self) -> str:
        """The name the default model's responses carry."""
        return self.models.default.name

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the default model is listed under."""
        return self.models.default.names

    def serves(self, name: str) -> bool:
        """Whether a request for model ``name`` names a served model: a listed name, a
        model's own name, or its source."""
        return any(slot.answers_to(name) for slot in self.models.slots)

    @property
    def max_model_len(self) -> int | None:
        """Tokens one request to the default model may use (``None`` while it loads, when
        no ``max_seq_len`` was set: the model's context decides it)."""
        return self.models.default.max_model_len

    @property
    def ready(self) -> bool:
        """Serving: the default model was loaded at start (it may be unloaded since, when
        other models are served, and loads again on demand) and has not failed since."""
        return self.status == Status.READY and self.models.default.status != SlotStatus.FAILED

    def require_open(self) -> None:
        """Raises ``NOT_READY`` while the default model loads at start or after it failed,
        ``SHUTTING_DOWN`` during shutdown."""
        if self.status == Status.READY:
            return
        if self.status == Status.LOADING:
            raise APIError(ErrorCode.NOT_READY)
        if self.status == Status.FAILED:
            raise APIError(ErrorCode.NOT_READY, "the model failed to load or the engine failed")
        raise APIError(ErrorCode.SHUTTING_DOWN)

    async def run_engine(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Serve the default model (loading it if needed), then every model on demand,
        until :meth:`drain` or :meth:`stop`."""
        self._stopped = trio.Event()
        task_status.started()
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    self.models.open(nursery)
                    preloaded, self._preloaded = self._preloaded, None
                    if not await self.models.start_default(preloaded):
                        self._fail("the model failed to load")
                        nursery.cancel_scope.cancel()
                    elif self.status == Status.LOADING:
                        self.status = Status.READY
                        if (engine := self.engine) is not None:
                            _log_max_seq_len(engine)
        finally:
            gc.unfreeze()  # let exit and later servers in this process collect it all
            if self.status != Status.FAILED:
                self.status = Status.STOPPED
            self._stopped.set()

    def _fail(self, why: str) -> None:
        log.error("%s; /health answers 503 failed", why)
        self.status = Status.FAILED
        self.failed.set()
        self._scope.cancel()  # every engine stops: the server must be restarted

    async def drain(self, timeout_s: float | None = None) -> None:
        """Refuse new requests, let the running ones go on for ``config.drain_grace_s``, end
        every one still open, and wait until each stream has read its terminal output.

        Args:
            timeout_s: Longest to wait for streams (default: ``config.drain_timeout_s``).
        """
        workers = [s.worker for s in self.models.slots if s.worker is not None]
        if self.status in (Status.LOADING, Status.READY):
            self.status = Status.DRAINING
            grace = self.config.drain_grace_s
            if workers and grace > 0:
                log.info("shutting down: letting open requests finish (up to %.0f s)", grace)
                with trio.move_on_after(grace):
                    while any(w.running or w.waiting for w in workers):
                        await trio.sleep(0.05)
            log.info("shutting down: ending open requests")
        self._scope.cancel()
        with trio.move_on_after(self.config.drain_timeout_s if timeout_s is None else timeout_s):
            if self._stopped is not None:
                await self._stopped.wait()
            for worker in workers:
                await worker.wait_closed()

    async def stop(self) -> None:
        """Stop every engine and wait until their threads have ended."""
        self.resumable.close()
        self._scope.cancel()
        if self._stopped is not None:
            await self._stopped.wait()


@contextmanager
def counting_refusals(state: ServerState, model: str | None = None) -> Iterator[None]:
    """Count an :class:`APIError` raised in the block as a refused request for ``model``
    (one that names no served model counts as the default model's)."""
    try:
        yield
    except APIError as e:
        state.models.metrics_for(model).rejected[e.code.value] += 1
        raise


def get_state() -> ServerState:
    """The state of the app handling the current request."""
    state: ServerState = current_app.extensions["infer"]
    return state


def _log_max_seq_len(engine: Engine) -> None:
    """Say at start how long a request may be and what set it (a warning past the model's
    context, which its positions were not trained for)."""
    size = engine.cache_size
    context = engine.model.config.max_position_embeddings
    level = logging.WARNING if size.max_seq_len > context else logging.INFO
    log.log(level, "max sequence length %d (%s%s)", size.max_seq_len, size.bound, size.note)
