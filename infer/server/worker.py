"""The engine thread and the channels between it and the request tasks.

One trio worker thread runs the synchronous :class:`Engine`. Each loop iteration makes one
``from_thread`` hop to the event loop, which hands the step's outputs to the request streams
and takes back what arrived meanwhile (new requests, aborts); then the thread runs the next
step. When the engine is idle the thread blocks in a second hop until something arrives.

After a step that only decoded many rows, the hop also waits (at most half a step) until the
event loop has written those tokens out, or until a request arrives, before the next step
starts. Run side by side, the two contend for the same cores: the engine's OpenMP threads
wait at every barrier for the one the event loop displaced. Served 64 chat streams on 2
cores, alternated: 1442-1525 -> 1528-1574 tok/s, ITL p50 35.6-37.9 -> 34.4-35.9 ms (five
pairs); 1502-1536 -> 1560-1602 tok/s (three pairs). A short burst of writes costs less than
the wait: it fits beside the engine's own single-threaded part of a step. Waiting after every
decode step made one stream ~0.2 ms per token slower in three of four alternated pairs
(7.33-7.41 -> 7.57-7.61 ms) and W2's 16 streams 3-5% slower (374-403 -> 365-384 tok/s),
hence SETTLE_MIN_OUTPUTS. While prompts wait to be prefilled the engine does not wait: then
the event loop is busy taking requests, and their first tokens come first.

Request tasks never touch the engine: they ``submit`` (non-blocking, refused at once when the
bounded queue is full) and iterate their :class:`RequestHandle`. A slow reader never stalls the
step loop: when its bounded output channel is full, its outputs are coalesced; past
``max_pending_tokens`` it is aborted and ended with a ``SLOW_CLIENT`` error.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from dataclasses import dataclass, field, replace

import torch
import trio
from trio.testing import wait_all_tasks_blocked

from infer.engine.engine import Engine, QueueFullError
from infer.engine.request import StepOutput, TraceSpec
from infer.engine.sampler import SamplingParams

log = logging.getLogger("infer.server")

# Outputs of a decode step after which the engine lets the event loop write them before
# stepping again (see the module docstring): helps at 64 streams, hurts at 1 and 16.
SETTLE_MIN_OUTPUTS = 32


class WorkerStoppedError(Exception):
    """The engine loop is not running (not started yet, shut down, or failed)."""


@dataclass
class _Submission:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    trace: TraceSpec | None


@dataclass
class _Stream:
    """Event-loop-side state of one request's output."""

    send: trio.MemorySendChannel[StepOutput]
    prompt_tokens: int
    deadline: float = math.inf
    pending: list[StepOutput] = field(default_factory=list)  # overflow, oldest first
    pending_tokens: int = 0
    timed_out: bool = False
    closed: bool = False  # the reader is gone (abort sent) or the terminal output is queued


class RequestHandle:
    """A request's output stream: iterate it for :class:`StepOutput` until the finished one."""

    def __init__(
        self,
        worker: EngineWorker,
        request_id: str,
        stream: _Stream,
        receive: trio.MemoryReceiveChannel[StepOutput],
    ) -> None:
        self.request_id = request_id
        self._worker = worker
        self._stream = stream
        self._receive = receive
        self._done = False

    def __aiter__(self) -> RequestHandle:
        return self

    async def __anext__(self) -> StepOutput:
        if self._done:
            raise StopAsyncIteration
        try:  # the channel holds older outputs than the overflow list
            out = self._receive.receive_nowait()
        except trio.WouldBlock:
            if self._stream.pending:
                out = self._stream.pending.pop(0)
                if not self._stream.pending:
                    self._stream.pending_tokens = 0
            else:
                out = await self._receive.receive()
        self._done = out.finished
        return out

    def abort(self) -> None:
        """Stop generating (the client went away); idempotent, safe after the end."""
        if not self._done:
            self._done = True
            self._worker._abort(self.request_id)


class EngineWorker:
    """Runs the engine in one thread and routes its outputs to request streams."""

    def __init__(
        self, engine: Engine, *, output_buffer: int = 64, max_pending_tokens: int = 1024
    ) -> None:
        self.engine = engine
        self.output_buffer = output_buffer
        self.max_pending_tokens = max_pending_tokens
        capacity = max(engine.config.max_waiting_requests, 1)
        self._submit_send, self._submit_receive = trio.open_memory_channel[_Submission](capacity)
        self._streams: dict[str, _Stream] = {}
        self._aborts: list[str] = []
        self._activity = trio.Event()
        self._settling: trio.CancelScope | None = None  # the wait of _exchange_settled
        self._in_transit = 0  # taken from the channel, not yet in the engine's queue
        self.ready = False
        self.failed = False  # the engine loop itself raised; every stream was ended

    @property
    def waiting(self) -> int:
        """Requests queued and not yet running (in the channel or the engine's queue).

        The engine's counts are read live (a ``len`` from the other thread is atomic), so a
        request counts as running from the moment the scheduler admits it, mid-step.
        """
        queued = self._submit_send.statistics().current_buffer_used
        return queued + self._in_transit + self.engine.num_waiting

    @property
    def running(self) -> int:
        """Requests the engine is prefilling or decoding."""
        return self.engine.num_running

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        trace: TraceSpec | None = None,
        timeout_s: float | None = None,
    ) -> RequestHandle:
        """Queue a request without blocking.

        Raises:
            WorkerStoppedError: The engine loop is not running: nothing would serve it.
            QueueFullError: ``max_waiting_requests`` are already waiting.
        """
        if not self.ready:
            raise WorkerStoppedError("the engine is not running")
        if self.waiting >= self.engine.config.max_waiting_requests:
            raise QueueFullError("the request queue is full")
        request_id = f"req-{uuid.uuid4().hex[:20]}"
        try:
            self._submit_send.send_nowait(_Submission(request_id, prompt_ids, params, trace))
        except trio.WouldBlock:
            raise QueueFullError("the request queue is full") from None
        send, receive = trio.open_memory_channel[StepOutput](self.output_buffer)
        deadline = trio.current_time() + timeout_s if timeout_s is not None else math.inf
        stream = self._streams[request_id] = _Stream(send, len(prompt_ids), deadline)
        self._wake()
        return RequestHandle(self, request_id, stream, receive)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the engine loop in a worker thread until cancelled; then end every stream.

        Cancelled, every open request ends ``CANCELLED``. If the loop itself raises (a bug
        outside any one request), the traceback is logged, every open request ends
        ``INFERENCE_FAILED``, :attr:`failed` is set and this returns.
        """
        reason, code, message = "abort", "CANCELLED", "the server is shutting down"
        leftover: list[StepOutput] = []
        try:
            self.ready = True
            task_status.started()
            leftover = await trio.to_thread.run_sync(self._loop,
                                                     limiter=trio.CapacityLimiter(1))
        except Exception:
            log.exception("the engine loop failed; ending every open request")
            self.failed = True
            reason, code, message = "error", "INFERENCE_FAILED", "the engine failed"
        finally:
            self.ready = False
            for out in leftover:  # what the step under way when cancelled produced
                self._deliver(out)
            for request_id in list(self._streams):
                self._terminate(request_id, reason, code, message)

    # --- engine thread -------------------------------------------------------------------

    def _loop(self) -> list[StepOutput]:
        """Exchange with the event loop, admit, step; until cancelled.

        Returns:
            Once cancelled, the last step's outputs, not yet delivered: a drain that begins
            mid-step still delivers what that step produced, and admits nothing new.
        """
        if self.engine.config.num_threads:
            torch.set_num_threads(self.engine.config.num_threads)
        outputs: list[StepOutput] = []
        step_s = 0.0
        with torch.inference_mode():
            while not _cancelled() and self._wait_for_work(outputs):
                if len(outputs) >= SETTLE_MIN_OUTPUTS and not self.engine.has_prompts():
                    exchanged = trio.from_thread.run(self._exchange_settled, outputs, step_s / 2)
                else:
                    exchanged = trio.from_thread.run_sync(self._exchange, outputs)
                if exchanged is None:  # cancelled meanwhile: outputs delivered, none taken
                    return []
                submissions, aborts = exchanged
                outputs = self._admit(submissions)
                self._in_transit = 0
                for request_id in aborts:
                    self.engine.abort(request_id)
                start = time.perf_counter()
                outputs += self.engine.step()
                step_s = time.perf_counter() - start
        return outputs

    def _wait_for_work(self, outputs: list[StepOutput]) -> bool:
        """Sleep in the event loop while there is nothing to step; False once cancelled."""
        try:
            if not outputs and not self.engine.has_work():
                trio.from_thread.run(self._wait_for_activity)
            elif not outputs and self._holding_a_batch():
                # Static mode gathers a batch: sleep until a request comes or the
                # gathering time is up, rather than stepping in a tight loop.
                trio.from_thread.run(self._wait_for_activity,
                                     self.engine.config.batch_wait_timeout_s)
        except trio.Cancelled:
            return False
        return True

    def _holding_a_batch(self) -> bool:
        """Requests wait although nothing runs: the scheduler is gathering a batch."""
        return self.engine.num_running == 0 and self.engine.num_waiting > 0

    def _admit(self, submissions: list[_Submission]) -> list[StepOutput]:
        """Add new requests to the engine; a refused one gets its terminal output at once."""
        refused = []
        for s in submissions:
            try:
                self.engine.add_request(s.prompt_ids, s.params, s.request_id, s.trace)
            except QueueFullError as e:
                refused.append(_error(s, "OVERLOADED", str(e)))
            except ValueError as e:
                refused.append(_error(s, "INVALID_REQUEST", str(e)))
        return refused

    # --- event loop side (called through from_thread) -------------------------------------

    async def _wait_for_activity(self, timeout_s: float = math.inf) -> None:
        with trio.move_on_after(timeout_s):
            await self._activity.wait()

    async def _exchange_settled(self, outputs: list[StepOutput], wait_s: float
                                ) -> tuple[list[_Submission], list[str]] | None:
        """:meth:`_exchange`, letting the event loop write the outputs first: deliver them,
        wait until every task is blocked, a request or an abort arrives (:meth:`_wake`), or
        ``wait_s`` has passed (shielded: a cancellation waits for it), then take what
        arrived."""
        for out in outputs:
            self._deliver(out)
        with trio.CancelScope(deadline=trio.current_time() + wait_s, shield=True) as scope:
            self._settling = scope
            await wait_all_tasks_blocked()
        self._settling = None
        return self._exchange([])

    def _wake(self) -> None:
        """A request or an abort arrived: wake an idle engine, end a settling wait."""
        self._activity.set()
        if self._settling is not None:
            self._settling.cancel()

    def _exchange(self, outputs: list[StepOutput]
                  ) -> tuple[list[_Submission], list[str]] | None:
        """Deliver a step's outputs; take the submissions and aborts that arrived.

        Returns ``None`` when the worker is being cancelled: nothing new is taken.
        """
        self._activity = trio.Event()
        for out in outputs:
            self._deliver(out)
        if trio.current_effective_deadline() == -math.inf:  # our scope was cancelled
            return None
        now = trio.current_time()
        for request_id, stream in self._streams.items():
            if now >= stream.deadline and not stream.timed_out:
                stream.timed_out = True
                self._aborts.append(request_id)
        submissions = []
        while True:
            try:
                submissions.append(self._submit_receive.receive_nowait())
            except trio.WouldBlock:
                break
        aborts, self._aborts = self._aborts, []
        self._in_transit = len(submissions)
        return submissions, aborts

    def _deliver(self, out: StepOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
            if stream.timed_out and out.finish_reason == "abort":
                out = replace(out, finish_reason="length", error_code="TIMEOUT")
        if not stream.closed:
            self._push(stream, out)

    def _push(self, stream: _Stream, out: StepOutput) -> None:
        """Send if the reader keeps up; else coalesce, and give up on it past the hard limit."""
        stream.closed = out.finished
        if not stream.pending:
            try:
                stream.send.send_nowait(out)
                return
            except trio.WouldBlock:
                pass
        last = stream.pending[-1] if stream.pending else None
        if last is not None and _mergeable(last) and _mergeable(out):
            stream.pending[-1] = _merge(last, out)
        else:
            stream.pending.append(out)
        stream.pending_tokens += 1
        if stream.pending_tokens > self.max_pending_tokens and not out.finished:
            self._aborts.append(out.request_id)
            stream.pending = [
                replace(
                    out, text_delta="", token_id=None, finished=True, finish_reason="error",
                    error="the client is not reading its stream fast enough",
                    error_code="SLOW_CLIENT",
                )
            ]
            stream.closed = True

    def _terminate(self, request_id: str, reason: str, code: str, message: str) -> None:
        stream = self._streams.pop(request_id)
        if not stream.closed:
            out = StepOutput(
                request_id, None, "", True, reason, message, code, stream.prompt_tokens
            )
            self._push(stream, out)

    def _abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None and not stream.closed:
            stream.closed = True
            self._aborts.append(request_id)
            self._wake()


def _cancelled() -> bool:
    """Whether the engine thread's ``to_thread`` call has been cancelled (engine thread)."""
    try:
        trio.from_thread.check_cancelled()
    except trio.Cancelled:
        return True
    return False


def _mergeable(out: StepOutput) -> bool:
    """Whether an output may be folded into a neighbour: only plain text, never the end.

    Outputs with a logprob or a trace stay separate (their per-token data would be lost);
    the pending-token limit still bounds how many are kept.
    """
    return not out.finished and out.logprob is None and out.trace is None


def _merge(a: StepOutput, b: StepOutput) -> StepOutput:
    """One output standing for two consecutive plain-text ones."""
    return replace(b, text_delta=a.text_delta + b.text_delta)


def _error(s: _Submission, code: str, message: str) -> StepOutput:
    return StepOutput(s.request_id, None, "", True, "error", message, code, len(s.prompt_ids))
