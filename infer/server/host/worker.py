"""The engine thread, and the channels between it and the request tasks.

One trio worker thread runs the synchronous :class:`Engine`. Each loop iteration makes one
``from_thread`` hop to the event loop, which pushes the step's outputs into the request
streams and takes back what arrived meanwhile (new requests, aborts, calls); then the thread
runs the next step. When the engine is idle the thread blocks in a second hop until something
arrives.

Request tasks never touch the engine: they ``submit`` (non-blocking, refused at once when
``max_waiting_requests`` wait) and read their :class:`RequestStream`; ``call`` runs a function
on the engine thread between two steps (attention inspection). A stream that is closed early
aborts its choices: the abort waits for the next hop, and the engine applies it at once.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
import trio

from infer.engine.cores import Cores, Urgency
from infer.engine.engine import Engine
from infer.engine.params import SamplingParams
from infer.engine.request import Failure, StepOutput, TraceSpec
from infer.server.host.metrics import Metrics
from infer.server.host.stream import RequestStream

log = logging.getLogger("infer.server")

T = TypeVar("T")


class WorkerStoppedError(Exception):
    """The engine loop is not running (not started yet, shut down, or failed)."""


class QueueFullError(Exception):
    """``max_waiting_requests`` requests already wait to run."""


@dataclass(frozen=True)
class SettlePolicy:
    """When the engine thread lets the event loop write a step's tokens before stepping again.

    Run side by side on few cores, the event loop writing 64 streams' tokens and the engine's
    OpenMP threads contend: each barrier waits for the thread the event loop displaced. After
    a decode-only step of at least ``min_rows`` rows, the engine waits until every stream's
    reader has come back for more (its tokens are written), a request or abort arrives, or
    ``max_share`` of the last step's time has passed. Smaller steps do not wait: their writes
    fit beside the engine's own single-threaded work. ``min_rows = 0`` never waits.
    """

    min_rows: int = 32
    max_share: float = 0.5

    def wait_s(self, rows: int, prompts: bool, step_s: float) -> float:
        """How long to wait after a step of ``rows`` outputs (0: do not wait)."""
        if self.min_rows <= 0 or rows < self.min_rows or prompts:
            return 0.0
        return step_s * self.max_share


@dataclass
class _Submission:
    stream: RequestStream
    prompts: list[list[int]]
    params: list[SamplingParams]
    trace: TraceSpec | None
    prediction: list[int] | None


@dataclass
class _Call(Generic[T]):
    """A function to run on the engine thread, and its result once it has run."""

    fn: Callable[[Engine], T]
    done: trio.Event = field(default_factory=trio.Event)
    result: T | None = None
    error: BaseException | None = None


class EngineWorker:
    """Runs the engine in one thread and routes its outputs to request streams.

    Args:
        engine: The engine to run.
        metrics: The server's metrics (the streams record into them).
        output_buffer: Outputs a stream holds before it starts coalescing.
        max_pending_tokens: Tokens a reader may fall behind before its stream is ended.
        settle: When to let the event loop write a step's tokens first.
        cores: Held for each step and call: one model steps at a time (none: not shared).
        on_idle: Called when the last open stream has been closed.
    """

    def __init__(
        self,
        engine: Engine,
        metrics: Metrics | None = None,
        *,
        output_buffer: int = 64,
        max_pending_tokens: int = 1024,
        settle: SettlePolicy | None = None,
        cores: Cores | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.cores = cores
        self.on_idle = on_idle
        self.metrics = metrics or Metrics()
        self.output_buffer = output_buffer
        self.max_pending_tokens = max_pending_tokens
        self.settle = settle or SettlePolicy()
        # Each submission holds at least one of the waiting choices `submit` counts, so the
        # channel cannot fill before that count refuses.
        capacity = engine.config.max_waiting_requests
        self._submit_send, self._submit_receive = trio.open_memory_channel[_Submission](capacity)
        self._choices: dict[str, tuple[RequestStream, int]] = {}  # engine request id → route
        self._aborts: list[tuple[str, Failure]] = []
        self._calls: list[_Call[Any]] = []
        self._activity = trio.Event()
        self._settling: trio.CancelScope | None = None
        self._busy = 0  # streams with outputs their readers have not come back for
        self._caught_up = trio.Event()
        self._open: set[RequestStream] = set()  # streams their readers are not done with
        self._all_closed = trio.Event()
        self._queued = 0  # choices in the channel
        self._in_transit = 0  # choices taken from the channel, not yet in the engine's queue
        self.ready = False
        self.failed = False  # the engine loop itself raised; every stream was ended

    @property
    def streams(self) -> set[RequestStream]:
        """The streams the engine still produces for."""
        return {stream for stream, _ in self._choices.values()}

    @property
    def waiting(self) -> int:
        """Requests queued and not yet running (in the channel or the engine's queue).

        The engine's counts are read live (a ``len`` from the other thread is atomic), so a
        request counts as running from the moment the scheduler admits it, mid-step.
        """
        return self._queued + self._in_transit + self.engine.num_waiting

    @property
    def busy(self) -> bool:
        """Whether a stream is open: a request runs, waits, or is still being read."""
        return bool(self._open)

    @property
    def running(self) -> int:
        """Requests the engine is prefilling or decoding."""
        return self.engine.num_running

    def submit(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        arrival: float,
        trace: TraceSpec | None = None,
        timeout_s: float | None = None,
        num_prompts: int = 1,
        prediction: list[int] | None = None,
    ) -> RequestStream:
        """Queue a request's choices (prompt ``i`` sampled by ``params[i]``) without blocking;
        the caller has checked that each choice fits the engine (:meth:`Engine.check`).

        Args:
            prompts: Each choice's prompt ids.
            params: Each choice's sampling parameters.
            arrival: ``trio.current_time()`` when the request arrived.
            trace: Per-token traces to report (native streams).
            timeout_s: End the request with ``TIMEOUT`` after this long.
            num_prompts: How many distinct prompts ``prompts`` holds (usage counts each once).
            prediction: Token ids every choice's answer is expected to repeat (drafts).

        Raises:
            WorkerStoppedError: The engine loop is not running: nothing would serve it.
            QueueFullError: ``max_waiting_requests`` would be exceeded.
        """
        if not self.ready:
            raise WorkerStoppedError("the engine is not running")
        if self.waiting + len(prompts) > self.engine.config.max_waiting_requests:
            raise QueueFullError("the request queue is full")
        stream = RequestStream(
            f"req-{uuid.uuid4().hex[:20]}",
            [len(p) for p in prompts],
            num_prompts,
            arrival,
            self.metrics,
            self._abort,
            self._stream_idle,
            self._stream_closed,
            self.output_buffer,
            self.max_pending_tokens,
            predicted=prediction is not None,
        )
        self._submit_send.send_nowait(_Submission(stream, prompts, params, trace, prediction))
        self._queued += len(prompts)
        if timeout_s is not None:
            stream.deadline = trio.current_time() + timeout_s
        for index, choice in enumerate(stream.choices):
            self._choices[choice.request_id] = (stream, index)
        if not self._open:
            self._all_closed = trio.Event()
        self._open.add(stream)
        self._wake()
        return stream

    async def wait_closed(self) -> None:
        """Return once every stream's reader is done with it (after a drain: all ended)."""
        if self._open:
            await self._all_closed.wait()

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps; return what it returns.

        Raises:
            WorkerStoppedError: The engine loop is not running.
            Exception: What ``fn`` raised.
        """
        if not self.ready:
            raise WorkerStoppedError("the engine is not running")
        call = _Call(fn)
        self._calls.append(call)
        self._wake()
        await call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[return-value]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine loop in a worker thread until cancelled; then end every stream.

        Cancelled, every open request ends ``CANCELLED``. If the loop itself raises (a bug
        outside any one request), the traceback is logged, every open request ends
        ``INFERENCE_FAILED``, :attr:`failed` is set and this returns.
        """
        code = Failure.CANCELLED
        leftover: tuple[list[StepOutput], list[_Call[Any]]] = ([], [])
        try:
            self.ready = True
            task_status.started()
            leftover = await trio.to_thread.run_sync(self._loop, limiter=trio.CapacityLimiter(1))
        except Exception:
            log.exception("the engine loop failed; ending every open request")
            self.failed = True
            code = Failure.INFERENCE_FAILED
        finally:
            self.ready = False
            outputs, calls = leftover  # what the step under way when cancelled produced
            for out in outputs:
                self._deliver(out)
            for stream in self.streams:
                stream.end(code)
            self._choices.clear()
            for call in calls:
                call.done.set()
            for call in self._calls:
                call.error = WorkerStoppedError("the engine stopped")
                call.done.set()

    # --- engine thread -------------------------------------------------------------------

    def _loop(self) -> tuple[list[StepOutput], list[_Call[Any]]]:
        """Exchange with the event loop, admit, step; until cancelled.

        Returns:
            Once cancelled, the last step's outputs and calls, not yet delivered: a drain
            that begins mid-step still delivers what that step produced, and admits nothing.
        """
        if self.engine.config.num_threads:
            torch.set_num_threads(self.engine.config.num_threads)
        outputs: list[StepOutput] = []
        calls: list[_Call[Any]] = []
        step_s = 0.0
        with torch.inference_mode(), self._cores_forfeited():
            while not _cancelled() and self._wait_for_work(outputs or calls):
                wait_s = self.settle.wait_s(len(outputs), self.engine.has_prompts(), step_s)
                exchanged = trio.from_thread.run(self._exchange, outputs, calls, wait_s)
                if exchanged is None:  # cancelled meanwhile: outputs delivered, none taken
                    return [], []
                submissions, aborts, calls = exchanged
                outputs = self._admit(submissions)
                self._in_transit = 0
                for request_id, why in aborts:
                    if (out := self.engine.abort(request_id, why)) is not None:
                        outputs.append(out)
                self._hold_cores()
                try:
                    for call in calls:
                        _run(call, self.engine)
                    start = time.perf_counter()
                    outputs += self.engine.step()
                    step_s = time.perf_counter() - start
                finally:
                    self._release_cores()
        return outputs, calls

    def _hold_cores(self) -> None:
        """Wait for the cores: latency-bound while a prompt waits for its first token or a
        code completion runs, else throughput-bound."""
        if self.cores is not None:
            urgent = self.engine.has_latency_work()
            self.cores.acquire(Urgency.LATENCY if urgent else Urgency.THROUGHPUT)

    def _release_cores(self) -> None:
        """Keep the cores through the hop when the next step is latency-bound too."""
        if self.cores is not None:
            self.cores.release(keep=self.engine.has_latency_work())

    @contextmanager
    def _cores_forfeited(self) -> Iterator[None]:
        """Kept cores go on when the loop ends (it steps no more)."""
        try:
            yield
        finally:
            if self.cores is not None:
                self.cores.forfeit()

    def _wait_for_work(self, pending: list[Any]) -> bool:
        """Sleep in the event loop while there is nothing to step; False once cancelled."""
        try:
            if not pending and not self.engine.has_work():
                trio.from_thread.run(self._wait_for_activity)
            elif not pending and self._holding_a_batch():
                # Static mode gathers a batch: sleep until a request comes or the
                # gathering time is up, rather than stepping in a tight loop.
                trio.from_thread.run(
                    self._wait_for_activity, self.engine.config.batch_wait_timeout_s
                )
        except trio.Cancelled:
            return False
        return True

    def _holding_a_batch(self) -> bool:
        """Requests wait although nothing runs: the scheduler is gathering a batch."""
        return self.engine.num_running == 0 and self.engine.num_waiting > 0

    def _admit(self, submissions: list[_Submission]) -> list[StepOutput]:
        """Queue new requests in the engine; one that fails to queue (a bug, logged) gets its
        terminal output at once."""
        failed = []
        for s in submissions:
            for choice, prompt, params in zip(s.stream.choices, s.prompts, s.params, strict=True):
                try:
                    self.engine.queue(prompt, params, choice.request_id, s.trace, s.prediction)
                except Exception:  # noqa: BLE001 - one request's failure ends only it
                    log.exception("cannot queue %s", choice.request_id)
                    failed.append(
                        StepOutput(
                            choice.request_id,
                            None,
                            "",
                            Failure.INFERENCE_FAILED,
                            prompt_tokens=len(prompt),
                        )
                    )
        return failed

    # --- event loop side (called through from_thread) -------------------------------------

    async def _wait_for_activity(self, timeout_s: float = math.inf) -> None:
        with trio.move_on_after(timeout_s):
            await self._activity.wait()

    async def _exchange(
        self, outputs: list[StepOutput], calls: list[_Call[Any]], settle_s: float
    ) -> tuple[list[_Submission], list[tuple[str, Failure]], list[_Call[Any]]] | None:
        """Deliver a step's outputs and calls; take the submissions, aborts and calls that
        arrived. With ``settle_s``, first wait (shielded, at most that long) until every
        reader has come back for more, or a request or abort arrives.

        Returns ``None`` when the worker is being cancelled: nothing new is taken.
        """
        self._activity = trio.Event()
        for out in outputs:
            self._deliver(out)
        for call in calls:
            call.done.set()
        if settle_s > 0 and self._busy:
            with trio.CancelScope(deadline=trio.current_time() + settle_s, shield=True) as scope:
                self._settling = scope
                await self._caught_up.wait()
            self._settling = None
        if trio.current_effective_deadline() == -math.inf:  # our scope was cancelled
            return None
        now = trio.current_time()
        for stream, _ in self._choices.values():
            if now >= stream.deadline:
                stream.deadline = math.inf  # its choices end TIMEOUT at the next step
                self._aborts += [(c.request_id, Failure.TIMEOUT) for c in stream.choices]
        submissions = []
        while True:
            try:
                submissions.append(self._submit_receive.receive_nowait())
            except trio.WouldBlock:
                break
        aborts, self._aborts = self._aborts, []
        calls, self._calls = self._calls, []
        self._in_transit = sum(len(s.prompts) for s in submissions)
        self._queued -= self._in_transit
        return submissions, aborts, calls

    def _wake(self) -> None:
        """A request, abort or call arrived: wake an idle engine, end a settling wait."""
        self._activity.set()
        if self._settling is not None:
            self._settling.cancel()

    def _stream_closed(self, stream: RequestStream) -> None:
        self._open.discard(stream)
        if not self._open:
            self._all_closed.set()
            if self.on_idle is not None:
                self.on_idle()

    def _stream_idle(self) -> None:
        self._busy -= 1
        if self._busy == 0:
            self._caught_up.set()
            self._caught_up = trio.Event()

    def _deliver(self, out: StepOutput) -> None:
        route = self._choices.get(out.request_id)
        if route is None:
            return
        stream, index = route
        if out.finished:
            del self._choices[out.request_id]
        was_busy = stream.busy
        for request_id in stream.push(index, out):  # a reader too far behind: stop them
            self._choices.pop(request_id, None)
            self._aborts.append((request_id, Failure.OVERLOADED))
        if stream.busy and not was_busy:
            self._busy += 1

    def _abort(self, request_id: str, why: Failure) -> None:
        if self._choices.pop(request_id, None) is not None:
            self._aborts.append((request_id, why))
            self._wake()


def _run(call: _Call[Any], engine: Engine) -> None:
    """Run a call on the engine thread, keeping its result or its exception."""
    try:
        call.result = call.fn(engine)
    except Exception as e:  # noqa: BLE001 - handed to the caller
        call.error = e


def _cancelled() -> bool:
    """Whether the engine thread's ``to_thread`` call has been cancelled (engine thread)."""
    try:
        trio.from_thread.check_cancelled()
    except trio.Cancelled:
        return True
    return False
