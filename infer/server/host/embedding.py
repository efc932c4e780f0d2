"""An embedding model's thread (:class:`EmbedWorker`), and :func:`embed`, the one way in for
every embeddings route (OpenAI's ``/v1/embeddings``, Ollama's ``/api/embed``).

Like an engine, an embedder runs on a thread of its own (its OpenMP team is made once), one
request at a time, each forward under the shared :class:`~infer.engine.cores.Cores`: a
request of a few hundred tokens (a query) is latency-bound, a large batch (indexing a
codebase) throughput-bound, so a code completion goes between its forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import torch
import trio

from infer.api.errors import APIError, ErrorCode
from infer.engine.cores import Cores, Urgency
from infer.engine.embed import Embedder, Embeddings, EmbedInput
from infer.engine.request import RequestError
from infer.server.host.worker import QueueFullError, WorkerStoppedError

if TYPE_CHECKING:
    from infer.server.host.state import ServerState

LATENCY_TOKENS = 512  # a request of at most this many tokens is latency-bound
QUEUE = 64  # requests that may wait for an embedding model


@dataclass(eq=False)
class _Job:
    inputs: Sequence[EmbedInput]
    truncate: bool
    dimensions: int | None
    done: trio.Event = field(default_factory=trio.Event)
    result: Embeddings | None = None
    error: BaseException | None = None
    abandoned: bool = False  # its request went away: not worth computing


class EmbedWorker:
    """Runs an :class:`Embedder` on a thread of its own.

    Args:
        embedder: The model.
        cores: Held around each forward.
        num_threads: Torch threads of its thread (``None``: torch's default).
        on_idle: Called when its last request has its answer.
    """

    def __init__(
        self,
        embedder: Embedder,
        cores: Cores,
        num_threads: int | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        self.embedder = embedder
        self.cores = cores
        self.num_threads = num_threads
        self.on_idle = on_idle
        self._send, self._receive = trio.open_memory_channel[_Job](QUEUE)
        self._current: _Job | None = None
        self.pending = 0  # requests queued or running
        self.ready = False

    @property
    def busy(self) -> bool:
        return self.pending > 0

    async def embed(
        self, inputs: Sequence[EmbedInput], truncate: bool, dimensions: int | None
    ) -> Embeddings:
        """Embed on the worker's thread (see :meth:`Embedder.embed`).

        Raises:
            WorkerStoppedError: The worker is not running.
            QueueFullError: Too many requests wait.
            RequestError: What the embedder refuses.
        """
        if not self.ready:
            raise WorkerStoppedError("the embedder is not running")
        job = _Job(inputs, truncate, dimensions)
        try:
            self._send.send_nowait(job)
        except trio.WouldBlock:
            raise QueueFullError("the embedding queue is full") from None
        self.pending += 1
        try:
            await job.done.wait()
        finally:
            job.abandoned = True
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the thread until cancelled; then fail what still waits."""
        self.ready = True
        task_status.started()
        try:
            await trio.to_thread.run_sync(self._loop, limiter=trio.CapacityLimiter(1))
        finally:
            self.ready = False
            self._send.close()
            left = [self._current] if self._current is not None else []
            left += list(iter(_take(self._receive), None))
            for job in left:
                job.error = WorkerStoppedError("the embedder stopped")
                self._finish(job)

    def _loop(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        while True:
            try:
                job = trio.from_thread.run(self._receive.receive)
            except (trio.Cancelled, trio.EndOfChannel):
                return
            self._current = job
            if not job.abandoned:
                try:
                    job.result = self.embedder.embed(
                        job.inputs, job.truncate, job.dimensions, turn=self._turn
                    )
                except Exception as e:  # noqa: BLE001 - handed to the request
                    job.error = e
            try:
                trio.from_thread.run_sync(self._finish, job)
            except trio.Cancelled:
                return  # run() finishes it
            self._current = None

    def _turn(self, tokens: int) -> AbstractContextManager[None]:
        urgency = Urgency.LATENCY if tokens <= LATENCY_TOKENS else Urgency.THROUGHPUT
        return self.cores.turn(urgency)

    def _finish(self, job: _Job) -> None:
        if job.done.is_set():
            return
        job.done.set()
        self.pending -= 1
        if self.pending == 0 and self.on_idle is not None:
            self.on_idle()


def _take(channel: trio.MemoryReceiveChannel[_Job]) -> Callable[[], _Job | None]:
    def take() -> _Job | None:
        try:
            return channel.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel):
            return None

    return take


class Embedded(NamedTuple):
    """What :func:`embed` answers: the vectors, and the name of the model that made them."""

    model: str
    embeddings: Embeddings


async def embed(
    state: ServerState,
    model: str | None,
    inputs: Sequence[EmbedInput],
    truncate: bool = False,
    dimensions: int | None = None,
    keep_alive_s: float | None = None,
) -> Embedded:
    """Embed ``inputs`` with the model ``model`` names, loading it if it must.

    Args:
        state: The server.
        model: The model's name (``None``: the default model).
        inputs: Texts, or lists of token ids without special tokens, or a mix.
        truncate: Cut an input longer than the model takes (else it is refused).
        dimensions: The vector length wanted (only the model's own is accepted).
        keep_alive_s: How long the model stays loaded once idle (Ollama's ``keep_alive``).

    Raises:
        APIError: The request is refused (counted in the metrics): the model is unknown,
            cannot load, or generates text (400 ``wrong_model_kind``); no input, an input
            too long without ``truncate``, a token id outside the vocabulary, another
            ``dimensions``; the queue is full.
    """
    from infer.server.host.state import counting_refusals

    state.require_open()
    with counting_refusals(state, model):
        async with state.models.use(model, keep_alive_s) as slot:
            worker = slot.embedding()
            try:
                result = await worker.embed(inputs, truncate, dimensions)
            except RequestError as e:
                raise APIError(ErrorCode.of(e.reason), str(e)) from None
            except QueueFullError as e:
                raise APIError(ErrorCode.QUEUE_FULL, f"the server is busy ({e})") from None
            except WorkerStoppedError:
                raise APIError(ErrorCode.SHUTTING_DOWN) from None
    slot.metrics.finished["stop"] += 1
    slot.metrics.prompt_tokens += result.total_tokens
    return Embedded(slot.name, result)
