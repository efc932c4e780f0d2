"""The writer of ``/v1/responses``: the Responses events of one reply, or the whole response
object (:class:`ResponsesWriter`); a response that did not fail is stored (unless ``store``
is false) so that a later request can continue it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from infer.api.chat import ReplyParser
from infer.api.errors import APIError
from infer.api.messages import CalledFunction, ChatMessage, ToolCall
from infer.api.responses.bodies import (
    Echo,
    Head,
    ResponseBuilder,
    ResponseObject,
    Status,
    error,
    usage,
)
from infer.api.responses.models import NamedFunctionChoice, ResponsesRequest
from infer.api.usage import Counts
from infer.api.writer import Event, Job, Ticket, Writer
from infer.engine.request import Failure, FinishReason, Outcome, StepOutput

Store = Callable[[str, Sequence[ChatMessage]], None]


def responses_writer(
    body: ResponsesRequest, ticket: Ticket, conversation: Sequence[ChatMessage], store: Store
) -> ResponsesWriter:
    """The writer of an admitted ``/v1/responses`` request; ``store`` keeps its
    conversation under the response's id once it has ended without failing."""
    head = Head("resp_" + ticket.id.removeprefix("req-"), ticket.created, ticket.model, echo(body))

    def keep(reply: ReplyParser) -> None:
        if body.store:
            store(head.id, [*conversation, assistant_message(reply)])

    reply = ReplyParser(ticket.plan, ticket.thinking)
    return ResponsesWriter(ticket, body.stream, ResponseBuilder(head), reply, keep)


def echo(body: ResponsesRequest) -> Echo:
    """The request fields a response object repeats, in its shape."""
    choice: str | dict[str, str] = body.tool_choice or "auto"  # type: ignore[assignment]
    if isinstance(body.tool_choice, NamedFunctionChoice):
        choice = {"type": "function", "name": body.tool_choice.name}
    fmt = body.text.format if body.text is not None else None
    text: dict[str, Any] = {
        "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
    }
    if body.text is not None and body.text.verbosity is not None:
        text["verbosity"] = body.text.verbosity
    reasoning = body.reasoning
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": reasoning.summary if reasoning else None,
        },
        "store": body.store,
        "temperature": body.temperature,
        "text": text,
        "tool_choice": choice,
        "tools": [
            {"type": t.type, **t.model_dump(exclude_none=True, exclude={"type"})}
            for t in body.tools or []
        ],
        "top_p": body.top_p,
        "truncation": "disabled",
        "user": body.user,
        "background": False,
    }


def assistant_message(reply: ReplyParser) -> ChatMessage:
    """The reply as the chat history's assistant message: its text and complete calls (its
    reasoning is not sent back, as on the chat route)."""
    calls = [
        ToolCall(id=c.id, function=CalledFunction(name=c.name, arguments=c.arguments))
        for c in reply.calls
    ]
    content = reply.content or (None if calls else "")
    return ChatMessage(role="assistant", content=content, tool_calls=calls or None)


class ResponsesWriter(Writer):
    """The Responses events of one reply, or the whole response object.

    Args:
        ticket: The admitted request (its tokenizer counts reasoning tokens).
        streamed: Whether the client reads events.
        builder: Builds the response's items and events.
        reply: Reads the reply's reasoning, text and tool calls.
        keep: Stores the conversation once the response has ended without failing.
    """

    def __init__(
        self,
        ticket: Ticket,
        streamed: bool,
        builder: ResponseBuilder,
        reply: ReplyParser,
        keep: Callable[[ReplyParser], None],
    ) -> None:
        super().__init__(streamed)
        self.ticket = ticket
        self.builder = builder
        self.reply = reply
        self.keep = keep
        self.outcome: Outcome | None = None
        self.response: ResponseObject | None = None
        self._reasoning_tokens = 0

    def is_error(self, out: StepOutput) -> bool:
        return isinstance(out.outcome, Failure) and out.outcome is not Failure.TIMEOUT

    def start(self) -> list[Event]:
        return self._events(self.builder.start())

    def output(self, index: int, out: StepOutput) -> list[Event]:
        delta = self.reply.feed(out.text_delta)
        if out.outcome is not None:
            self.outcome = out.outcome
            delta.extend(self.reply.finish())
        return self._events(self.builder.feed(delta))

    def finish_work(self) -> Job | None:
        """Counts the reasoning's tokens by encoding it."""
        text, tokenizer = self.reply.reasoning, self.ticket.tokenizer
        if not text:
            return None

        def run() -> None:
            self._reasoning_tokens = len(tokenizer.encode(text, add_special_tokens=False))

        return run

    def finish(self, counts: Counts) -> list[Event]:
        incomplete = self.outcome in (FinishReason.LENGTH, Failure.TIMEOUT)
        status: Status = "incomplete" if incomplete else "completed"
        reasoning_tokens = min(self._reasoning_tokens, counts.completion_tokens)
        events = self.builder.finish(self.reply, status, usage(counts, reasoning_tokens))
        self.keep(self.reply)
        self.response = events[-1]["response"]
        return self._events(events)

    def failed(self, error_: APIError, counts: Counts) -> list[Event]:
        failure = error(error_.message)
        return self._events(self.builder.finish(self.reply, "failed", None, failure))

    def body(self, counts: Counts) -> ResponseObject | None:
        return self.response

    def _events(self, events: list[dict[str, Any]]) -> list[Event]:
        if not self.streamed:
            return []
        return [Event(e, e["type"]) for e in events]
