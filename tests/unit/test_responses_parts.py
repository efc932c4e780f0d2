"""The Responses API's pure parts: the response store's bounds, the event builder's order,
and the request's input items as chat messages."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from infer.api.chat import ReplyParser
from infer.api.messages import ChatMessage
from infer.api.responses.bodies import Head, ResponseBuilder
from infer.api.responses.models import ResponsesRequest
from infer.api.tools import ToolPlan
from infer.server.host.store import ResponseStore


def test_store_keeps_at_most_capacity_and_forgets_after_ttl() -> None:
    now = [0.0]
    store = ResponseStore(2, 10.0, clock=lambda: now[0])
    hi = [ChatMessage(role="user", content="hi")]
    store.put("a", hi)
    store.put("b", hi)
    store.put("c", hi)
    assert store.get("a") is None and store.get("b") == tuple(hi) and len(store) == 2
    now[0] = 10.5
    assert store.get("b") is None and store.get("c") is None and len(store) == 0


def _events(builder: ResponseBuilder, reply: ReplyParser, pieces: list[str]) -> list[str]:
    types = [e["type"] for e in builder.start()]
    for piece in pieces:
        types += [e["type"] for e in builder.feed(reply.feed(piece))]
    types += [e["type"] for e in builder.feed(reply.finish())]
    types += [e["type"] for e in builder.finish(reply, "completed", None)]
    return types


def test_text_events_come_in_order_and_the_item_holds_the_text() -> None:
    builder = ResponseBuilder(Head("resp_1", 0, "m"))
    types = _events(builder, ReplyParser(None, None), ["Hel", "lo"])
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    [item] = builder.response("completed")["output"]
    assert item["content"][0]["text"] == "Hello" and item["status"] == "completed"


def test_a_call_is_its_own_item_with_its_arguments() -> None:
    from infer.api.tools import Tool

    tool = Tool("f", None, {"type": "object", "properties": {"x": {"type": "integer"}}})
    plan = ToolPlan((tool,), "auto", True, "hermes")
    reply = ReplyParser(plan, None)
    builder = ResponseBuilder(Head("resp_2", 0, "m"))
    text = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    types = _events(builder, reply, [text[:20], text[20:]])
    assert "response.output_text.delta" not in types
    assert types[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [call] = builder.response("completed")["output"]
    assert call["type"] == "function_call" and call["name"] == "f"
    assert call["arguments"].replace(" ", "") == '{"x":1}' and call["status"] == "completed"


def test_input_items_become_chat_messages() -> None:
    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": [{"type": "input_text", "text": "2+2?"}]},
                {"type": "message", "role": "assistant", "content": "Let me add."},
                {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "4"},
            ],
        }
    )
    user, assistant, tool = body.messages([])
    assert user.text() == "2+2?"
    assert assistant.text() == "Let me add." and assistant.tool_calls is not None
    assert assistant.tool_calls[0].id == "c1"
    assert tool.role == "tool" and tool.tool_call_id == "c1" and tool.name == "add"


def test_an_output_that_answers_no_call_is_refused() -> None:
    with pytest.raises(ValidationError, match="answers no earlier tool call"):
        ResponsesRequest.model_validate(
            {
                "model": "m",
                "input": [{"type": "function_call_output", "call_id": "x", "output": "4"}],
            }
        )
