"""Which requests run in the next step: one interface, a static and a continuous policy.

Both policies share the step plan: every running request past its prompt decodes one token,
and prompts are prefilled in chunks under a per-step token budget, so one long prompt never
freezes the streams already running. Every token needs room in the paged KV cache: a
request is admitted only when its first chunk fits, and when a decoding request needs a
block and none is free, the most recently admitted request is preempted (its blocks freed;
it waits at the head of the queue and later recomputes its prompt and output so far). The
policies differ only in admission:

- static: wait up to ``batch_wait_timeout_s`` for ``max_batch_size`` requests, then run that
  batch to completion before admitting anything else;
- continuous: admit waiting requests into free slots at every step, first come first served.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from infer.engine.block_manager import BlockManager
from infer.engine.config import EngineConfig
from infer.engine.request import Request, RequestStatus
from infer.engine.speculative import Speculator

Clock = Callable[[], float]  # monotonic seconds
# Prompt tokens per chunk of a prompt being scored: each gets a [V] float32 row of logits.
MAX_SCORED_CHUNK = 256


@dataclass
class PrefillChunk:
    """Prompt tokens ``[start, start + length)`` of ``request`` go through the model now."""

    request: Request
    start: int
    length: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.length == self.request.prefill_len


@dataclass
class SchedulerOutput:
    prefill: list[PrefillChunk] = field(default_factory=list)
    decode: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler(ABC):
    """FCFS queue, the running set (at most ``max_batch_size``) and the KV blocks.

    Args:
        config: Batch limits and budgets, ``max_seq_len`` set (the engine sets it from the
            model when it is not).
        blocks: The KV cache's blocks (default: enough for ``max_batch_size`` requests of
            ``max_seq_len`` tokens, for tests without a model).
        clock: Monotonic seconds (the static policy's batch wait reads it).

    Raises:
        ValueError: ``config.max_seq_len`` is not set.
    """

    def __init__(
        self,
        config: EngineConfig,
        blocks: BlockManager | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        if config.max_seq_len is None:
            raise ValueError("the scheduler needs max_seq_len set (Engine sets it)")
        self.config = config
        self.max_seq_len = config.max_seq_len
        self.clock = clock
        if blocks is None:
            size = config.block_size
            blocks = BlockManager(
                config.max_batch_size * -(-config.max_seq_len // size), size, config.prefix_caching
            )
        self.blocks = blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.speculator = Speculator(config.draft_tokens, config.draft_row_cost)
        # What one draft model token costs, in rows of this model's step (None: no model).
        self.draft_price: float | None = None

    def add_request(self, request: Request) -> None:
        """Queue a request."""
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_prompts(self) -> bool:
        """Whether a prompt waits or is part-way through its prefill."""
        return bool(self.waiting) or any(r.status == RequestStatus.PREFILL for r in self.running)

    def find(self, request_id: str) -> Request | None:
        for req in (*self.running, *self.waiting):
            if req.request_id == request_id:
                return req
        return None

    def remove(self, request: Request) -> None:
        """Forget a request (finished, aborted or failed) wherever it is; free its blocks."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.blocks.free(request.request_id)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step: decode every running request that can grow, admit (per
        policy), then prefill chunks of prompts, oldest first, within the token budget."""
        decode = self._decodes()
        self._admit()
        chunks = self._prefill_chunks()
        while not decode and not chunks and len(self.running) > 1:
            # Prompts part-way through prefill hold every free block and none can go on:
            # give the oldest room by sending the newest back to wait.
            self._preempt(self.running[-1])
            chunks = self._prefill_chunks()
        self._draft(decode, len(decode) + sum(c.length for c in chunks))
        return SchedulerOutput(chunks, decode)

    def _draft(self, decode: list[Request], rows: int) -> None:
        """Give decoding requests the draft tokens worth verifying in a step of ``rows``
        rows (see :class:`Speculator`): copied from text where it matches, else (with a
        draft model) ``model_draft`` tokens for the engine's draft model to write. A draft
        gets blocks only where they are free."""
        for req in decode:
            req.draft, req.model_draft = [], 0
        spec, price = self.speculator, self.draft_price
        if not spec.max_tokens or not decode:
            return
        best = max(
            max(r.drafts.lookup.rate, r.drafts.model.rate / price if price else 0.0) for r in decode
        )
        if best <= len(decode) / (1 / spec.row_cost + rows):
            return  # not even one draft token would pay
        most = [min(spec.max_tokens, r.room - 1) for r in decode]
        proposals = [r.drafts.propose(r.token_ids, k) for r, k in zip(decode, most, strict=True)]
        offers = []
        for req, draft, k in zip(decode, proposals, most, strict=True):
            if draft:
                offers.append((req.drafts.lookup.rate, len(draft), 1.0))
            elif price and k > 0:
                offers.append((req.drafts.model.rate, k, price))
            else:
                offers.append((0.0, 0, 1.0))
        allowed = spec.plan(offers, rows)
        for req, draft, n in zip(decode, proposals, allowed, strict=True):
            if n and self.blocks.ensure(req.request_id, req.num_cached + 1 + n):
                if draft:
                    req.draft = draft[:n]
                else:
                    req.model_draft = n

    def _prefill_chunks(self) -> list[PrefillChunk]:
        budget = self.config.prefill_token_budget
        chunks: list[PrefillChunk] = []
        for req in self.running:
            if req.status != RequestStatus.PREFILL or budget <= 0:
                continue
            chunk = self._chunk(req, budget)
            if chunk is None:
                break
            chunks.append(chunk)
            budget -= chunk.length
        return chunks

    def _backlog(self) -> int:
        """Prompt tokens that running requests still have to prefill."""
        return sum(
            r.prefill_len - r.num_cached for r in self.running if r.status == RequestStatus.PREFILL
        )

    def _decodes(self) -> list[Request]:
        """Running requests past their prompt, each with room for one more token."""
        decode = []
        for req in list(self.running):
            if req.status != RequestStatus.DECODE or req not in self.running:
                continue
            while not self.blocks.ensure(req.request_id, req.num_cached + 1):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is req:
                    break
            else:
                decode.append(req)
        return [r for r in decode if r in self.running]

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks; it waits first in line to recompute."""
        self.running.remove(req)
        self.blocks.free(req.request_id)
        req.status, req.num_cached = RequestStatus.WAITING, 0
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _chunk(self, req: Request, budget: int) -> PrefillChunk | None:
        """The next chunk of a prompt that fits the budget and the free blocks, or None."""
        length = min(req.prefill_len - req.num_cached, budget)
        if req.unscored < req.prompt_len - 1:  # each scored position brings a row of logits
            length = min(length, MAX_SCORED_CHUNK)
        room = (
            len(self.blocks.table(req.request_id)) + self.blocks.num_free
        ) * self.blocks.block_size - req.num_cached
        length = min(length, room)
        if length <= 0 or not self.blocks.ensure(req.request_id, req.num_cached + length):
            return None
        return PrefillChunk(req, req.num_cached, length)

    def _start(self, req: Request, first: int) -> bool:
        """Move a waiting request into the running set if ``first`` tokens of its prompt
        (after what the prefix cache holds) can get blocks."""
        tokens = req.token_ids
        req.prefill_len = len(tokens)
        # A prompt being scored recomputes every position it has not scored yet.
        limit = req.unscored if req.scores_prompt else None
        req.num_cached = self.blocks.match_prefix(req.request_id, tokens, limit)
        first = max(1, min(req.prefill_len - req.num_cached, first))
        if not self.blocks.ensure(req.request_id, req.num_cached + first):
            self.blocks.free(req.request_id)
            req.num_cached = 0
            return False
        if req.cached_tokens is None:
            req.cached_tokens = req.num_cached
        req.status = RequestStatus.PREFILL
        self.running.append(req)
        return True

    @abstractmethod
    def _admit(self) -> None:
        """Move the requests that join the running set now, in FCFS order."""

    def _take_waiting(self, n: int, budget: int) -> None:
        """Start up to ``n`` waiting requests while ``budget`` prompt tokens and blocks last."""
        while self.waiting and n > 0 and budget > 0:
            req = self.waiting[0]
            if not self._start(req, budget):
                break
            self.waiting.popleft()
            n -= 1
            budget -= req.prefill_len - req.num_cached


class StaticScheduler(Scheduler):
    """All in, all out: a batch forms (bounded wait) and runs until every request ends."""

    def __init__(
        self,
        config: EngineConfig,
        blocks: BlockManager | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(config, blocks, clock)
        self._deadline: float | None = None

    def _admit(self) -> None:
        if self.running or not self.waiting:
            return
        now = self.clock()
        if self._deadline is None:
            self._deadline = now + self.config.batch_wait_timeout_s
        if len(self.waiting) < self.config.max_batch_size and now < self._deadline:
            return
        self._deadline = None
        # The whole batch joins now; its prompts are prefilled over the next steps.
        self._take_waiting(
            self.config.max_batch_size, self.max_seq_len * self.config.max_batch_size
        )


class ContinuousScheduler(Scheduler):
    """Admit and retire at every step: a free slot is filled at once."""

    def _admit(self) -> None:
        # Admit only what this step's prefill budget can start on: FCFS stays fair, and
        # requests that cannot run yet keep their blocks free for those that can.
        self._take_waiting(
            self.config.max_batch_size - len(self.running),
            self.config.prefill_token_budget - self._backlog(),
        )


def make_scheduler(
    config: EngineConfig, blocks: BlockManager | None = None, clock: Clock = time.monotonic
) -> Scheduler:
    if config.batching_mode == "static":
        return StaticScheduler(config, blocks, clock)
    return ContinuousScheduler(config, blocks, clock)
