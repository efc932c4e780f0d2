"""One request's generation as its HTTP task reads it: :class:`RequestStream`.

A request asks for one or more choices (OpenAI's ``n``, a list of prompts); each is its own
engine request. The worker pushes every choice's outputs into the request's one stream, and
the request task takes them with :meth:`RequestStream.next` as ``(index, output)``.

Pushing never blocks the engine: outputs wait in a bounded channel, then in an overflow list
where a slow reader's plain-text outputs merge; past ``max_pending_tokens`` behind, the
stream is ended with a retryable ``OVERLOADED`` error. Closing a stream before the last
output of every choice was read aborts the rest (a client that went away). The stream also
keeps the request's counts and feeds the server's metrics as outputs are read.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from infer.api.errors import ErrorCode
from infer.api.usage import Counts
from infer.engine.request import Failure, StepOutput
from infer.server.host.metrics import Metrics

SLOW_CLIENT = "the client is not reading its stream fast enough"


@dataclass
class _Choice:
    """One engine request of the stream."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens the prefix cache served
    accepted_prediction: int = 0  # tokens of the prediction its answer kept
    rejected_prediction: int = 0  # ... tried and not kept
    tokens: int = 0  # completion tokens read so far
    pending_tokens: int = 0  # tokens waiting in the overflow list
    tail: list[Any] | None = None  # its newest overflow entry, while it is there
    pushed_last: bool = False  # its terminal output has been pushed
    read_last: bool = False  # ... and read


@dataclass
class StreamStats:
    """Timings of a stream, for the native ``metrics`` events."""

    arrival: float
    first_token_at: float | None = None
    last_token_at: float = 0.0
    created: int = field(default_factory=lambda: int(time.time()))


class RequestStream:
    """The outputs of one request's choices, in the order each choice produced them.

    Built by :meth:`EngineWorker.submit <infer.server.host.worker.EngineWorker.submit>`; use it as a
    context manager in the task that reads it.

    Args:
        stream_id: The request's id (choice 0's engine request has it too).
        prompt_tokens: Each choice's prompt length.
        prompts: How many distinct prompts the choices have (usage counts each once).
        arrival: ``trio.current_time()`` when the request arrived.
        metrics: Where reading records time to first token, gaps and ends.
        abort: Tells the engine to stop one choice (``request_id``, why).
        on_idle: Called when the reader has come back for more and found nothing, after
            outputs were pushed (:attr:`busy` turned false).
        on_close: Called once when the reader is done with the stream.
        buffer: Outputs the channel holds before the overflow list is used.
        max_pending_tokens: Tokens a choice may fall behind before the stream is ended.
    """

    def __init__(
        self,
        stream_id: str,
        prompt_tokens: list[int],
        prompts: int,
        arrival: float,
        metrics: Metrics,
        abort: Callable[[str, Failure], None],
        on_idle: Callable[[], None],
        on_close: Callable[[RequestStream], None],
        buffer: int,
        max_pending_tokens: int,
        predicted: bool = False,
    ) -> None:
        self.id = stream_id
        self.predicted = predicted  # the request sent a prediction (usage reports its use)
        self.choices = [
            _Choice(stream_id if i == 0 else f"{stream_id}-{i}", n)
            for i, n in enumerate(prompt_tokens)
        ]
        self.prompts = prompts
        self.stats = StreamStats(arrival, last_token_at=arrival)
        self.busy = False  # outputs pushed that its reader has not come back for
        self.deadline = math.inf
        self._metrics = metrics
        self._abort = abort
        self._on_idle = on_idle
        self._on_close = on_close
        self._max_pending = max_pending_tokens
        self._send, self._receive = trio.open_memory_channel[tuple[int, StepOutput]](buffer)
        self._pending: deque[list[Any]] = deque()  # [index, output] entries, oldest first
        self._closed = False  # the reader is done with it (finished, gone or failed)

    @property
    def finished(self) -> bool:
        """Whether the last output of every choice has been read."""
        return all(c.read_last for c in self.choices)

    @property
    def pending(self) -> int:
        """Outputs waiting for the reader (in the channel or the overflow list)."""
        return self._send.statistics().current_buffer_used + len(self._pending)

    @property
    def open(self) -> bool:
        """Whether the worker still routes outputs here (some choice has not ended)."""
        return not self._closed and not all(c.pushed_last for c in self.choices)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: Any) -> None:
        # Cancelled (a disconnect) or GeneratorExit (the body was dropped) is the client's
        # doing; an Exception is ours.
        self.close(client_gone=exc_type is None or not issubclass(exc_type, Exception))

    # --- the reader's side ----------------------------------------------------------------

    async def next(self, wait_s: float | None = None) -> tuple[int, StepOutput] | None:
        """The next output of any choice with its index; ``None`` after ``wait_s`` seconds
        without one (a heartbeat is due).

        Raises:
            RuntimeError: Every choice's last output was read already.
        """
        if self.finished:
            raise RuntimeError("the stream has already finished")
        item = self._take()
        if item is None:
            self._idle()
            with trio.move_on_after(math.inf if wait_s is None else wait_s):
                item = await self._receive.receive()
            if item is None:
                return None
        self._record(*item)
        return item

    def _take(self) -> tuple[int, StepOutput] | None:
        try:  # the channel holds older outputs than the overflow list
            return self._receive.receive_nowait()
        except trio.WouldBlock:
            pass
        if not self._pending:
            return None
        index, out = self._pending.popleft()
        choice = self.choices[index]
        if choice.tail is not None and choice.tail[1] is out:
            choice.tail = None
        choice.pending_tokens -= out.num_tokens
        return index, out

    def _idle(self) -> None:
        if self.busy:
            self.busy = False
            self._on_idle()

    def _record(self, index: int, out: StepOutput) -> None:
        choice = self.choices[index]
        choice.cached_tokens = max(choice.cached_tokens, out.cached_tokens)
        choice.accepted_prediction = max(choice.accepted_prediction, out.accepted_prediction_tokens)
        choice.rejected_prediction = max(choice.rejected_prediction, out.rejected_prediction_tokens)
        now = trio.current_time()
        stats, metrics = self.stats, self._metrics
        if out.num_tokens:
            if stats.first_token_at is None:
                stats.first_token_at = now
                metrics.ttft.observe(now - stats.arrival)
            else:
                gap = (now - stats.last_token_at) / out.num_tokens
                for _ in range(out.num_tokens):
                    metrics.itl.observe(gap)
            stats.last_token_at = now
            choice.tokens += out.num_tokens
            metrics.generated_tokens += out.num_tokens
        if out.outcome is not None:
            choice.read_last = True
            metrics.prompt_tokens += choice.prompt_tokens
            metrics.cached_prompt_tokens += choice.cached_tokens
            outcome = out.outcome
            metrics.finished[
                ErrorCode.of(outcome).finish_reason
                if isinstance(outcome, Failure)
                else outcome.value
            ] += 1
            if self.finished:
                self._idle()

    def close(self, client_gone: bool = True) -> None:
        """Stop reading: abort every choice that has not ended (idempotent).

        Args:
            client_gone: Count an unfinished choice as a client disconnect; else as an error.
        """
        if self._closed:
            return
        self._closed = True
        self._idle()
        for choice in self.choices:
            if not choice.read_last:
                if not choice.pushed_last:
                    self._abort(choice.request_id, Failure.CANCELLED)
                if client_gone:
                    self._metrics.client_disconnects += 1
                    self._metrics.finished["abort"] += 1
                else:
                    self._metrics.finished["error"] += 1
        self._on_close(self)

    def fail(self) -> None:
        """The server could not go on with this stream (a bug, logged): end it as an error."""
        self.close(client_gone=False)

    def counts(self) -> Counts:
        """Token counts of what was read: each prompt once, every choice, how many prompt
        tokens the prefix cache served and, for a request with a prediction, how much of it
        was used."""
        per_prompt = len(self.choices) // self.prompts
        firsts = self.choices[::per_prompt]
        prediction = None
        if self.predicted:
            prediction = (
                sum(c.accepted_prediction for c in self.choices),
                sum(c.rejected_prediction for c in self.choices),
            )
        return Counts(
            sum(c.prompt_tokens for c in firsts),
            sum(c.tokens for c in self.choices),
            sum(c.cached_tokens for c in firsts),
            prediction,
        )

    # --- the worker's side ----------------------------------------------------------------

    def push(self, index: int, out: StepOutput) -> list[str]:
        """Hand one output to the reader, without blocking.

        Returns:
            Choices the engine must stop because the reader fell too far behind (their ends
            are already queued here).
        """
        choice = self.choices[index]
        if out.outcome is not None:
            choice.pushed_last = True
        if self._closed:
            return []
        self.busy = True
        if not self._pending:
            try:
                self._send.send_nowait((index, out))
                return []
            except trio.WouldBlock:
                pass
        tail = choice.tail
        if tail is not None and _mergeable(tail[1]) and _mergeable(out):
            tail[1] = _merge(tail[1], out)
        else:
            choice.tail = [index, out]
            self._pending.append(choice.tail)
        choice.pending_tokens += out.num_tokens
        if choice.pending_tokens > self._max_pending and out.outcome is None:
            return self._end_slow_reader()
        return []

    def end(self, code: Failure) -> None:
        """End every choice that has not ended with ``code`` (the worker stops or failed)."""
        for index, choice in enumerate(self.choices):
            if not choice.pushed_last:
                self.push(
                    index,
                    StepOutput(
                        choice.request_id, None, "", code, prompt_tokens=choice.prompt_tokens
                    ),
                )

    def _end_slow_reader(self) -> list[str]:
        """Drop what waits and end every open choice ``OVERLOADED``; return those to stop."""
        self._pending.clear()
        stopped = []
        for index, choice in enumerate(self.choices):
            choice.tail, choice.pending_tokens = None, 0
            if not choice.pushed_last:
                stopped.append(choice.request_id)
                choice.pushed_last = True
                self._pending.append(
                    [
                        index,
                        StepOutput(
                            choice.request_id,
                            None,
                            "",
                            Failure.OVERLOADED,
                            SLOW_CLIENT,
                            prompt_tokens=choice.prompt_tokens,
                        ),
                    ]
                )
        return stopped


def _mergeable(out: StepOutput) -> bool:
    """Whether an output may be folded into a neighbour: only plain text, never the end.

    Outputs with logprobs, a trace or prompt scores stay separate (their data would be
    lost); the pending-token limit still bounds how many are kept.
    """
    return (
        out.outcome is None
        and out.logprobs is None
        and out.trace is None
        and out.prompt_logprobs is None
    )


def _merge(a: StepOutput, b: StepOutput) -> StepOutput:
    """One output standing for two consecutive plain-text ones."""
    return replace(
        b,
        text_delta=a.text_delta + b.text_delta,
        num_tokens=a.num_tokens + b.num_tokens,
        text_offset=a.text_offset,
    )
