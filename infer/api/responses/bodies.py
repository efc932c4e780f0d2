"""OpenAI's Responses API objects, built from a chat reply as it streams.

A response's ``output`` is a list of items: a ``reasoning`` item when the model reasoned, a
``message`` item with one ``output_text`` part when it wrote text, and one ``function_call``
item per call. :class:`ResponseBuilder` is fed the pieces of a reply
(:class:`~infer.api.chat.ReplyDelta`) and gives the stream's events for each: an item is
announced (``response.output_item.added``) when its first piece arrives, grows by
``...delta`` events, and is closed (``...done`` events, ``response.output_item.done``) when
another kind of item begins or the reply ends. The whole response, with the same items, is
:meth:`ResponseBuilder.response`; a non-streamed answer is built the same way and its
events dropped.

Every event carries its ``type`` and a ``sequence_number`` from 0; the stream is
``response.created``, ``response.in_progress``, the items' events, then exactly one of
``response.completed``, ``response.incomplete`` (the token limit) or ``response.failed``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, Literal, cast

from pydantic import Field
from typing_extensions import TypedDict

from infer.api.chat import ReplyDelta, ReplyParser
from infer.api.tools import Call
from infer.api.usage import Counts

Status = Literal["in_progress", "completed", "incomplete", "failed"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]
Event = dict[str, Any]


class Reasoning(TypedDict):
    effort: str | None
    summary: str | None


class Echo(TypedDict):
    """The request fields a response object repeats."""

    instructions: str | None
    max_output_tokens: int | None
    metadata: dict[str, str]
    parallel_tool_calls: bool
    previous_response_id: str | None
    reasoning: Reasoning
    store: bool
    temperature: float
    text: dict[str, Any]
    tool_choice: str | dict[str, str]
    tools: list[dict[str, Any]]
    top_p: float
    truncation: Literal["disabled"]
    user: str | None
    background: bool


@dataclass(frozen=True)
class Head:
    """What the response object echoes of its request, and its identity.

    Args:
        id: ``resp_...``.
        created_at: Unix time of the request.
        model: The served model's name.
        echo: The request fields the object repeats (``instructions``, ``tools``,
            ``tool_choice``, ``temperature``...), already in the response's shape.
    """

    id: str
    created_at: int
    model: str
    echo: Echo | None = field(default=None)


class InputTokensDetails(TypedDict):
    cached_tokens: Annotated[int, Field(description="input tokens served from the prefix cache")]


class OutputTokensDetails(TypedDict):
    reasoning_tokens: int


class ResponseUsage(TypedDict):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


def usage(counts: Counts, reasoning_tokens: int = 0) -> ResponseUsage:
    """The Responses ``usage`` of what a request used."""
    return {
        "input_tokens": counts.prompt_tokens,
        "input_tokens_details": {"cached_tokens": counts.cached_tokens},
        "output_tokens": counts.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": counts.prompt_tokens + counts.completion_tokens,
    }


class OutputText(TypedDict):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]
    logprobs: list[Any]


class ReasoningText(TypedDict):
    type: Literal["reasoning_text"]
    text: str


class OutputMessage(TypedDict):
    """An assistant `message` item with its one `output_text` part."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputText]


class OutputFunctionCall(TypedDict):
    """A `function_call` item (`arguments`: the JSON text read so far)."""

    id: str
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


class OutputReasoning(TypedDict):
    """A `reasoning` item: the reasoning block's text as its content."""

    id: str
    type: Literal["reasoning"]
    summary: list[Any]
    content: list[ReasoningText]
    status: ItemStatus


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class ResponseError(TypedDict):
    code: str
    message: str


class IncompleteDetails(TypedDict):
    reason: str


class ResponseObject(Echo):
    """`POST /v1/responses` with `stream: false` (streamed: the same object ends the
    `response.completed`/`response.incomplete`/`response.failed` event)."""

    id: str
    object: Literal["response"]
    created_at: int
    status: Status
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None


def message_item(item_id: str, text: str, status: ItemStatus) -> OutputMessage:
    """An assistant ``message`` item with its one ``output_text`` part."""
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [_text_part(text)] if status != "in_progress" or text else [],
    }


def call_item(item_id: str, call: Call, arguments: str, status: ItemStatus) -> OutputFunctionCall:
    """A ``function_call`` item (``arguments``: the JSON text read so far)."""
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(item_id: str, text: str, status: ItemStatus) -> OutputReasoning:
    """A ``reasoning`` item: the reasoning block's text as its content (no summary is
    written: the text is given whole)."""
    content: list[ReasoningText] = (
        [{"type": "reasoning_text", "text": text}] if text or status != "in_progress" else []
    )
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _text_part(text: str) -> OutputText:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class _Open:
    """The item being written, with its position in ``output``."""

    kind: Literal["reasoning", "message"]
    index: int
    item_id: str
    text: str = ""


class ResponseBuilder:
    """One response's items and events, as its reply is read.

    Args:
        head: The response's identity and echoed request fields.
    """

    def __init__(self, head: Head) -> None:
        self.head = head
        self.output: list[OutputItem] = []
        self._seq = 0
        self._open: _Open | None = None
        self._calls: dict[int, tuple[int, str]] = {}  # call index -> (output index, arguments)
        self._call_objects: dict[int, Call] = {}

    def response(
        self,
        status: Status,
        usage: ResponseUsage | None = None,
        error: ResponseError | None = None,
    ) -> ResponseObject:
        """The response object as it stands (``status`` and, once known, ``usage``)."""
        incomplete: IncompleteDetails | None = (
            {"reason": "max_output_tokens"} if status == "incomplete" else None
        )
        response: dict[str, Any] = {
            "id": self.head.id,
            "object": "response",
            "created_at": self.head.created_at,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "model": self.head.model,
            "output": [dict(item) for item in self.output],
            "usage": usage,
        }
        if self.head.echo is not None:
            response.update(self.head.echo)
        return cast(ResponseObject, response)  # the echo is left out only in tests

    def start(self) -> list[Event]:
        """``response.created`` and ``response.in_progress``."""
        now = self.response("in_progress")
        return [
            self._event("response.created", response=now),
            self._event("response.in_progress", response=now),
        ]

    def feed(self, delta: ReplyDelta) -> list[Event]:
        """The events of one piece of the reply: reasoning, then text, then calls."""
        events: list[Event] = []
        if delta.reasoning:
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            events += self._text("message", delta.content)
        for call, piece in delta.calls:
            if call.index not in self._calls:
                events += self._close_text()
                events += self._open_call(call)
            self._call_objects[call.index] = call
            index, arguments = self._calls[call.index]
            self._calls[call.index] = (index, arguments + piece)
            item_id = self.output[index]["id"]
            self.output[index] = call_item(item_id, call, arguments + piece, "in_progress")
            if piece:
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item_id,
                        output_index=index,
                        delta=piece,
                    )
                )
        return events

    def finish(
        self,
        reply: ReplyParser,
        status: Status,
        usage: ResponseUsage | None,
        error: ResponseError | None = None,
    ) -> list[Event]:
        """Close every item and end with the one terminal event.

        A call read to its end is ``completed``; one cut off part-way is ``incomplete``.
        ``status`` is ``completed``, ``incomplete`` (the token limit) or ``failed``.
        """
        item_status: ItemStatus = "completed" if status == "completed" else "incomplete"
        events = self._close_text(item_status)
        complete = {c.index for c in reply.calls}
        for call_index, (index, arguments) in sorted(self._calls.items()):
            done: ItemStatus = "completed" if call_index in complete else "incomplete"
            call = self._call_objects[call_index]
            item = call_item(self.output[index]["id"], call, arguments, done)
            self.output[index] = item
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=arguments,
                )
            )
            events.append(self._event("response.output_item.done", output_index=index, item=item))
        self._calls.clear()
        kind = {"completed": "completed", "incomplete": "incomplete"}.get(status, "failed")
        events.append(self._event(f"response.{kind}", response=self.response(status, usage, error)))
        return events

    def _event(self, kind: str, **fields: Any) -> Event:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return event

    def _text(self, kind: Literal["reasoning", "message"], piece: str) -> list[Event]:
        events: list[Event] = []
        current = self._open
        if current is None or current.kind != kind:
            events += self._close_text()
            events += self._open_text(kind)
        current = self._open
        assert current is not None  # just opened
        current.text += piece
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        events.append(
            self._event(
                f"response.{name}.delta",
                item_id=current.item_id,
                output_index=current.index,
                content_index=0,
                delta=piece,
                **({"logprobs": []} if kind == "message" else {}),
            )
        )
        return events

    def _open_text(self, kind: Literal["reasoning", "message"]) -> list[Event]:
        index = len(self.output)
        prefix = "rs" if kind == "reasoning" else "msg"
        item_id = f"{prefix}_{self.head.id.removeprefix('resp_')}_{index}"
        self._open = _Open(kind, index, item_id)
        item: OutputItem
        part: OutputText | ReasoningText
        if kind == "reasoning":
            item = reasoning_item(item_id, "", "in_progress")
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = message_item(item_id, "", "in_progress")
            part = _text_part("")
        self.output.append(item)
        return [
            self._event("response.output_item.added", output_index=index, item=dict(item)),
            self._event(
                "response.content_part.added",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=part,
            ),
        ]

    def _close_text(self, status: ItemStatus = "completed") -> list[Event]:
        current = self._open
        if current is None:
            return []
        self._open = None
        index, item_id, text = current.index, current.item_id, current.text
        extra: dict[str, Any]
        item: OutputItem
        part: OutputText | ReasoningText
        if current.kind == "reasoning":
            item = reasoning_item(item_id, text, status)
            part = {"type": "reasoning_text", "text": text}
            name, extra = "response.reasoning_text.done", {}
        else:
            item = message_item(item_id, text, status)
            part = _text_part(text)
            name, extra = "response.output_text.done", {"logprobs": []}
        done = self._event(
            name, item_id=item_id, output_index=index, content_index=0, text=text, **extra
        )
        self.output[index] = item
        return [
            done,
            self._event(
                "response.content_part.done",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=part,
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _open_call(self, call: Call) -> list[Event]:
        index = len(self.output)
        item_id = f"fc_{self.head.id.removeprefix('resp_')}_{index}"
        item = call_item(item_id, call, "", "in_progress")
        self.output.append(item)
        self._calls[call.index] = (index, "")
        return [self._event("response.output_item.added", output_index=index, item=dict(item))]


def error(message: str) -> ResponseError:
    """The ``error`` of a failed response (OpenAI's code for a failure on its side)."""
    return {"code": "server_error", "message": message}
