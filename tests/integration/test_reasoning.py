"""Reasoning kept apart from the answer, on a tiny random Qwen3 with a thinking template.

The model is random, so its text is scripted (:class:`~support.scripted.ScriptedModel`).
Everything after the logits (the grammar, sampling, detokenizing, reading the reply, the
HTTP formats) is the real path.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.models.loader import LoadedModel
from infer.server.app import create_app
from infer.server.config import ServerConfig
from support.scripted import IM_END, ScriptedModel, thinking_qwen3
from support.server import running_server

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def thinking_app(qwen_model: LoadedModel) -> tuple[Any, ScriptedModel, Any]:
    model, tokenizer = thinking_qwen3(qwen_model.tokenizer)

    def build() -> Any:
        engine_config = EngineConfig(max_seq_len=512, max_batch_size=2, dtype="float32")
        engine = Engine(engine_config, model, tokenizer, {IM_END}, "tiny-qwen3")
        return create_app(ServerConfig(engine=engine_config), engine)

    return build, model, tokenizer


async def _chat(app: Any, body: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The non-streamed body and the streamed deltas of the same request."""
    body = {"model": "tiny-qwen3", "messages": ASK, "temperature": 0} | body
    async with running_server(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            whole = (await client.post("/v1/chat/completions", json=body)).json()
            deltas = []
            async with client.stream(
                "POST", "/v1/chat/completions", json=body | {"stream": True}
            ) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        deltas.append(json.loads(line[6:])["choices"][0])
    return whole, deltas


def _script(fixture: tuple[Any, ScriptedModel, Any], text: str) -> Any:
    """A new app whose model replies ``text``."""
    build, model, tokenizer = fixture
    model.script = tokenizer.encode(text, add_special_tokens=False)
    return build()


def _joined(deltas: list[dict[str, Any]], field: str) -> str:
    return "".join(d["delta"].get(field) or "" for d in deltas)


async def test_reasoning_goes_to_both_fields_streamed_and_not(thinking_app: Any) -> None:
    app = _script(thinking_app, "<think>\nThe user asks for a capital.\n</think>\n\nParis.")
    whole, deltas = await _chat(app, {})
    message = whole["choices"][0]["message"]
    assert (
        message["reasoning_content"] == message["reasoning"] == "\nThe user asks for a capital.\n"
    )
    assert message["content"] == "Paris."
    assert _joined(deltas, "reasoning_content") == _joined(deltas, "reasoning")
    assert _joined(deltas, "reasoning_content") == message["reasoning_content"]
    assert _joined(deltas, "content") == "Paris."


async def test_enable_thinking_false_closes_the_block_in_the_prompt(thinking_app: Any) -> None:
    off, _ = await _chat(
        _script(thinking_app, "Paris."), {"chat_template_kwargs": {"enable_thinking": False}}
    )
    on, _ = await _chat(_script(thinking_app, "Paris."), {})
    assert off["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}
    # the prompt holds the empty block: "<think>\n\n</think>\n\n"
    assert off["usage"]["prompt_tokens"] > on["usage"]["prompt_tokens"]


async def test_reasoning_is_split_off_before_tool_calls_are_read(thinking_app: Any) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    app = _script(thinking_app, f"<think>I could write <tool_call> here.</think>\n\n{call}")
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    whole, deltas = await _chat(app, {"tools": [tool]})
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == "I could write <tool_call> here."
    assert [c["function"] for c in choice["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    ]
    assert deltas[-1]["finish_reason"] == "tool_calls"


async def test_structured_output_applies_to_the_answer_not_the_thinking(
    thinking_app: Any,
) -> None:
    app = _script(thinking_app, '<think>free text { [ here</think>\n\n{"a": 1}')
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    whole, _ = await _chat(app, {"response_format": fmt})
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] == "free text { [ here"
    assert json.loads(message["content"]) == {"a": 1}


async def test_the_responses_api_gives_reasoning_its_own_item(thinking_app: Any) -> None:
    app = _script(thinking_app, "<think>Recall the capital.</think>\n\nParis.")
    body = {"model": "tiny-qwen3", "input": "What is the capital of France?", "temperature": 0}
    async with running_server(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            whole = (await client.post("/v1/responses", json=body)).json()
            events = []
            async with client.stream("POST", "/v1/responses", json=body | {"stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
    kinds = [item["type"] for item in whole["output"]]
    assert kinds == ["reasoning", "message"]
    assert whole["output"][0]["content"][0]["text"] == "Recall the capital."
    assert whole["output"][1]["content"][0]["text"] == "Paris."
    assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    assert events[-1]["type"] == "response.completed"
    assert [i["type"] for i in events[-1]["response"]["output"]] == kinds
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == "Paris."


async def test_ollamas_think_keeps_the_reasoning_apart_and_false_closes_the_block(
    thinking_app: Any,
) -> None:
    """Ollama's ``think``: unset, a model that reasons does, its reasoning in ``thinking``
    (``/api/chat``'s message, ``/api/generate``'s lines); ``false`` closes the block."""
    chat = {"model": "tiny-qwen3", "messages": ASK, "stream": False}
    generate = {"model": "tiny-qwen3", "prompt": "What is the capital of France?"}
    app = _script(thinking_app, "<think>Recall the capital.</think>\n\nParis.")
    async with running_server(app) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            thought = (await client.post("/api/chat", json=chat)).json()
            lines = (await client.post("/api/generate", json=generate)).text.splitlines()
    async with running_server(_script(thinking_app, "Paris.")) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            off = (await client.post("/api/chat", json=chat | {"think": False})).json()
    assert thought["message"] == {
        "role": "assistant",
        "content": "Paris.",
        "thinking": "Recall the capital.",
    }
    pieces = [json.loads(line) for line in lines]
    assert "".join(p.get("thinking", "") for p in pieces) == "Recall the capital."
    assert "".join(p["response"] for p in pieces) == "Paris." and pieces[-1]["done"]
    assert off["message"] == {"role": "assistant", "content": "Paris."}
    assert off["prompt_eval_count"] > thought["prompt_eval_count"]  # the empty block
