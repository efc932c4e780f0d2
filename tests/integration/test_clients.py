"""Clients nobody here wrote, against a real server: openai, langchain-openai and litellm.

Each is sync and runs in a worker thread while the server runs on the test's trio loop.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import pytest
import trio
from pydantic import BaseModel

from support.server import running_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
QUESTION = "What is the capital of France?"


class City(BaseModel):
    name: str
    country: str


async def _with_server(real_app, fn: Callable[[str], Any]) -> Any:
    """Run ``fn(base_url)`` in a thread while a server runs."""
    async with running_server(real_app()) as server:
        return await trio.to_thread.run_sync(fn, f"{server.url}/v1")


def _openai_calls(base_url: str) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    defaults = {"presence_penalty": 0, "frequency_penalty": 0, "response_format": {"type": "text"}}
    messages = [{"role": "user", "content": QUESTION}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, n=2, seed=1, **defaults
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        n=2,
        stream_options={"include_usage": True},
        **defaults,
    )
    streamed: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
        usage = chunk.usage or usage
    batch = client.completions.create(
        model=MODEL,
        prompt=["1, 2, 3,", "a, b, c,"],
        max_tokens=4,
        temperature=0,
        frequency_penalty=0,
        logit_bias={"28": -100},
    )
    parsed = client.chat.completions.parse(
        model=MODEL, messages=messages, max_tokens=60, temperature=1.0, seed=2, response_format=City
    )
    return {"chat": chat, "streamed": streamed, "usage": usage, "batch": batch, "parsed": parsed}


async def test_openai_client(real_app) -> None:
    got = await _with_server(real_app, _openai_calls)
    chat = got["chat"]
    assert [c.index for c in chat.choices] == [0, 1]
    assert "Paris" in chat.choices[0].message.content
    assert got["streamed"] == {c.index: c.message.content for c in chat.choices}
    assert got["usage"].completion_tokens == chat.usage.completion_tokens
    assert [c.index for c in got["batch"].choices] == [0, 1]
    assert got["batch"].choices[0].text.strip().startswith("4")
    city = got["parsed"].choices[0].message.parsed
    assert isinstance(city, City)


def _langchain_calls(base_url: str) -> dict[str, Any]:
    from langchain_openai import ChatOpenAI, OpenAI

    common = {
        "base_url": base_url,
        "api_key": "none",
        "model": MODEL,
        "max_retries": 0,
        "temperature": 0,
        "frequency_penalty": 0,
        "presence_penalty": 0,
    }
    chat = ChatOpenAI(max_tokens=8, **common)
    llm = OpenAI(max_tokens=4, **common)  # legacy completions: prompt as a list
    structured = ChatOpenAI(max_tokens=60, **common).with_structured_output(
        City, method="json_schema"
    )
    return {
        "chat": chat.invoke(QUESTION).content,
        "chat_stream": "".join(str(c.content) for c in chat.stream(QUESTION)),
        "llm": llm.invoke("1, 2, 3,"),
        "llm_stream": "".join(llm.stream("1, 2, 3,")),
        "llm_batch": llm.batch(["1, 2, 3,", "a, b, c,"]),
        "structured": structured.invoke(QUESTION),
    }


async def test_langchain_openai(real_app) -> None:
    got = await _with_server(real_app, _langchain_calls)
    assert "Paris" in got["chat"] and got["chat_stream"] == got["chat"]
    assert got["llm"].strip().startswith("4") and got["llm_stream"] == got["llm"]
    assert got["llm_batch"][0] == got["llm"] and len(got["llm_batch"]) == 2
    assert isinstance(got["structured"], City)


def _litellm_calls(base_url: str) -> dict[str, Any]:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
    import litellm

    common = {
        "model": f"openai/{MODEL}",
        "api_base": base_url,
        "api_key": "none",
        "temperature": 0,
        "frequency_penalty": 0,
        "presence_penalty": 0,
    }
    messages = [{"role": "user", "content": QUESTION}]
    whole = litellm.completion(messages=messages, max_tokens=8, **common)
    stream = litellm.completion(messages=messages, max_tokens=8, stream=True, **common)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    text = litellm.text_completion(prompt="1, 2, 3,", max_tokens=4, **common)
    schema = {
        "type": "json_schema",
        "json_schema": {"name": "city", "schema": City.model_json_schema(), "strict": True},
    }
    structured = litellm.completion(
        messages=messages, max_tokens=60, response_format=schema, **common
    )
    return {
        "whole": whole.choices[0].message.content,
        "streamed": streamed,
        "text": text.choices[0].text,
        "structured": structured.choices[0].message.content,
    }


async def test_litellm(real_app) -> None:
    got = await _with_server(real_app, _litellm_calls)
    assert "Paris" in got["whole"] and got["streamed"] == got["whole"]
    assert got["text"].strip().startswith("4")
    City.model_validate(json.loads(got["structured"]))
