"""An embedding model's worker (:class:`EmbedWorker`), and :func:`embed`, the one way in for
every embeddings route (OpenAI's ``/v1/embeddings``, Ollama's ``/api/embed``).

An embedder runs its requests one at a time off the event loop, each forward under the
shared :class:`~infer.engine.cores.Cores`: a request of a few hundred tokens (a query) is
latency-bound, a large batch (indexing a codebase) throughput-bound, so a code completion
goes between its forwards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from functools import partial
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


class EmbedWorker:
    """Runs an :class:`Embedder`'s requests one at a time, each in a worker thread.

    Args:
        embedder: The model.
        cores: Held around each forward.
        num_threads: Torch threads of the thread that runs it (``None``: torch's default).
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
        self.pending = 0  # requests queued or running
        self.ready = False
        self._one_at_a_time = trio.CapacityLimiter(1)

    @property
    def busy(self) -> bool:
        return self.pending > 0

    async def embed(
        self, inputs: Sequence[EmbedInput], truncate: bool, dimensions: int | None
    ) -> Embeddings:
        """Embed in a worker thread (see :meth:`Embedder.embed`); a request that goes away
        meanwhile is still computed to its end (a forward cannot be cut short).

        Raises:
            WorkerStoppedError: The worker is not running.
            QueueFullError: Too many requests wait.
            RequestError: What the embedder refuses.
        """
        if not self.ready:
            raise WorkerStoppedError("the embedder is not running")
        if self.pending >= QUEUE:
            raise QueueFullError("the embedding queue is full")
        self.pending += 1
        try:
            run = partial(self._embed, inputs, truncate, dimensions)
            return await trio.to_thread.run_sync(run, limiter=self._one_at_a_time)
        finally:
            self.pending -= 1
            if self.pending == 0 and self.on_idle is not None:
                self.on_idle()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take requests until cancelled."""
        self.ready = True
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self.ready = False

    def _embed(
        self, inputs: Sequence[EmbedInput], truncate: bool, dimensions: int | None
    ) -> Embeddings:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)  # per thread, as the engine's
        return self.embedder.embed(inputs, truncate, dimensions, turn=self._turn)

    def _turn(self, tokens: int) -> AbstractContextManager[None]:
        urgency = Urgency.LATENCY if tokens <= LATENCY_TOKENS else Urgency.THROUGHPUT
        return self.cores.turn(urgency)


class Embedded(NamedTuple):
    """What :func:`embed` answers: the vectors, the name of the model that made them, and
    how long the request waited for it to be loaded."""

    model: str
    embeddings: Embeddings
    load_s: float = 0.0


async def embed(
    state: ServerState,
    model: str | None,
    inputs: Sequence[EmbedInput],
    truncate: bool = False,
    dimensions: int | None = None,
    keep_alive_s: float | None = None,
    allow_empty: bool = False,
) -> Embedded:
    """Embed ``inputs`` with the model ``model`` names, loading it if it must.

    Args:
        state: The server.
        model: The model's name (``None``: the default model).
        inputs: Texts, or lists of token ids without special tokens, or a mix.
        truncate: Cut an input longer than the model takes (else it is refused).
        dimensions: The vector length wanted (only the model's own is accepted).
        keep_alive_s: How long the model stays loaded once idle (Ollama's ``keep_alive``).
        allow_empty: No input loads the model and embeds nothing (Ollama's ``/api/embed``);
            else it is refused.

    Raises:
        APIError: The request is refused (counted in the metrics): the model is unknown,
            cannot load, or generates text (400 ``wrong_model_kind``); no input, an input
            too long without ``truncate``, a token id outside the vocabulary, another
            ``dimensions``; the queue is full.
    """
    from infer.server.host.state import counting_refusals

    state.require_open()
    with counting_refusals(state, model):
        waited = trio.current_time()
        async with state.models.use(model, keep_alive_s) as slot:
            load_s = trio.current_time() - waited
            worker = slot.embedding()
            if allow_empty and not inputs:
                nothing = torch.empty(0, worker.embedder.dimensions)
                return Embedded(slot.name, Embeddings(nothing, []), load_s)
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
    return Embedded(slot.name, result, load_s)
