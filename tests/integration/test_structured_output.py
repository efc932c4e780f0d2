"""Structured output over a real server: every completion parses and validates, at temperature 1.

Each request carries a seed and runs alone in the batch, so its tokens are reproducible.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from support.server import parse_sse, running_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
NAME = {"type": "string", "maxLength": 12}
INT = {"type": "integer", "minimum": -50, "maximum": 999}  # bounded: at temperature 1 an
# unbounded integer may run past max_tokens
SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": NAME, "age": INT},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "sizes": {"type": "array", "items": INT, "maxItems": 3},
            "note": NAME,
        },
        "required": ["colour", "sizes"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "owner": {
                "type": "object",
                "properties": {"name": NAME, "id": INT},
                "required": ["id"],
                "additionalProperties": False,
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 2},
            "ok": {"type": "boolean"},
        },
        "required": ["owner", "tags", "ok"],
        "additionalProperties": False,
    },
]
PROMPT = "Describe a person as JSON."


def _format(schema: dict) -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": schema, "strict": True},
    }


def _check(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def _stream_text(body: str, chat: bool) -> tuple[str, str | None]:
    text, reason = "", None
    for event in parse_sse(body):
        if event.data == "[DONE]":
            break
        for choice in event.json()["choices"]:
            text += choice["delta"].get("content", "") if chat else choice["text"]
            reason = choice["finish_reason"] or reason
    return text, reason


async def test_every_completion_validates_streamed_or_not(real_app) -> None:
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 120,
        "temperature": 1.0,
    }
    completion = {"model": MODEL, "prompt": PROMPT, "max_tokens": 120, "temperature": 1.0}
    async with (
        running_server(real_app()) as server,
        httpx.AsyncClient(base_url=server.url, timeout=600) as client,
    ):
        for i, schema in enumerate(SCHEMAS):
            fmt = {"response_format": _format(schema), "seed": i, "n": 2}
            r = await client.post("/v1/chat/completions", json=chat | fmt)
            for choice in r.json()["choices"]:
                assert choice["finish_reason"] == "stop", choice
                _check(choice["message"]["content"], schema)
            r = await client.post("/v1/completions", json=completion | fmt | {"n": 1})
            (choice,) = r.json()["choices"]
            assert choice["finish_reason"] == "stop", choice
            _check(choice["text"], schema)
            for path, body, is_chat in (
                ("/v1/chat/completions", chat, True),
                ("/v1/completions", completion, False),
            ):
                r = await client.post(path, json=body | fmt | {"n": 1, "stream": True})
                text, reason = _stream_text(r.text, is_chat)
                assert reason == "stop", r.text
                _check(text, schema)


async def test_json_object_and_native_route(real_app) -> None:
    body = {"prompt": PROMPT, "max_tokens": 120, "temperature": 1.0, "seed": 7}
    async with (
        running_server(real_app()) as server,
        httpx.AsyncClient(base_url=server.url, timeout=600) as client,
    ):
        r = await client.post("/v1/generate", json=body | {"response_format": _format(SCHEMAS[2])})
        events = parse_sse(r.text)
        text = "".join(e.json()["token"] for e in events if e.event == "token")
        assert events[-1].event == "done" and events[-1].json()["finish_reason"] == "eos"
        _check(text, SCHEMAS[2])
        r = await client.post(
            "/v1/completions",
            json=body | {"model": MODEL, "response_format": {"type": "json_object"}},
        )
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        assert isinstance(json.loads(choice["text"]), dict)


async def test_max_tokens_before_the_json_closes_ends_with_length(real_app) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 3,
        "temperature": 1.0,
        "seed": 1,
        "response_format": _format(SCHEMAS[2]),
    }
    async with (
        running_server(real_app()) as server,
        httpx.AsyncClient(base_url=server.url, timeout=600) as client,
    ):
        choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
        bad = await client.post(
            "/v1/completions",
            json=body
            | {
                "response_format": _format(
                    {"type": "object", "properties": {"x": {"$ref": "#/definitions/missing"}}}
                )
            },
        )
        eos = await client.post("/v1/completions", json=body | {"ignore_eos": True})
    assert choice["finish_reason"] == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice["text"])
    assert choice["text"].startswith("{")
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_schema"
    assert eos.status_code == 422 and "ignore_eos" in eos.json()["error"]["message"]
