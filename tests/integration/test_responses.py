"""``POST /v1/responses`` through the ``openai`` SDK's ``client.responses.create`` against a
real server: plain text on the default SmolLM2 (whole and streamed), the token limit,
continuing a stored response, and function calls on Qwen2.5-Coder-0.5B with their results
sent back."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema
import pytest

from infer.bench import tool_cases
from infer.bench.tool_cases import ASK_WEATHER, responses_shape
from support.server import served

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QWEN = "qwen2.5-coder-0.5b"
WEATHER = responses_shape(tool_cases.WEATHER)
TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]

AppFactory = Callable[..., Any]


def _client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def _squash(types: list[str]) -> list[str]:
    """Event types with runs of one type written once."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


async def test_text_whole_and_streamed_agree(real_app: AppFactory) -> None:
    args: dict[str, Any] = dict(
        model=MODEL,
        input="Name a colour.",
        instructions="You are a helpful assistant. Answer in one short sentence.",
        max_output_tokens=16,
        temperature=0,
    )

    def run(url: str) -> tuple[Any, list[Any]]:
        client = _client(url)
        whole = client.responses.create(**args)
        events = list(client.responses.create(**args, stream=True))
        return whole, events

    whole, events = await served(real_app(), run)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete")
    assert whole.output_text.strip()
    [message] = whole.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert whole.instructions == args["instructions"] and whole.temperature == 0
    usage = whole.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 16
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens

    types = [e.type for e in events]
    assert _squash(types)[:-1] == TEXT_EVENTS[:-1]
    assert types[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage.output_tokens > 0
    assert {e.item_id for e in events if e.type == "response.output_text.delta"} == {
        final.output[0].id
    }


async def test_a_small_token_limit_ends_incomplete(real_app: AppFactory) -> None:
    def run(url: str) -> tuple[Any, list[Any]]:
        client = _client(url)
        args = dict(model=MODEL, input="Tell me a long story about a dragon.", max_output_tokens=3)
        return client.responses.create(**args), list(client.responses.create(**args, stream=True))

    whole, events = await served(real_app(), run)
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 3 and whole.output[0].status == "incomplete"
    assert events[-1].type == "response.incomplete"
    assert [e.type for e in events].count("response.incomplete") == 1
    assert "response.completed" not in [e.type for e in events]


async def test_previous_response_id_continues_the_conversation(real_app: AppFactory) -> None:
    def run(url: str) -> tuple[Any, Any, Any, httpx.Response]:
        client = _client(url)
        first = client.responses.create(
            model=MODEL, input="My name is Ada. Remember it.", max_output_tokens=12, temperature=0
        )
        second = client.responses.create(
            model=MODEL,
            input="What is my name?",
            previous_response_id=first.id,
            max_output_tokens=12,
            temperature=0,
        )
        alone = client.responses.create(
            model=MODEL, input="What is my name?", max_output_tokens=12, temperature=0
        )
        unknown = httpx.post(
            f"{url}/v1/responses",
            json={"model": MODEL, "input": "Hi", "previous_response_id": "resp_nope"},
            timeout=60,
        )
        return first, second, alone, unknown

    first, second, alone, unknown = await served(real_app(), run)
    assert second.previous_response_id == first.id
    # The history (the first question and its answer) went in before the new question.
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "response_not_found"


async def test_unstored_responses_cannot_be_continued(real_app: AppFactory) -> None:
    def run(url: str) -> httpx.Response:
        client = _client(url)
        first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
        return httpx.post(
            f"{url}/v1/responses",
            json={"model": MODEL, "input": "Again", "previous_response_id": first.id},
            timeout=60,
        )

    answer = await served(real_app(), run)
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "response_not_found"


async def test_bad_requests_are_refused(real_app: AppFactory) -> None:
    bodies = [
        {"model": MODEL, "input": "Hi", "tools": [{"type": "web_search"}]},
        {
            "model": MODEL,
            "input": [{"type": "function_call_output", "call_id": "call_x", "output": "4"}],
        },
        {"model": MODEL, "input": "Hi", "tool_choice": "required"},
        {"model": MODEL, "input": "Hi", "n": 2},
        {"model": MODEL, "input": "Hi", "text": {"format": {"type": "json_schema"}}},
    ]

    def run(url: str) -> list[httpx.Response]:
        return [httpx.post(f"{url}/v1/responses", json=b, timeout=60) for b in bodies]

    answers = await served(real_app(), run)
    for body, answer in zip(bodies, answers, strict=True):
        assert 400 <= answer.status_code < 500, (body, answer.text)
        assert answer.json()["error"]["code"] == "invalid_value", answer.text


async def test_structured_output_through_text_format(real_app: AppFactory) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 12}},
        "required": ["colour"],
        "additionalProperties": False,
    }

    def run(url: str) -> Any:
        return _client(url).responses.create(
            model=MODEL,
            input="Name a colour as JSON.",
            max_output_tokens=40,
            temperature=0,
            text={"format": {"type": "json_schema", "name": "colour", "schema": schema}},
        )

    whole = await served(real_app(), run)
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), schema)


async def test_function_call_then_its_result(qwen_app: AppFactory) -> None:
    app = qwen_app(engine={"max_seq_len": 1024})

    def run(url: str) -> dict[str, Any]:
        client = _client(url)
        args: dict[str, Any] = dict(
            model=QWEN,
            input=ASK_WEATHER,
            tools=[WEATHER],
            tool_choice="required",
            temperature=0,
            max_output_tokens=64,
        )
        whole = client.responses.create(**args)
        events = list(client.responses.create(**args, stream=True))
        [call] = [item for item in whole.output if item.type == "function_call"]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}
        chained = client.responses.create(
            model=QWEN,
            input=[result],
            previous_response_id=whole.id,
            tools=[WEATHER],
            temperature=0,
            max_output_tokens=48,
        )
        inline = client.responses.create(
            model=QWEN,
            input=[
                {"role": "user", "content": ASK_WEATHER},
                call.model_dump(exclude_none=True),
                result,
            ],
            tools=[WEATHER],
            temperature=0,
            max_output_tokens=48,
        )
        return dict(whole=whole, events=events, call=call, chained=chained, inline=inline)

    got = await served(app, run)
    call = got["call"]
    assert call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    assert "paris" in arguments["city"].lower()

    events = got["events"]
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed" and types.count("response.completed") == 1
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done.arguments == call.arguments
    final = events[-1].response
    assert [i.type for i in final.output] == ["function_call"]

    for answer in (got["chained"], got["inline"]):
        assert answer.status in ("completed", "incomplete")
        assert answer.output_text.strip()
    # The chained request saw the first exchange: more input than the question alone.
    assert got["chained"].usage.input_tokens > got["whole"].usage.input_tokens
