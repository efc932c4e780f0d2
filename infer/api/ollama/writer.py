"""The writer of ``/api/generate`` and ``/api/chat`` (:class:`OllamaWriter`): a line per
piece of the reply, then a ``done`` line with the counts and durations, or one body.

A reply is read as the OpenAI chat writer reads one (:class:`~infer.api.chat.ReplyParser`):
its reasoning goes to ``thinking``, apart from the content, and each tool call goes out
whole, its arguments an object, once the model has written it to its end.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from infer.api.chat import ReplyParser
from infer.api.errors import APIError
from infer.api.ollama import bodies
from infer.api.ollama.models import OllamaChatRequest, OllamaGenerateRequest
from infer.api.tools import Call
from infer.api.usage import Counts
from infer.api.writer import Event, Ticket, Writer
from infer.engine.request import Outcome, StepOutput


def generate_writer(
    body: OllamaGenerateRequest, ticket: Ticket, clock: Callable[[], float], load_s: float = 0.0
) -> OllamaWriter:
    """The writer of an admitted ``/api/generate`` request."""
    return OllamaWriter(ticket, body.model, body.stream, False, clock, load_s=load_s)


def chat_writer(
    body: OllamaChatRequest, ticket: Ticket, clock: Callable[[], float], load_s: float = 0.0
) -> OllamaWriter:
    """The writer of an admitted ``/api/chat`` request."""
    return OllamaWriter(ticket, body.model, body.stream, True, clock, load_s=load_s)


class OllamaWriter(Writer):
    """Ollama's lines (or body) for one reply.

    Args:
        ticket: The admitted request (its tools and how its reply may reason).
        model: The model's name as the client gave it (every line carries it).
        streamed: Whether the client reads lines.
        chat: ``/api/chat``'s ``message`` (else ``/api/generate``'s ``response``).
        clock: The clock of the ticket's timing (the host's).
        wall: Unix time, for ``created_at``.
        load_s: How long the request waited for its model to be loaded.
    """

    def __init__(
        self,
        ticket: Ticket,
        model: str,
        streamed: bool,
        chat: bool,
        clock: Callable[[], float],
        wall: Callable[[], float] = time.time,
        load_s: float = 0.0,
    ) -> None:
        super().__init__(streamed)
        self.ticket, self.model, self.chat = ticket, model, chat
        self.clock, self.wall, self.load_s = clock, wall, load_s
        self.reply = (
            ReplyParser(ticket.plan, ticket.thinking) if ticket.plan or ticket.thinking else None
        )
        self.content: list[str] = []
        self.thinking: list[str] = []
        self.calls: list[Call] = []
        self.outcome: Outcome | None = None

    def is_error(self, out: StepOutput) -> bool:
        return out.outcome is not None and bodies.done_reason(out.outcome) is None

    def output(self, index: int, out: StepOutput) -> list[Event]:
        content, thinking, calls = self._read(out)
        self.content.append(content)
        self.thinking.append(thinking)
        self.calls += calls
        if out.outcome is not None:
            self.outcome = out.outcome
        if not self.streamed or not (content or thinking or calls):
            return []
        return [Event(self._line(content, thinking, calls))]

    def finish(self, counts: Counts) -> list[Event]:
        return [Event(self._line("", "", [], counts))] if self.streamed else []

    def failed(self, error: APIError, counts: Counts) -> list[Event]:
        return [Event(bodies.error_body(error))]

    def body(self, counts: Counts) -> dict[str, Any]:
        return self._line("".join(self.content), "".join(self.thinking), self.calls, counts)

    def _read(self, out: StepOutput) -> tuple[str, str, list[Call]]:
        """What an output adds: content, thinking, and the calls it completed."""
        if self.reply is None:
            return out.text_delta, "", []
        delta = self.reply.feed(out.text_delta)
        if out.outcome is not None:
            delta.extend(self.reply.finish())
        return delta.content, delta.reasoning, self.reply.calls[len(self.calls) :]

    def _line(
        self, content: str, thinking: str, calls: list[Call], counts: Counts | None = None
    ) -> dict[str, Any]:
        """One line (with ``counts``: the last, ``done``)."""
        line: dict[str, Any] = {"model": self.model, "created_at": bodies.timestamp(self.wall())}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = [_call(c) for c in calls]
            line["message"] = message
        else:
            line["response"] = content
            if thinking:
                line["thinking"] = thinking
        line["done"] = counts is not None
        if counts is None:
            return line
        assert self.outcome is not None  # the reply has ended
        line["done_reason"] = bodies.done_reason(self.outcome)
        timing = self.ticket.timing
        spent = bodies.durations(
            timing, self.clock(), counts.prompt_tokens, counts.completion_tokens, self.load_s
        )
        return line | spent


def _call(call: Call) -> dict[str, Any]:
    """A call as Ollama writes it: its arguments an object."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        arguments = None
    if not isinstance(arguments, dict):
        arguments = {}  # a call's grammar makes it an object; an object it stays
    return {
        "id": call.id,
        "function": {"index": call.index, "name": call.name, "arguments": arguments},
    }
