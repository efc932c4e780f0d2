"""Anthropic's message object, its stream's events and its error body, built from a chat
reply as it streams; their types are what ``/openapi.json`` documents.

A message's ``content`` is a list of blocks: ``thinking`` when the model reasoned, ``text``,
and one ``tool_use`` per call, in the order the reply wrote them. :class:`BlockBuilder` is
fed the pieces of a reply (:class:`~infer.api.chat.ReplyDelta`) and gives the stream's
events for each: a block starts (``content_block_start``, numbered from 0) when its first
piece arrives, grows by ``content_block_delta`` events (``thinking_delta``, ``text_delta``,
``input_json_delta``: the call's input as pieces of one JSON text), and stops when another
block begins or the reply ends. The stream is ``message_start``, the blocks' events,
``message_delta`` (the stop reason and the usage), ``message_stop``; ``ping`` is its
heartbeat, and a failure after it started is one ``error`` event.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

from typing_extensions import TypedDict

from infer.api.chat import ReplyDelta, ReplyParser
from infer.api.errors import APIError, ErrorCode
from infer.api.tools import Call
from infer.api.usage import Counts
from infer.engine.request import Failure, FinishReason, Outcome

StopReason = Literal[
    "end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"
]
Event = dict[str, Any]
PING: Event = {"type": "ping"}
# A thinking block's `signature` lets Anthropic verify thinking sent back to it; here
# thinking sent back is dropped, so there is nothing to sign.
SIGNATURE = ""


class AnthropicUsage(TypedDict):
    """Tokens used. `input_tokens` are the prompt's tokens the prefix cache did not serve;
    `cache_read_input_tokens` those it did."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


class TextContentBlock(TypedDict):
    type: Literal["text"]
    text: str


class ThinkingContentBlock(TypedDict):
    type: Literal["thinking"]
    thinking: str
    signature: str  # always "": thinking sent back is not read again


class ToolUseContentBlock(TypedDict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextContentBlock | ThinkingContentBlock | ToolUseContentBlock


class AnthropicMessage(TypedDict):
    """`POST /v1/messages` with `stream: false` (streamed: the same message, in events)."""

    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: AnthropicUsage


class AnthropicTokenCount(TypedDict):
    """`POST /v1/messages/count_tokens`: the prompt's tokens, template and tools included."""

    input_tokens: int


class AnthropicErrorDetail(TypedDict):
    type: str
    message: str


class AnthropicError(TypedDict):
    """Every error of Anthropic's routes (and a stream's `error` event)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


# Anthropic's error type for each status (others: invalid_request_error or api_error).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
# Where Anthropic answers with another status than infer's table: a body it cannot take
# is a 400 (infer's is 422), an unknown model a 404.
STATUSES = {ErrorCode.MODEL_NOT_FOUND: 404}
_TOO_LONG = (ErrorCode.CONTEXT_LENGTH_EXCEEDED, ErrorCode.PROMPT_TOO_LARGE)


def error_body(error: APIError) -> AnthropicError:
    """Anthropic's error shape; a prompt that does not fit says ``prompt is too long``, as
    Anthropic's does (clients such as Claude Code compact their history on it)."""
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else None)
    message = error.message
    if error.code in _TOO_LONG:
        message = f"prompt is too long: {message}"
    elif error.code is ErrorCode.INVALID_API_KEY:
        message = "send a valid key: x-api-key: <key>, or Authorization: Bearer <key>"
    return {
        "type": "error",
        "error": {"type": kind or "invalid_request_error", "message": message},
    }


@contextmanager
def statuses() -> Iterator[None]:
    """Answer the refusals raised in the block with Anthropic's statuses (400 for a body it
    cannot take, 404 for an unknown model), and tell the SDK not to retry a failure that
    would fail again (``x-should-retry: false``)."""
    try:
        yield
    except APIError as e:
        status = STATUSES.get(e.code, 400 if e.status == 422 else e.status)
        headers = dict(e.headers)
        if not e.code.retryable:
            headers["x-should-retry"] = "false"
        raise APIError(e.code, e.message, headers, status=status) from None


def error_event(error: APIError) -> Event:
    """The ``error`` event of a stream that fails after it started."""
    return dict(error_body(error))


def usage(counts: Counts) -> AnthropicUsage:
    """What a reply used: the prompt split into what the prefix cache served and the rest."""
    return {
        "input_tokens": counts.prompt_tokens - counts.cached_tokens,
        "output_tokens": counts.completion_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": counts.cached_tokens,
    }


def stop_reason(outcome: Outcome, calls: bool, limit: int, used: int) -> StopReason | None:
    """Why a reply ended: by itself (``tool_use`` after complete calls), at a stop
    sequence, at ``max_tokens`` (``limit``), or where the context ran out before it
    (``used`` tokens, fewer than the limit); ``None`` for a failure."""
    if isinstance(outcome, Failure):
        return None
    if outcome is FinishReason.LENGTH:
        return "max_tokens" if used >= limit else "model_context_window_exceeded"
    if calls:
        return "tool_use"
    return "stop_sequence" if outcome is FinishReason.STOP else "end_turn"


@dataclass(frozen=True)
class Head:
    """What a message is before its content: its id, model and prompt size."""

    id: str
    model: str
    prompt_tokens: int


def message(
    head: Head,
    content: list[ContentBlock],
    stop: StopReason | None,
    stop_sequence: str | None,
    used: AnthropicUsage,
) -> AnthropicMessage:
    return {
        "id": head.id,
        "type": "message",
        "role": "assistant",
        "model": head.model,
        "content": content,
        "stop_reason": stop,
        "stop_sequence": stop_sequence,
        "usage": used,
    }


def message_start(head: Head) -> Event:
    """The first event. What the prefix cache served is not known yet: the prompt counts
    as ``input_tokens`` here, and ``message_delta`` splits it."""
    start: AnthropicUsage = {
        "input_tokens": head.prompt_tokens,
        "output_tokens": 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }
    return {"type": "message_start", "message": message(head, [], None, None, start)}


def message_end(
    stop: StopReason | None, stop_sequence: str | None, used: AnthropicUsage
) -> list[Event]:
    """``message_delta`` (why it stopped, what it used) and ``message_stop``."""
    delta = {"stop_reason": stop, "stop_sequence": stop_sequence}
    return [
        {"type": "message_delta", "delta": delta, "usage": dict(used)},
        {"type": "message_stop"},
    ]


def tool_use_id(call: Call) -> str:
    """A call's id in Anthropic's form (``toolu_...``)."""
    return "toolu_" + call.id.removeprefix("call_")


@dataclass
class _Block:
    kind: Literal["thinking", "text", "tool_use"]
    text: str = ""  # the thinking, the text, or the call's input as JSON text
    call: Call | None = None


@dataclass
class BlockBuilder:
    """One message's content blocks and their events, as its reply is read."""

    blocks: list[_Block] = field(default_factory=list)
    _open: int | None = None  # the index of the block being written
    _calls: dict[int, int] = field(default_factory=dict)  # call index -> block index

    def feed(self, delta: ReplyDelta) -> list[Event]:
        """The events of one piece of the reply: thinking, then text, then calls."""
        events: list[Event] = []
        if delta.reasoning:
            events += self._grow("thinking", delta.reasoning)
        if delta.content:
            events += self._grow("text", delta.content)
        for call, piece in delta.calls:
            if call.index not in self._calls:
                events += self.close()
                events += self._start(_Block("tool_use", call=call))
                self._calls[call.index] = len(self.blocks) - 1
            index = self._calls[call.index]
            self.blocks[index].call = call
            if piece:
                self.blocks[index].text += piece
                json_delta = {"type": "input_json_delta", "partial_json": piece}
                events.append(_delta(index, json_delta))
        return events

    def close(self) -> list[Event]:
        """Stop the block being written (nothing if none is)."""
        if self._open is None:
            return []
        index, self._open = self._open, None
        return [{"type": "content_block_stop", "index": index}]

    def content(self, reply: ReplyParser) -> list[ContentBlock]:
        """The message's blocks; a call cut off part-way is left out (its input is not a
        JSON object)."""
        complete = {c.index for c in reply.calls}
        out: list[ContentBlock] = []
        for block in self.blocks:
            if block.kind == "tool_use":
                assert block.call is not None  # set when it started
                if block.call.index in complete:
                    out.append(_tool_use(block.call, _input(block.text)))
            elif block.kind == "thinking":
                out.append({"type": "thinking", "thinking": block.text, "signature": SIGNATURE})
            else:
                out.append({"type": "text", "text": block.text})
        return out

    def _grow(self, kind: Literal["thinking", "text"], piece: str) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self.blocks[self._open].kind != kind:
            events += self.close()
            events += self._start(_Block(kind))
        index = self._open
        assert index is not None  # just started
        self.blocks[index].text += piece
        if kind == "thinking":
            events.append(_delta(index, {"type": "thinking_delta", "thinking": piece}))
        else:
            events.append(_delta(index, {"type": "text_delta", "text": piece}))
        return events

    def _start(self, block: _Block) -> list[Event]:
        self.blocks.append(block)
        self._open = index = len(self.blocks) - 1
        started: dict[str, Any]
        if block.kind == "tool_use":
            assert block.call is not None
            started = dict(_tool_use(block.call, {}))
        elif block.kind == "thinking":
            started = {"type": "thinking", "thinking": "", "signature": SIGNATURE}
        else:
            started = {"type": "text", "text": ""}
        return [{"type": "content_block_start", "index": index, "content_block": started}]


def _delta(index: int, delta: dict[str, Any]) -> Event:
    return {"type": "content_block_delta", "index": index, "delta": delta}


def _tool_use(call: Call, input_: dict[str, Any]) -> ToolUseContentBlock:
    return {"type": "tool_use", "id": tool_use_id(call), "name": call.name, "input": input_}


def _input(arguments: str) -> dict[str, Any]:
    """A complete call's input (its arguments fit the tool's schema: an object)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
