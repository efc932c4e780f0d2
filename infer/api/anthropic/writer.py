"""The writer of ``/v1/messages``: Anthropic's stream events of one reply, or the whole
message (:class:`MessagesWriter`)."""

from __future__ import annotations

from infer.api.anthropic import bodies
from infer.api.anthropic.models import MessagesRequest
from infer.api.chat import ReplyParser
from infer.api.errors import APIError
from infer.api.usage import Counts
from infer.api.writer import Event, Ticket, Writer
from infer.engine.request import Outcome, StepOutput


def messages_writer(body: MessagesRequest, ticket: Ticket) -> MessagesWriter:
    """The writer of an admitted ``/v1/messages`` request."""
    head = bodies.Head(
        "msg_" + ticket.id.removeprefix("req-"), ticket.model, len(ticket.prompt_ids[0])
    )
    reply = ReplyParser(ticket.plan, ticket.thinking)
    return MessagesWriter(body.stream, head, reply, body.max_tokens)


class MessagesWriter(Writer):
    """Anthropic's events of one reply, or the whole message.

    Args:
        streamed: Whether the client reads events.
        head: The message's id, model and prompt size.
        reply: Reads the reply's thinking, text and tool calls.
        max_tokens: The client's limit (a reply cut short of it ran out of context).
    """

    def __init__(
        self, streamed: bool, head: bodies.Head, reply: ReplyParser, max_tokens: int
    ) -> None:
        super().__init__(streamed)
        self.head = head
        self.reply = reply
        self.max_tokens = max_tokens
        self.blocks = bodies.BlockBuilder()
        self.outcome: Outcome | None = None
        self.stop_sequence: str | None = None
        self.message: bodies.AnthropicMessage | None = None

    def start(self) -> list[Event]:
        return self._events([bodies.message_start(self.head)])

    def output(self, index: int, out: StepOutput) -> list[Event]:
        delta = self.reply.feed(out.text_delta)
        if out.outcome is not None:
            self.outcome, self.stop_sequence = out.outcome, out.stop
            delta.extend(self.reply.finish())
        return self._events(self.blocks.feed(delta))

    def finish(self, counts: Counts) -> list[Event]:
        assert self.outcome is not None  # the reply has ended
        calls = bool(self.reply.calls)
        stop = bodies.stop_reason(self.outcome, calls, self.max_tokens, counts.completion_tokens)
        sequence = self.stop_sequence if stop == "stop_sequence" else None
        used = bodies.usage(counts)
        content = self.blocks.content(self.reply)
        self.message = bodies.message(self.head, content, stop, sequence, used)
        return self._events(self.blocks.close() + bodies.message_end(stop, sequence, used))

    def failed(self, error: APIError, counts: Counts) -> list[Event]:
        return self._events([bodies.error_event(error)])

    def body(self, counts: Counts) -> bodies.AnthropicMessage | None:
        return self.message

    def _events(self, events: list[bodies.Event]) -> list[Event]:
        if not self.streamed:
            return []
        return [Event(e, e["type"]) for e in events]
