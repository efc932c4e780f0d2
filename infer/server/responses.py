"""``POST /v1/responses``: OpenAI's Responses API over the chat path.

The request's input items become chat messages (after the conversation of the response
``previous_response_id`` names, and after ``instructions`` as a system message), and go
through the same admission, chat template, tool plan and reply parser as
``/v1/chat/completions``. The reply is written as Responses output items by
:class:`~infer.api.responses.ResponseBuilder`: streamed as its events, or whole. A response
that did not fail is stored (unless ``store`` is false) so that a later request can
continue it.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import trio
from quart import Blueprint, Response, jsonify

from infer.api import responses
from infer.api.chat import ReplyParser
from infer.api.responses import ResponseBuilder, Status
from infer.engine.params import DEFAULT_MAX_TOKENS
from infer.engine.request import ErrorCode, FinishReason, StepOutput
from infer.server import sse
from infer.server.admission import Prompt, admit, parse_body
from infer.server.errors import APIError
from infer.server.routes import failed, tool_plan
from infer.server.schemas import (
    CalledFunction,
    ChatMessage,
    NamedFunctionChoice,
    ResponsesRequest,
    ToolCall,
    check_tool_results,
)
from infer.server.state import ServerState, get_state
from infer.server.stream import RequestStream

log = logging.getLogger("infer.server")

blueprint = Blueprint("responses", __name__)

Keep = Callable[[ReplyParser], None]


@blueprint.post("/v1/responses")
async def create_response() -> Response:
    """One assistant reply to ``input``, as a Responses object or its event stream."""
    arrival = trio.current_time()
    body = await parse_body(ResponsesRequest)
    state = get_state()
    history: tuple[ChatMessage, ...] = ()
    if body.previous_response_id is not None:
        found = state.responses.get(body.previous_response_id)
        if found is None:
            state.metrics.rejected[ErrorCode.RESPONSE_NOT_FOUND.value] += 1
            raise APIError(
                ErrorCode.RESPONSE_NOT_FOUND,
                f"previous_response_id {body.previous_response_id!r} names no stored "
                "response (unknown, expired, or stored with store: false)",
            )
        history = found
    conversation = body.messages(history)
    try:
        check_tool_results(conversation)
    except ValueError as e:
        state.metrics.rejected[ErrorCode.INVALID_VALUE.value] += 1
        raise APIError(ErrorCode.INVALID_VALUE, f"input: {e}") from None
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    plan = None
    if body.wants_tools():
        choice = body.tool_choice if isinstance(body.tool_choice, str) else None
        plan = tool_plan(
            state,
            body.function_definitions(),
            choice,
            body.forced_tool(),
            body.parallel_tool_calls,
        )
    admitted = await admit(
        state,
        [Prompt(messages=[*system, *conversation], plan=plan)],
        body.sampling_fields(),
        arrival=arrival,
        default_max_tokens=DEFAULT_MAX_TOKENS,
    )
    stream = admitted.stream
    head = responses.Head(
        "resp_" + stream.id.removeprefix("req-"),
        stream.stats.created,
        state.model_name,
        echo(body),
    )
    builder = ResponseBuilder(head)
    reply = ReplyParser(plan, admitted.thinking)

    def keep(parsed: ReplyParser) -> None:
        if body.store:
            state.responses.put(head.id, [*conversation, assistant_message(parsed)])

    if body.stream:
        return sse.stream_response(_events(state, stream, builder, reply, keep))
    return jsonify(await _collect(state, stream, builder, reply, keep))


def echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request fields a response object repeats, in its shape."""
    choice: Any = body.tool_choice or "auto"
    if isinstance(choice, NamedFunctionChoice):
        choice = {"type": "function", "name": choice.name}
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
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
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


def _status(out: StepOutput) -> Status:
    """How a reply that ended with ``out`` ends its response (not a failure)."""
    if out.outcome is FinishReason.LENGTH or out.outcome is ErrorCode.TIMEOUT:
        return "incomplete"
    return "completed"


async def _usage(state: ServerState, stream: RequestStream, reply: ReplyParser) -> dict[str, Any]:
    """The response's usage; its reasoning tokens counted by encoding the reasoning text."""
    reasoning_tokens = 0
    if reply.reasoning and state.engine is not None:
        tokenizer = state.engine.tokenizer
        text = reply.reasoning
        ids = await trio.to_thread.run_sync(
            lambda: tokenizer.encode(text, add_special_tokens=False)
        )
        reasoning_tokens = min(len(ids), stream.usage()["completion_tokens"])
    return responses.usage(stream.usage(), reasoning_tokens)


async def _events(
    state: ServerState,
    stream: RequestStream,
    builder: ResponseBuilder,
    reply: ReplyParser,
    keep: Keep,
) -> AsyncIterator[bytes]:
    """The response's events, ending with exactly one terminal event."""
    with stream:
        yield _frames(builder.start())
        heartbeat_s = state.config.heartbeat_s
        while True:
            try:
                item = await stream.next(heartbeat_s)
                if item is None:
                    yield sse.HEARTBEAT
                    continue
                _, out = item
                if failed(out):
                    message = out.message or cast(ErrorCode, out.outcome).message
                    events = builder.finish(reply, "failed", None, responses.error(message))
                    yield _frames(events)
                    return
                delta = reply.feed(out.text_delta)
                if out.outcome is not None:
                    delta.extend(reply.finish())
                events = builder.feed(delta)
                if out.outcome is not None:
                    status = _status(out)
                    usage = await _usage(state, stream, reply)
                    events += builder.finish(reply, status, usage)
                    keep(reply)
            except Exception:  # noqa: BLE001 - the stream must still end with one terminal
                log.exception("stream %s failed", stream.id)
                stream.fail()
                error = responses.error(ErrorCode.INFERENCE_FAILED.message)
                yield _frames(builder.finish(reply, "failed", None, error))
                return
            yield _frames(events)
            if out.outcome is not None:
                return


def _frames(events: list[dict[str, Any]]) -> bytes:
    return b"".join(sse.event(e, e["type"]) for e in events)


async def _collect(
    state: ServerState,
    stream: RequestStream,
    builder: ResponseBuilder,
    reply: ReplyParser,
    keep: Keep,
) -> dict[str, Any]:
    """Read the reply to its end and build the whole response.

    Raises:
        APIError: The request failed (its code gives the status).
    """
    with stream:
        while True:
            item = await stream.next()
            assert item is not None  # no wait limit was given
            _, out = item
            if failed(out):
                raise APIError(cast(ErrorCode, out.outcome), out.message)
            delta = reply.feed(out.text_delta)
            if out.outcome is not None:
                delta.extend(reply.finish())
                builder.feed(delta)
                break
            builder.feed(delta)
    usage = await _usage(state, stream, reply)
    events = builder.finish(reply, _status(out), usage)
    keep(reply)
    return cast(dict[str, Any], events[-1]["response"])
