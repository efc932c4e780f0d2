"""The server's shared state and the engine's lifetime inside the app's nursery.

``while_serving`` starts :meth:`ServerState.run_engine` in ``app.nursery`` under a cancel
scope the state owns: quart-trio would otherwise wait its background-task timeout before
cancelling. Shutdown is two steps. First :meth:`ServerState.drain`, called by the server once
its shutdown signal fires and before any connection is closed, refuses new work and stops
the worker, which ends every open request with a ``CANCELLED`` output, and waits until each
stream has read its terminal output. Then :meth:`ServerState.stop` (after serving) makes sure
the engine thread has ended.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum
from typing import TYPE_CHECKING

import trio
from quart import current_app

from infer.api.errors import APIError, ErrorCode
from infer.engine.engine import Engine
from infer.server.config import ServerConfig
from infer.server.host.metrics import Metrics
from infer.server.host.resume import ResumeRegistry
from infer.server.host.store import ResponseStore
from infer.server.host.worker import EngineWorker, SettlePolicy

if TYPE_CHECKING:
    from infer.engine.grammar import GrammarCompiler

log = logging.getLogger("infer.server")


class Status(StrEnum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class ServerState:
    """What every route shares: config, engine, worker, metrics and open streams.

    Args:
        config: Server settings.
        engine: A loaded engine, or ``None`` to load ``config.engine`` once serving starts.
    """

    def __init__(self, config: ServerConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.engine = engine
        self.worker: EngineWorker | None = None
        self.metrics = Metrics()
        self.compiler: GrammarCompiler | None = None  # made by the first structured request
        self.status = Status.LOADING
        self.failed = trio.Event()  # set when loading or the engine loop failed
        self.resumable = ResumeRegistry(config.resume_window_s, config.heartbeat_s)
        self.responses = ResponseStore(config.stored_responses, config.stored_response_ttl_s)
        self._scope = trio.CancelScope()
        self._stopped: trio.Event | None = None

    @property
    def model_name(self) -> str:
        """The name responses carry: the first served name, else the model's own."""
        return self.model_names[0]

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name the model is listed under (``--served-model-name``, or its own)."""
        if self.config.served_model_names:
            return self.config.served_model_names
        return (self.engine.model_name if self.engine is not None else self.config.engine.model,)

    def serves(self, name: str) -> bool:
        """Whether a request for model ``name`` is for this server's model: a served name,
        the model's own name, or the ``--model`` it was started with."""
        own = self.engine.model_name if self.engine is not None else None
        return name in self.model_names or name in (own, self.config.engine.model)

    @property
    def max_model_len(self) -> int | None:
        """Prompt + completion tokens one request may use (``None`` while the model loads,
        when no ``max_seq_len`` was set: the model's context decides it)."""
        engine = self.engine
        return engine.max_seq_len if engine is not None else self.config.engine.max_seq_len

    @property
    def ready(self) -> bool:
        return self.status == Status.READY and self.worker is not None and self.worker.ready

    def require_ready(self) -> tuple[Engine, EngineWorker]:
        """The engine and worker, when requests can be taken.

        Raises:
            APIError: 503 while the model loads, after it failed, or during shutdown.
        """
        if self.ready:
            assert self.engine is not None and self.worker is not None  # implied by ready
            return self.engine, self.worker
        if self.status == Status.LOADING:
            raise APIError(ErrorCode.NOT_READY)
        if self.status == Status.FAILED:
            raise APIError(ErrorCode.NOT_READY, "the model failed to load or the engine failed")
        raise APIError(ErrorCode.SHUTTING_DOWN)

    async def run_engine(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Load the model if needed, then run the worker until :meth:`drain` or :meth:`stop`."""
        self._stopped = trio.Event()
        task_status.started()
        frozen = False
        try:
            with self._scope:
                if self.engine is None:
                    self.engine = await self._load()
                    if self.engine is None:
                        return
                # The model is served for the life of the app: put what loading left
                # (torch, transformers, the tokenizer) out of the cycle collector's reach,
                # whoever loaded it (`infer serve` loads it before the app starts): each full
                # collection walked it all, stopping the engine and the event loop (figures
                # in bench/results/LOG.md). Frozen objects are still freed by reference
                # counting. vLLM freezes its startup heap the same way.
                gc.collect()
                gc.freeze()
                frozen = True
                worker = EngineWorker(
                    self.engine,
                    self.metrics,
                    output_buffer=self.config.output_buffer,
                    max_pending_tokens=self.config.max_pending_tokens,
                    settle=SettlePolicy(self.config.settle_min_rows),
                )
                async with trio.open_nursery() as nursery:
                    await nursery.start(worker.run)
                    self.worker = worker
                    if self.status == Status.LOADING:
                        self.status = Status.READY
                        log.info("serving %s", self.engine.model_name)
                        _log_max_seq_len(self.engine)
                if worker.failed:
                    self._fail("the engine failed; the server must be restarted")
        finally:
            if frozen:
                gc.unfreeze()  # let exit and later servers in this process collect it all
            if self.status != Status.FAILED:
                self.status = Status.STOPPED
            self._stopped.set()

    async def _load(self) -> Engine | None:
        config = self.config.engine
        log.info("loading model %s", config.model)
        try:
            return await trio.to_thread.run_sync(Engine.from_config, config, abandon_on_cancel=True)
        except Exception:
            log.exception("cannot load model %s", config.model)
            self._fail("the model failed to load")
            return None

    def _fail(self, why: str) -> None:
        log.error("%s; /health answers 503 failed", why)
        self.status = Status.FAILED
        self.failed.set()

    async def drain(self, timeout_s: float | None = None) -> None:
        """Refuse new requests, let the running ones go on for ``config.drain_grace_s``, end
        every one still open, and wait until each stream has read its terminal output.

        Args:
            timeout_s: Longest to wait for streams (default: ``config.drain_timeout_s``).
        """
        if self.status in (Status.LOADING, Status.READY):
            self.status = Status.DRAINING
            worker, grace = self.worker, self.config.drain_grace_s
            if worker is not None and grace > 0:
                log.info("shutting down: letting open requests finish (up to %.0f s)", grace)
                with trio.move_on_after(grace):
                    while worker.running or worker.waiting:
                        await trio.sleep(0.05)
            log.info("shutting down: ending open requests")
        self._scope.cancel()
        with trio.move_on_after(self.config.drain_timeout_s if timeout_s is None else timeout_s):
            if self._stopped is not None:
                await self._stopped.wait()
            if self.worker is not None:
                await self.worker.wait_closed()

    async def stop(self) -> None:
        """Stop the engine and wait until its thread has ended."""
        self.resumable.close()
        self._scope.cancel()
        if self._stopped is not None:
            await self._stopped.wait()


@contextmanager
def counting_refusals(state: ServerState) -> Iterator[None]:
    """Count an :class:`APIError` raised in the block as a refused request."""
    try:
        yield
    except APIError as e:
        state.metrics.rejected[e.code.value] += 1
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
