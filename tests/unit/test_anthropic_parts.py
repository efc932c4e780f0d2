"""Anthropic's Messages API, its pure parts: a body's conversion into chat messages and the
engine request, the refusals, the writer's events in order, the error shape and statuses."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from infer.api.anthropic import bodies
from infer.api.anthropic.models import CountTokensRequest, MessagesRequest
from infer.api.anthropic.writer import messages_writer
from infer.api.errors import APIError, ErrorCode
from infer.api.tools import Tool, ToolPlan
from infer.api.usage import Counts
from infer.api.writer import Event, Ticket
from infer.engine.request import Failure, FinishReason, StepOutput
from infer.server.edge.framing import sse_with_heartbeat

READ = {
    "name": "Read",
    "description": "Read a file",
    "input_schema": {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "properties": {"file_path": {"type": "string"}},
        "required": ["file_path"],
        "additionalProperties": False,
    },
    "cache_control": {"type": "ephemeral"},
}


def _billing(cch: str) -> dict[str, Any]:
    text = f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={cch};"
    return {"type": "text", "text": text}


def _body(**fields: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    } | fields


def test_a_conversation_becomes_chat_messages() -> None:
    body = MessagesRequest.model_validate(
        _body(
            system=[_billing("a5145"), {"type": "text", "text": "You are Claude Code."}],
            messages=[
                {"role": "user", "content": [{"type": "text", "text": "read a.py"}]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "I should read it.", "signature": "s"},
                        {"type": "text", "text": "Reading."},
                        {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"a": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_1",
                            "content": [{"type": "text", "text": "no such file"}],
                            "is_error": True,
                            "cache_control": {"type": "ephemeral"},
                        },
                        {"type": "text", "text": "try b.py"},
                    ],
                },
            ],
            tools=[READ],
        )
    )
    turns = [m.model_dump(exclude_none=True) for m in body.chat_messages()]
    assert turns[0] == {
        "role": "system",
        "content": "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; "
        "cch=00000;\n\nYou are Claude Code.",
    }
    assert turns[1] == {"role": "user", "content": "read a.py"}
    call = {
        "id": "toolu_1",
        "type": "function",
        "function": {"name": "Read", "arguments": {"a": 1}},
    }
    assert turns[2] == {"role": "assistant", "content": "Reading.", "tool_calls": [call]}
    assert turns[3] == {
        "role": "tool",
        "content": "Error: no such file",
        "tool_call_id": "toolu_1",
        "name": "Read",
    }
    assert turns[4] == {"role": "user", "content": "try b.py"}


def test_the_billing_stamp_is_made_constant_so_prompts_share_a_prefix() -> None:
    first, second = (
        MessagesRequest.model_validate(_body(system=[_billing(cch), {"type": "text", "text": "x"}]))
        for cch in ("a5145", "9f3e1")
    )
    assert first.system_text() == second.system_text()
    plain = MessagesRequest.model_validate(_body(system="cch=a5145; stays"))
    assert plain.system_text() == "cch=a5145; stays"  # only the billing line is touched


def test_the_engine_request_caps_max_tokens_by_the_room_left() -> None:
    body = MessagesRequest.model_validate(
        _body(
            max_tokens=32000,
            stop_sequences=["END"],
            temperature=0,
            top_k=5,
            metadata={"user_id": '{"device_id": "d", "session_id": "s"}'},
            context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            output_config={"effort": "medium"},
            thinking={"type": "adaptive"},
            service_tier="auto",
        )
    )
    request = body.engine_request()
    assert request.max_tokens is None and request.default_max_tokens == 32000
    assert request.params.stop == ["END"] and request.params.top_k == 5
    assert request.params.temperature == 0
    assert request.prompts[0].template_kwargs is None  # adaptive: the template's default
    assert request.tools is None and request.json_schema is None


@pytest.mark.parametrize(
    ("thinking", "kwargs"),
    [
        (None, {"enable_thinking": False}),  # as Anthropic's models: no thinking unless asked
        ({"type": "disabled"}, {"enable_thinking": False}),
        ({"type": "enabled", "budget_tokens": 2048}, {"enable_thinking": True}),
        ({"type": "adaptive"}, None),
    ],
)
def test_thinking_reaches_the_template(thinking: Any, kwargs: Any) -> None:
    fields = {"thinking": thinking} if thinking else {}
    body = CountTokensRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )
    assert body.prompt().template_kwargs == kwargs


@pytest.mark.parametrize(
    ("choice", "mode", "names", "parallel"),
    [
        ({"type": "auto"}, "auto", ["Read", "Write"], True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", ["Read", "Write"], False),
        ({"type": "tool", "name": "Write"}, "forced", ["Write"], True),
        ({"type": "none"}, None, None, None),
    ],
)
def test_tool_choice(choice: Any, mode: Any, names: Any, parallel: Any) -> None:
    write = READ | {"name": "Write"}
    request = MessagesRequest.model_validate(
        _body(tools=[READ, write], tool_choice=choice)
    ).engine_request()
    if mode is None:
        assert request.tools is None  # none: no tools offered
        return
    assert request.tools is not None
    assert (request.tools.mode, request.tools.parallel) == (mode, parallel)
    assert [t.name for t in request.tools.tools] == names


def test_output_config_format_is_structured_output() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = MessagesRequest.model_validate(
        _body(output_config={"format": {"type": "json_schema", "schema": schema}})
    )
    assert body.engine_request().json_schema == schema


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "image blocks are not supported",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "document blocks are not supported",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "tool_result",
                                "tool_use_id": "t",
                                "content": [{"type": "image", "source": {}}],
                            }
                        ],
                    }
                ]
            },
            "image blocks are not supported",
        ),
        ({"messages": [{"role": "user", "content": [{"type": "foo"}]}]}, "no content block"),
        ({"messages": [{"role": "user", "content": [{"type": ["text"]}]}]}, "content"),
        (
            {"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]},
            "'web_search_20250305' tools are not supported",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "x", "content": "1"}],
                    }
                ]
            },
            "answers no tool_use block",
        ),
        ({"tool_choice": {"type": "any"}}, "tool_choice 'any' needs tools"),
        ({"tools": [READ], "tool_choice": {"type": "tool", "name": "Write"}}, "'Write'"),
        ({"tools": [READ | {"input_schema": {"type": "string"}}]}, "type 'object'"),
        ({"messages": []}, "at least 1"),
        ({"max_tokens": 0}, "greater than or equal to 1"),
        ({"thinking": {"type": "enabled"}}, "budget_tokens"),
        ({"frequency_penalty": 1}, "frequency_penalty"),
    ],
)
def test_bodies_it_cannot_take_are_refused_by_name(fields: Any, says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        MessagesRequest.model_validate(_body(**fields))
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({k: v for k, v in _body().items() if k != "max_tokens"})


class _Tokens:
    def decode(self, ids: list[int]) -> str:
        return ""

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return []


class _Timing:
    arrival = 0.0
    first_token_at: float | None = 0.5


def _writer(stream: bool, plan: ToolPlan | None = None, **fields: Any) -> Any:
    body = MessagesRequest.model_validate(_body(stream=stream, **fields))
    ticket = Ticket("req-7", 0, "m", [[1] * 10], 1, _Tokens(), _Timing(), plan, "auto")
    return messages_writer(body, ticket)


def _run(writer: Any, pieces: list[str], outcome: Any, stop: str | None = None) -> list[Event]:
    events = writer.start()
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        out = StepOutput("req-7", i, piece, outcome if last else None, stop=stop if last else None)
        events += writer.output(0, out)
    return events + writer.finish(Counts(10, len(pieces), cached_tokens=8))


PLAN = ToolPlan((Tool("Read", None, READ["input_schema"]),), "auto", True, "hermes")
REPLY = [
    "<think>",
    "Look at",
    " it.</think>\n\n",
    "Sure.",
    '<tool_call>\n{"name": "Read", "arguments": {"file_path": ',
    '"/a.py"}}\n</tool_call>',
]


def test_the_stream_numbers_blocks_from_zero_in_anthropics_order() -> None:
    events = _run(_writer(True, PLAN), REPLY, FinishReason.EOS)
    assert all(e.name == e.data["type"] for e in events)
    names = [e.name for e in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    start = events[0].data["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == 10
    blocks = [e.data for e in events if e.name == "content_block_start"]
    assert [(b["index"], b["content_block"]["type"]) for b in blocks] == [
        (0, "thinking"),
        (1, "text"),
        (2, "tool_use"),
    ]
    assert blocks[0]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    tool = blocks[2]["content_block"]
    assert tool["id"].startswith("toolu_") and tool["input"] == {} and tool["name"] == "Read"
    stops = [e.data["index"] for e in events if e.name == "content_block_stop"]
    assert stops == [0, 1, 2]
    order = [(e.name, e.data.get("index")) for e in events if e.name.startswith("content_block")]
    for index in (0, 1, 2):  # each block starts, grows, then stops, one after another
        mine = [name for name, i in order if i == index]
        assert mine[0] == "content_block_start" and mine[-1] == "content_block_stop"
    deltas = [e.data["delta"] for e in events if e.name == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == "Look at it."
    assert "".join(d.get("text", "") for d in deltas) == "Sure."
    partial = "".join(d.get("partial_json", "") for d in deltas)
    assert json.loads(partial) == {"file_path": "/a.py"}
    end = events[-2].data
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"] == {
        "input_tokens": 2,
        "output_tokens": len(REPLY),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 8,
    }


def test_a_whole_message_has_the_same_blocks() -> None:
    writer = _writer(False, PLAN)
    assert _run(writer, REPLY, FinishReason.EOS) == []
    message = writer.body(Counts(10, 6, cached_tokens=8))
    assert message["id"] == "msg_7" and message["type"] == "message"
    content = message["content"]
    assert content[0] == {"type": "thinking", "thinking": "Look at it.", "signature": ""}
    assert content[1] == {"type": "text", "text": "Sure."}
    assert content[2]["input"] == {"file_path": "/a.py"}
    assert message["stop_reason"] == "tool_use" and message["stop_sequence"] is None


@pytest.mark.parametrize(
    ("max_tokens", "outcome", "stop", "reason", "sequence"),
    [
        (64, FinishReason.EOS, None, "end_turn", None),
        (64, FinishReason.STOP, "END", "stop_sequence", "END"),
        (2, FinishReason.LENGTH, None, "max_tokens", None),
        (64, FinishReason.LENGTH, None, "model_context_window_exceeded", None),
    ],
)
def test_why_a_reply_stopped(
    max_tokens: int, outcome: Any, stop: Any, reason: str, sequence: Any
) -> None:
    writer = _writer(False, None, max_tokens=max_tokens, stop_sequences=["END"])
    _run(writer, ["Hi", " there"], outcome, stop)
    message = writer.body(Counts(10, 2))
    assert (message["stop_reason"], message["stop_sequence"]) == (reason, sequence)
    assert message["content"] == [{"type": "text", "text": "Hi there"}]


def test_a_failure_after_the_start_is_one_error_event() -> None:
    writer = _writer(True)
    events = writer.start() + writer.output(0, StepOutput("req-7", 1, "Hi", None))
    error = APIError(ErrorCode.of(Failure.OUT_OF_MEMORY))
    [event] = writer.fail(error, Counts(10, 1))
    assert event.name == "error"
    assert event.data == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": error.message},
    }
    assert [e.name for e in events] == [
        "message_start",
        "content_block_start",
        "content_block_delta",
    ]


def test_errors_in_anthropics_shape_and_statuses() -> None:
    def answered(code: ErrorCode, message: str | None = None) -> APIError:
        try:
            with bodies.statuses():
                raise APIError(code, message)
        except APIError as e:
            return e
        raise AssertionError("not raised")

    invalid = answered(ErrorCode.INVALID_VALUE, "max_tokens: Field required")
    assert invalid.status == 400 and invalid.headers["x-should-retry"] == "false"
    assert bodies.error_body(invalid) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
    }
    missing = answered(ErrorCode.MODEL_NOT_FOUND)
    assert missing.status == 404
    assert bodies.error_body(missing)["error"]["type"] == "not_found_error"
    busy = answered(ErrorCode.QUEUE_FULL)
    assert busy.status == 503 and "x-should-retry" not in busy.headers
    assert bodies.error_body(busy)["error"]["type"] == "overloaded_error"
    long = bodies.error_body(answered(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "prompt (9 tokens)"))
    assert long["error"]["message"].startswith("prompt is too long: ")
    for code, kind in [
        (ErrorCode.INVALID_API_KEY, "authentication_error"),
        (ErrorCode.ORIGIN_NOT_ALLOWED, "permission_error"),
        (ErrorCode.BODY_TOO_LARGE, "request_too_large"),
        (ErrorCode.RATE_LIMITED, "rate_limit_error"),
        (ErrorCode.INFERENCE_FAILED, "api_error"),
        (ErrorCode.TIMEOUT, "timeout_error"),
        (ErrorCode.METHOD_NOT_ALLOWED, "invalid_request_error"),
    ]:
        assert bodies.error_body(APIError(code))["error"]["type"] == kind


def test_the_heartbeat_is_a_ping_event() -> None:
    framing = sse_with_heartbeat(Event(bodies.PING, "ping"))
    assert framing.heartbeat == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert framing.content_type == "text/event-stream"
