"""The served models: each one loaded on demand, run by a worker of its own, and unloaded
when the memory budget needs its room or its keep-alive runs out.

A :class:`ModelSlot` is one model of the catalog (:mod:`infer.catalog`): its names and
settings, its status, and once loaded its engine and :class:`EngineWorker` (or its
embedder's :class:`EmbedWorker`). Requests reach a model through :meth:`ModelRegistry.use`:
it resolves the name, loads the model if it must (one load at a time, in a thread; every
request for it waits for that load) and keeps it from being unloaded while the request is
admitted; its open streams keep it after that. What is unloaded, and when, is
:mod:`infer.engine.residency`'s policy; every worker steps under the one :class:`Cores`.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import math
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from enum import StrEnum
from functools import partial
from typing import TYPE_CHECKING

import trio

from infer.api.errors import APIError, ErrorCode
from infer.catalog import ModelSpec
from infer.engine import residency
from infer.engine.cores import Cores
from infer.engine.embed import Embedder
from infer.engine.engine import Engine
from infer.models.footprint import weight_bytes
from infer.server.config import ServerConfig
from infer.server.host.embedding import EmbedWorker
from infer.server.host.metrics import Metrics
from infer.server.host.worker import EngineWorker, SettlePolicy

if TYPE_CHECKING:
    from infer.engine.grammar import GrammarCompiler

log = logging.getLogger("infer.server")

LOAD_RETRY_S = 30.0  # a model that failed to load is tried again after this long
_GB = 1e9


class SlotStatus(StrEnum):
    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"
    FAILED = "failed"


class ModelSlot:
    """One served model: its names and settings, and while loaded its engine and worker.

    Args:
        spec: Its names, source and settings.
        keep_alive_s: How long it stays loaded once idle, unless its spec says.
        pinned: Never unloaded, whatever its spec says (a server's only model).
    """

    def __init__(self, spec: ModelSpec, keep_alive_s: float, pinned: bool = False) -> None:
        self.spec = spec
        self.pinned = spec.pinned or pinned
        self.metrics = Metrics()
        self.status = SlotStatus.UNLOADED
        self.engine: Engine | None = None
        self.worker: EngineWorker | None = None
        self.embedder: EmbedWorker | None = None
        self.compiler: GrammarCompiler | None = None  # made by its first structured request
        self.failure: APIError | None = None  # why its last load failed
        self.retry_at = 0.0
        self.default_keep_alive_s = keep_alive_s if spec.keep_alive_s is None else spec.keep_alive_s
        self.keep_alive_s = self.default_keep_alive_s  # the latest request's, else the default
        self.size = residency.estimated_size(spec.engine)  # bytes; measured once loaded
        self.users = 0  # requests being admitted to it
        self.last_used = -math.inf
        self.expires_at = math.inf
        self.settled = trio.Event()  # set when a load or unload ends
        self._scope: trio.CancelScope | None = None
        self._stopped = trio.Event()

    @property
    def name(self) -> str:
        """The name responses carry: its own, else (one plain ``--model``) the model's."""
        if self.spec.names:
            return self.spec.names[0]
        return self.engine.model_name if self.engine is not None else self.spec.source

    @property
    def names(self) -> tuple[str, ...]:
        """The names it is listed under."""
        return self.spec.names or (self.name,)

    def answers_to(self, name: str) -> bool:
        """A name it is listed under, its own model's name, or its source."""
        own = self.engine.model_name if self.engine is not None else None
        return name in self.names or name in (own, self.spec.source)

    @property
    def loaded(self) -> bool:
        return self.status is SlotStatus.LOADED

    @property
    def busy(self) -> bool:
        """A request is being admitted to it, or has a stream open on it."""
        running = self.worker or self.embedder
        return self.users > 0 or (running is not None and running.busy)

    @property
    def max_model_len(self) -> int | None:
        """Tokens one request may use (``None`` until loaded, unless set)."""
        if self.engine is not None:
            return self.engine.max_seq_len
        if self.embedder is not None:
            return self.embedder.embedder.max_length
        return self.spec.engine.max_seq_len

    def generator(self) -> tuple[Engine, EngineWorker]:
        """Its engine and worker.

        Raises:
            APIError: It embeds rather than generates (400), or it stopped meanwhile (503).
        """
        if self.embedder is not None:
            raise APIError(
                ErrorCode.WRONG_MODEL_KIND,
                f"model {self.name!r} is an embedding model: it cannot generate text "
                "(use /v1/embeddings)",
            )
        if self.engine is None or self.worker is None or not self.worker.ready:
            raise APIError(ErrorCode.SHUTTING_DOWN)
        return self.engine, self.worker

    def embedding(self) -> EmbedWorker:
        """Its embedding worker.

        Raises:
            APIError: It generates rather than embeds (400), or it stopped meanwhile (503).
        """
        if self.engine is not None:
            raise APIError(
                ErrorCode.WRONG_MODEL_KIND,
                f"model {self.name!r} is a text-generation model: it cannot compute embeddings",
            )
        if self.embedder is None or not self.embedder.ready:
            raise APIError(ErrorCode.SHUTTING_DOWN)
        return self.embedder

    def begin(self, status: SlotStatus) -> None:
        """Start a load or an unload: those who need the model wait for :attr:`settled`."""
        self.status, self.settled = status, trio.Event()

    def end(self, status: SlotStatus, failure: APIError | None = None) -> None:
        self.status, self.failure = status, failure
        self.settled.set()


class ModelRegistry:
    """Every served model, the memory budget they share, and the cores they step on.

    Args:
        specs: The catalog, the default model first.
        config: Server settings (the workers', the budget, the default keep-alive).
        on_failure: Called when an engine loop fails (the server must stop).
    """

    def __init__(
        self, specs: Sequence[ModelSpec], config: ServerConfig, on_failure: Callable[[str], None]
    ) -> None:
        only = len(specs) == 1  # a server of one model keeps it: nothing else needs the room
        self.slots = [ModelSlot(spec, config.keep_alive_s, only) for spec in specs]
        self.default = self.slots[0]
        self.config = config
        gb = config.memory_budget_gb
        self.budget = int(gb * _GB) if gb is not None else _physical_memory() * 3 // 4
        self.cores = Cores()
        self._on_failure = on_failure
        self._nursery: trio.Nursery | None = None
        self._load_lock = trio.Lock()
        self._wake = trio.Event()

    def resolve(self, name: str | None) -> ModelSlot:
        """The model a request names (``None``: the default); listed names before own names.

        Raises:
            APIError: ``MODEL_NOT_FOUND``.
        """
        if name is None:
            return self.default
        found = next((s for s in self.slots if name in s.names), None)
        found = found or next((s for s in self.slots if s.answers_to(name)), None)
        if found is None:
            names = ", ".join(repr(n) for s in self.slots for n in s.names)
            raise APIError(
                ErrorCode.MODEL_NOT_FOUND,
                f"model {name!r} is not served here; this server serves {names}",
            )
        return found

    def metrics_for(self, name: str | None) -> Metrics:
        """Where a request for ``name`` is counted (one that names no model: the default's)."""
        found = next((s for s in self.slots if name is None or s.answers_to(name)), None)
        return (found or self.default).metrics

    @property
    def used(self) -> int:
        """Bytes the loaded models hold."""
        return sum(s.size for s in self.slots if s.loaded)

    def open(self, nursery: trio.Nursery) -> None:
        """Run workers, loads and keep-alive in ``nursery`` (the server's, until it stops)."""
        self._nursery = nursery
        nursery.start_soon(self._expire_idle)

    async def start_default(self, preloaded: Engine | Embedder | None = None) -> bool:
        """Serve the default model (``preloaded``, else load it now); whether it serves.
        Then load the pinned ones, in the background."""
        if preloaded is not None:
            await self._start(self.default, preloaded)
        else:
            self.default.begin(SlotStatus.LOADING)
            await self._load(self.default)
        assert self._nursery is not None
        for slot in self.slots:
            if slot.pinned and slot.status is SlotStatus.UNLOADED:
                slot.begin(SlotStatus.LOADING)
                self._nursery.start_soon(self._load, slot)
        return self.default.loaded

    @asynccontextmanager
    async def use(
        self, name: str | None, keep_alive_s: float | None = None
    ) -> AsyncIterator[ModelSlot]:
        """The model ``name`` names, loaded, kept loaded for the block.

        Args:
            name: The model a request names (``None``: the default).
            keep_alive_s: How long it stays loaded once idle, from now on (Ollama's
                ``keep_alive``: the latest request's wins; 0 unloads it once idle).

        Raises:
            APIError: Not served here; it cannot load (now, or its last try failed); no
                room can be made for it.
        """
        slot = self.resolve(name)
        slot.users += 1
        try:
            await self._ready(slot)
            slot.keep_alive_s = slot.default_keep_alive_s if keep_alive_s is None else keep_alive_s
            slot.last_used = trio.current_time()
            yield slot
        finally:
            slot.users -= 1
            self.touch(slot)

    async def unload(self, name: str | None) -> ModelSlot:
        """Unload the model ``name`` names now (Ollama's ``keep_alive: 0`` with nothing to
        generate); one in use goes once idle, a pinned one stays.

        Raises:
            APIError: ``MODEL_NOT_FOUND``.
        """
        slot = self.resolve(name)
        slot.keep_alive_s = 0.0
        if slot.loaded and not slot.busy and not slot.pinned:
            await self._unload([slot], "unloaded on request")
        else:
            self.touch(slot)
        return slot

    def touch(self, slot: ModelSlot) -> None:
        """Note that ``slot`` may have gone idle: its keep-alive starts then."""
        now = trio.current_time()
        if slot.loaded and not slot.busy:
            slot.last_used = now
            slot.expires_at = math.inf if slot.pinned else now + slot.keep_alive_s
            self._wake.set()
        else:
            slot.expires_at = math.inf

    async def _ready(self, slot: ModelSlot) -> None:
        """Wait until ``slot`` is loaded, loading it (or trying again) when it is not."""
        while not slot.loaded:
            now = trio.current_time()
            if slot.status is SlotStatus.FAILED and now < slot.retry_at and slot.failure:
                raise slot.failure
            if slot.status in (SlotStatus.UNLOADED, SlotStatus.FAILED):
                if self._nursery is None:
                    raise APIError(ErrorCode.NOT_READY)
                slot.begin(SlotStatus.LOADING)
                self._nursery.start_soon(self._load, slot)
            await slot.settled.wait()
            if not slot.loaded and slot.failure is not None:
                raise slot.failure

    async def _load(self, slot: ModelSlot) -> None:
        """Load ``slot`` (one load at a time), first unloading what its room needs."""
        async with self._load_lock:
            try:
                await self._make_room(slot, strict=True)
            except APIError as e:
                log.warning("cannot load model %s now: %s", slot.name, e.message)
                slot.end(SlotStatus.UNLOADED, e)
                return
            log.info("loading model %s (%s)", slot.name, slot.spec.source)
            try:
                served = await trio.to_thread.run_sync(
                    residency.load, slot.spec.engine, abandon_on_cancel=True
                )
            except Exception as e:  # noqa: BLE001 - this model fails; the others go on
                log.exception("cannot load model %s", slot.spec.source)
                slot.retry_at = trio.current_time() + LOAD_RETRY_S
                message = f"model {slot.name!r} failed to load: {e}"
                slot.end(SlotStatus.FAILED, APIError(ErrorCode.MODEL_LOAD_FAILED, message))
                return
            await self._start(slot, served)
            await self._make_room(slot, strict=False)  # measured, it may be more than estimated

    async def _make_room(self, slot: ModelSlot, strict: bool) -> None:
        """Unload the least recently used idle models until ``slot`` fits in the budget.

        Raises:
            APIError: ``OUT_OF_MEMORY`` (``strict``) when the models pinned or in use hold
                too much; not strict, as many are unloaded as can be.
        """
        others = [s for s in self.slots if s is not slot]
        victims = residency.to_evict(others, slot.size, self.budget)
        if victims is None and strict:
            raise APIError(
                ErrorCode.OUT_OF_MEMORY,
                f"model {slot.name!r} needs about {slot.size / _GB:.2f} GB; of the memory "
                f"budget ({self.budget / _GB:.2f} GB, --memory-budget-gb) the models pinned or "
                "in use hold too much; retry later",
            )
        if victims is None:
            log.warning("the models pinned or in use take more than the memory budget")
            victims = residency.evictable(others)
        await self._unload(victims, f"to make room for {slot.name}")

    async def _start(self, slot: ModelSlot, served: Engine | Embedder) -> None:
        """Run ``served`` in a worker of its own in the registry's nursery."""
        assert self._nursery is not None
        _settle_heap()
        worker: EngineWorker | EmbedWorker
        if isinstance(served, Engine):
            worker = EngineWorker(
                served,
                slot.metrics,
                output_buffer=self.config.output_buffer,
                max_pending_tokens=self.config.max_pending_tokens,
                settle=SettlePolicy(self.config.settle_min_rows),
                cores=self.cores,
                on_idle=partial(self.touch, slot),
            )
            slot.engine, slot.worker, slot.size = served, worker, served.memory_bytes
        else:
            threads = slot.spec.engine.num_threads
            worker = EmbedWorker(served, self.cores, threads, on_idle=partial(self.touch, slot))
            slot.embedder, slot.size = worker, weight_bytes(served.loaded.model)
        await self._nursery.start(self._run_worker, slot, worker)
        slot.end(SlotStatus.LOADED)
        self.touch(slot)
        log.info(
            "serving %s (%.2f of %.2f GB in use)", slot.name, self.used / _GB, self.budget / _GB
        )

    async def _run_worker(
        self,
        slot: ModelSlot,
        worker: EngineWorker | EmbedWorker,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        slot._stopped = trio.Event()
        try:
            with trio.CancelScope() as slot._scope:
                await worker.run(task_status=task_status)
        finally:
            slot._stopped.set()
        if isinstance(worker, EngineWorker) and worker.failed:
            self._on_failure(f"the engine of {slot.name} failed; the server must be restarted")

    async def _unload(self, slots: Sequence[residency.Resident], why: str) -> None:
        """Stop each idle model's worker (no stream is open) and free its memory.

        All are marked first: a request for one waits for its unload, then loads it again.
        """
        victims = [s for s in slots if isinstance(s, ModelSlot)]
        for slot in victims:
            slot.begin(SlotStatus.UNLOADING)
        for slot in victims:
            if slot._scope is not None:
                slot._scope.cancel()
                await slot._stopped.wait()
            slot.engine = slot.worker = slot.embedder = slot.compiler = None
            slot._scope = None
            _settle_heap()
            slot.end(SlotStatus.UNLOADED)
            log.info("unloaded %s (%s; %.2f GB in use)", slot.name, why, self.used / _GB)

    async def _expire_idle(self) -> None:
        """Unload each idle model when its keep-alive runs out."""
        while True:
            await self._unload(residency.expired(self.slots, trio.current_time()), "keep-alive")
            self._wake = trio.Event()
            with trio.move_on_at(residency.next_expiry(self.slots)):
                await self._wake.wait()


def _settle_heap() -> None:
    """After a model is loaded or unloaded: collect, hand freed memory back to the OS, and
    put what is left out of the cycle collector's reach.

    A served model's objects (torch, transformers, the tokenizer) would otherwise be walked
    by every full collection, stopping the engine and the event loop (figures in
    bench/results/LOG.md); frozen, they are still freed by reference counting. vLLM freezes
    its startup heap the same way. Unfreezing first lets an unloaded model's cycles go.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
