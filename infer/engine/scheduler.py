"""Which requests run in the next step: one interface, a static and a continuous policy.

Both policies share the step plan: every running request past its prompt decodes one token,
and prompts are prefilled in chunks under a per-step token budget, so one long prompt never
freezes the streams already running. They differ only in admission:

- static: wait up to ``batch_wait_timeout_s`` for ``max_batch_size`` requests, then run that
  batch to completion before admitting anything else;
- continuous: admit waiting requests into free slots at every step, first come first served.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass, field

from infer.engine.config import EngineConfig
from infer.engine.request import Request, RequestStatus


@dataclass
class PrefillChunk:
    """Prompt tokens ``[start, start + length)`` of ``request`` go through the model now."""

    request: Request
    start: int
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.request.prompt_len


@dataclass
class SchedulerOutput:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler(ABC):
    """FCFS queue plus the set of running requests (at most ``max_batch_size``)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add_request(self, request: Request) -> bool:
        """Queue a request; False when ``max_waiting_requests`` are already waiting."""
        if len(self.waiting) >= self.config.max_waiting_requests:
            return False
        self.waiting.append(request)
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, request_id: str) -> Request | None:
        for req in (*self.running, *self.waiting):
            if req.request_id == request_id:
                return req
        return None

    def remove(self, request: Request) -> None:
        """Forget a request (finished, aborted or failed) wherever it is."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: admit (per policy), then decode + budgeted prefill."""
        for req in self._admit():
            req.status = RequestStatus.PREFILL
            self.running.append(req)
        decode = [r for r in self.running if r.status == RequestStatus.DECODE]
        prefilling = [r for r in self.running if r.status == RequestStatus.PREFILL]
        return SchedulerOutput(self._prefill_chunks(prefilling), decode)

    @abstractmethod
    def _admit(self) -> list[Request]:
        """Take the requests that join the running set now, in FCFS order."""

    def _take_waiting(self, n: int) -> list[Request]:
        return [self.waiting.popleft() for _ in range(min(n, len(self.waiting)))]

    def _prefill_chunks(self, prefilling: list[Request]) -> list[PrefillChunk]:
        """Chunks padded to one length ``T`` (the first chunk's), ``count * T <= budget``.

        The oldest prompt sets ``T``; younger prompts ride along in chunks of at most ``T``
        tokens while the padded batch still fits the budget.
        """
        budget = self.config.prefill_token_budget
        chunks: list[PrefillChunk] = []
        width = 0
        for req in prefilling:
            remaining = req.prompt_len - req.num_cached
            if not chunks:
                width = min(remaining, budget)
            elif (len(chunks) + 1) * width > budget:
                break
            chunks.append(PrefillChunk(req, req.num_cached, min(remaining, width)))
        return chunks


class StaticScheduler(Scheduler):
    """All in, all out: a batch forms (bounded wait) and runs until every request ends."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._deadline: float | None = None

    def _admit(self) -> list[Request]:
        if self.running or not self.waiting:
            return []
        now = time.monotonic()
        if self._deadline is None:
            self._deadline = now + self.config.batch_wait_timeout_s
        if len(self.waiting) < self.config.max_batch_size and now < self._deadline:
            return []
        self._deadline = None
        return self._take_waiting(self.config.max_batch_size)


class ContinuousScheduler(Scheduler):
    """Admit and retire at every step: a free slot is filled at once."""

    def _admit(self) -> list[Request]:
        return self._take_waiting(self.config.max_batch_size - len(self.running))


def make_scheduler(config: EngineConfig) -> Scheduler:
    if config.batching_mode == "static":
        return StaticScheduler(config)
    return ContinuousScheduler(config)
