"""The writer of the native event stream: ``started`` → (``token`` [``trace``])* with
``metrics`` interleaved → exactly one of ``done`` or ``error``, each event with its number
in the stream as its ``id`` (:class:`NativeWriter`)."""

from __future__ import annotations

from collections.abc import Callable

from infer.api.errors import APIError
from infer.api.native import bodies
from infer.api.usage import Counts, usage
from infer.api.writer import Event, Ticket, Writer
from infer.engine.request import FinishReason, StepOutput


class NativeWriter(Writer):
    """The native events of one request, each with its ``id`` (its number, from 0).

    Args:
        ticket: The admitted request (one choice).
        metrics_every: Send a ``metrics`` event every this many tokens.
        clock: The clock of the ticket's timings.
    """

    def __init__(
        self, ticket: Ticket, metrics_every: int | None, clock: Callable[[], float]
    ) -> None:
        super().__init__(streamed=True)
        self.ticket = ticket
        self.metrics_every = metrics_every
        self.clock = clock
        self.seq = 0
        self.reason: FinishReason | None = None

    def start(self) -> list[Event]:
        ticket = self.ticket
        return self._events([bodies.started(ticket.id, ticket.model, ticket.created)])

    def output(self, index: int, out: StepOutput) -> list[Event]:
        rate = None
        if bodies.metrics_due(out, self.metrics_every):
            timing, tokens = self.ticket.timing, out.completion_tokens
            rate = bodies.metrics(tokens, timing.arrival, timing.first_token_at, self.clock())
        if isinstance(out.outcome, FinishReason):
            self.reason = out.outcome
        return self._events(bodies.events(out, rate))

    def finish(self, counts: Counts) -> list[Event]:
        assert self.reason is not None  # the last output finished the request
        return self._events([bodies.done(self.reason, usage(counts))])

    def failed(self, error: APIError, counts: Counts) -> list[Event]:
        code = error.code
        return self._events([bodies.error(code.name, error.message, code.retryable, usage(counts))])

    def _events(self, events: list[bodies.Event]) -> list[Event]:
        numbered = [Event(e, name, self.seq + i) for i, (e, name) in enumerate(events)]
        self.seq += len(events)
        return numbered
