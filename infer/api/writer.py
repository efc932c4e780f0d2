"""What every protocol's writer is: a state machine from a request's outputs to its events.

A writer holds no connection: the server reads the request's outputs and hands each to the
writer (:meth:`Writer.output`), which returns the stream events it becomes; the server
frames them (SSE, NDJSON) and ends with exactly one terminal, :meth:`Writer.finish` or
:meth:`Writer.fail`. A non-streamed request runs the same machine and answers
:meth:`Writer.body`. Work that needs the tokenizer (naming scored prompt tokens, counting
reasoning tokens) is handed back as a :data:`Job` that the server runs off its event loop
before the call that needs it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from infer.api.errors import APIError
from infer.api.reasoning import Thinking
from infer.api.tools import ToolPlan
from infer.api.usage import Counts
from infer.engine.request import Failure, StepOutput

Job = Callable[[], None]


class Event(NamedTuple):
    """One stream event.

    Args:
        data: Its JSON payload, or (``raw``) the text it carries as is.
        name: Its name (SSE ``event:``); ``None`` for none.
        id: Its number in the stream (SSE ``id:``); ``None`` for none.
        raw: ``data`` is text, not JSON (OpenAI's ``[DONE]``).
    """

    data: Any
    name: str | None = None
    id: int | None = None
    raw: bool = False


DONE = Event("[DONE]", raw=True)


class Timing(Protocol):
    """When a request arrived and its first token was read (the host's clock)."""

    arrival: float
    first_token_at: float | None


class Tokenizer(Protocol):
    """What a writer's jobs ask of the model's tokenizer."""

    def decode(self, token_ids: list[int], /) -> Any: ...

    def encode(self, text: str, /, *, add_special_tokens: bool = ...) -> Any: ...


@dataclass(frozen=True)
class Ticket:
    """What admission settled for a request, as its writer reads it.

    Args:
        id: The request's id (``req-...``; choice 0's engine request has it too).
        created: Unix time of its arrival.
        model: The name its answers carry.
        prompt_ids: Each prompt's token ids.
        choices: How many engine requests it is (prompts times ``n``).
        tokenizer: The model's tokenizer (for the writer's jobs only).
        timing: When the request arrived and its first token was read (the host's clock).
        plan: The tools a chat prompt offers, in the served template's format.
        thinking: Whether a chat reply starts with (or may open) a reasoning block.
        truncated: A fill's code was cut to the builder's limits.
        context: The most tokens one request may hold on the model that answers (0: not
            said).
    """

    id: str
    created: int
    model: str
    prompt_ids: list[list[int]]
    choices: int
    tokenizer: Tokenizer
    timing: Timing
    plan: ToolPlan | None = None
    thinking: Thinking | None = None
    truncated: bool = False
    context: int = 0


class Writer(ABC):
    """What one protocol makes of a request's outputs: events, or one body.

    Args:
        streamed: Whether the client reads events (else one body is built).
    """

    def __init__(self, streamed: bool) -> None:
        self.streamed = streamed
        self.failure: APIError | None = None

    def start_work(self) -> Job | None:
        """Blocking work :meth:`start` needs first (``None``: none)."""
        return None

    def start(self) -> list[Event]:
        """What goes out before any output."""
        return []

    def is_error(self, out: StepOutput) -> bool:
        """Whether this output ends its choice with an error."""
        return isinstance(out.outcome, Failure)

    def work(self, index: int, out: StepOutput) -> Job | None:
        """Blocking work :meth:`output` needs for this output first (``None``: none)."""
        return None

    @abstractmethod
    def output(self, index: int, out: StepOutput) -> list[Event]:
        """What one output of choice ``index`` becomes (not an error: :meth:`is_error`)."""

    def finish_work(self) -> Job | None:
        """Blocking work :meth:`finish` needs first (``None``: none)."""
        return None

    @abstractmethod
    def finish(self, counts: Counts) -> list[Event]:
        """The terminal after every choice ended without an error."""

    def fail(self, error: APIError, counts: Counts) -> list[Event]:
        """The terminal of a request that failed (kept to answer a non-streamed request)."""
        self.failure = error
        return self.failed(error, counts)

    @abstractmethod
    def failed(self, error: APIError, counts: Counts) -> list[Event]:
        """The terminal events of a failure."""

    def body(self, counts: Counts) -> Any:
        """The whole response of a non-streamed request that did not fail."""
        raise NotImplementedError(f"{type(self).__name__} only streams")
