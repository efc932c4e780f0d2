"""Anthropic's Messages API through a real server and the official ``anthropic`` SDK.

On the real Qwen2.5-Coder-0.5B (greedy, short replies; one server for the module):
``messages.create`` and ``messages.stream`` (the events in order, text and tool input
assembled by the SDK), stop reasons, a ``tool_use`` then its ``tool_result``,
``count_tokens``, the ``beta`` client, keys in ``x-api-key`` or ``Authorization``, refusals
in Anthropic's shape, ``ping`` heartbeats, and a disconnect that frees its work.

On a tiny Qwen3 with a thinking template whose replies are scripted
(:class:`~support.scripted.ScriptedModel`): thinking blocks, the bodies Claude Code sends
(and its billing stamp, which must not defeat the prefix cache), and an ``error`` event for
a stream that fails after it started.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from infer.bench import tool_cases
from infer.bench.sse import SSEParser
from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.models.loader import LoadedModel
from infer.server.app import create_app
from infer.server.config import ServerConfig
from support.apps import build_app
from support.scripted import IM_END, ScriptedModel, thinking_qwen3
from support.server import (
    SSEEvent,
    StepGate,
    iter_sse,
    parse_metrics,
    parse_sse,
    running_server,
    server_thread,
)

pytestmark = pytest.mark.slow

KEY = "sk-ant-local-test"
QWEN = "qwen2.5-coder-0.5b"
TINY = "tiny-qwen3"
GREEDY = {"temperature": 0}  # the SDK (2.x) has no sampling arguments: an extra body field
ASK = [{"role": "user", "content": "What is the capital of France?"}]
_WEATHER = tool_cases.WEATHER["function"]
WEATHER = {
    "name": _WEATHER["name"],
    "description": _WEATHER["description"],
    "input_schema": _WEATHER["parameters"],
}
RAW_TYPES = {
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
}


@dataclass
class Served:
    url: str
    gate: StepGate | None = None
    model: ScriptedModel | None = None
    tokenizer: Any = None

    def client(self, **kwargs: Any) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=self.url, **({"api_key": KEY} | kwargs), max_retries=0, timeout=120
        )

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {KEY}"}  # /metrics takes only this header
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def say(self, text: str) -> None:
        """Script the tiny model's next replies."""
        assert self.model is not None
        self.model.script = self.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def qwen(qwen_model: LoadedModel) -> Iterator[Served]:
    """The real Qwen2.5-Coder-0.5B behind a key, with a gate on its steps and a short
    heartbeat (so streams get ``ping`` events between tokens too)."""
    gate = StepGate()
    dtype = str(qwen_model.model.dtype).removeprefix("torch.")
    app = build_app(
        qwen_model.model,
        qwen_model.tokenizer,
        qwen_model.eos_token_ids,
        qwen_model.name,
        engine={"dtype": dtype, "max_seq_len": 2048},
        gate=gate,
        api_keys=(KEY,),
        heartbeat_s=0.25,
    )
    with gate, server_thread(app) as url:
        yield Served(url, gate)


def _scripted_app(qwen_model: LoadedModel, **server: Any) -> tuple[Any, ScriptedModel, Any]:
    model, tokenizer = thinking_qwen3(qwen_model.tokenizer)
    config = EngineConfig(max_seq_len=2048, max_batch_size=2, dtype="float32")
    engine = Engine(config, model, tokenizer, {IM_END}, TINY)
    return (
        create_app(ServerConfig(engine=config, api_keys=(KEY,), **server), engine),
        model,
        tokenizer,
    )


@pytest.fixture(scope="module")
def scripted(qwen_model: LoadedModel) -> Iterator[Served]:
    """A tiny Qwen3 with a thinking template, saying what a test scripts."""
    app, model, tokenizer = _scripted_app(qwen_model)
    with server_thread(app) as url:
        yield Served(url, model=model, tokenizer=tokenizer)


def _squash(types: list[str]) -> list[str]:
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def _assert_anthropic_error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    assert body["error"]["message"]
    return str(body["error"]["message"])


# --- the real model ---------------------------------------------------------------------------


def test_create_and_stream_through_the_sdk(qwen: Served) -> None:
    client = qwen.client()
    whole = client.messages.create(model=QWEN, max_tokens=24, messages=ASK, extra_body=GREEDY)
    with client.messages.stream(
        model=QWEN, max_tokens=24, messages=ASK, extra_body=GREEDY
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    beta = client.beta.messages.create(  # POST /v1/messages?beta=true, an anthropic-beta header
        model=QWEN,
        max_tokens=24,
        messages=ASK,
        betas=["interleaved-thinking-2025-05-14", "context-management-2025-06-27"],
        extra_body=GREEDY,
    )
    stopped = client.messages.create(
        model=QWEN, max_tokens=24, messages=ASK, stop_sequences=["Paris"], extra_body=GREEDY
    )
    cut = client.messages.create(model=QWEN, max_tokens=2, messages=ASK, extra_body=GREEDY)
    counted = client.messages.count_tokens(model=QWEN, messages=ASK)

    [text] = whole.content
    assert text.type == "text" and "Paris" in text.text
    assert whole.id.startswith("msg_") and whole.model == QWEN and whole.role == "assistant"
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
    used = whole.usage
    assert used.input_tokens + (used.cache_read_input_tokens or 0) == counted.input_tokens
    assert 0 < used.output_tokens <= 24

    raw = [e.type for e in events if e.type in RAW_TYPES]
    assert _squash(raw) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert [e.index for e in events if e.type == "content_block_start"] == [0]
    assert final.content[0].text == text.text and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == used.output_tokens
    # the same prompt again: the prefix cache served it, and usage says so
    assert (final.usage.cache_read_input_tokens or 0) > 0
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted.input_tokens

    assert beta.content[0].text == text.text and beta.stop_reason == "end_turn"
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "Paris"
    assert "Paris" not in stopped.content[0].text
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_a_tool_use_then_its_result(qwen: Served) -> None:
    client = qwen.client()
    ask = [{"role": "user", "content": tool_cases.ASK_WEATHER}]
    with client.messages.stream(
        model=QWEN,
        max_tokens=64,
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body=GREEDY,
    ) as stream:
        events = list(stream)
        called = stream.get_final_message()
    [use] = called.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert "paris" in use.input["city"].lower()
    assert called.stop_reason == "tool_use"
    pieces = [
        e.delta.partial_json
        for e in events
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == use.input
    start = next(e for e in events if e.type == "content_block_start")
    assert start.content_block.type == "tool_use" and start.content_block.input == {}

    history = [
        *ask,
        {"role": "assistant", "content": called.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "22 C, sunny"},
                {"type": "text", "text": "Answer my question in one sentence."},
            ],
        },
    ]
    answer = client.messages.create(
        model=QWEN, max_tokens=48, messages=history, tools=[WEATHER], extra_body=GREEDY
    )
    counted = client.messages.count_tokens(model=QWEN, messages=history, tools=[WEATHER])
    assert answer.stop_reason == "end_turn"
    [text] = answer.content
    assert "22" in text.text  # the model read the result
    total = answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)
    assert total == counted.input_tokens


def test_keys_in_either_header_and_refusals_in_anthropics_shape(qwen: Served) -> None:
    bearer = qwen.client(api_key=None, auth_token=KEY)  # Authorization: Bearer (Claude Code)
    assert bearer.messages.count_tokens(model=QWEN, messages=ASK).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as refused:
        qwen.client(api_key="wrong").messages.create(model=QWEN, max_tokens=4, messages=ASK)
    assert refused.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        qwen.client().messages.create(
            model=QWEN,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}],
        )
    assert "image" in bad.value.message
    with pytest.raises(anthropic.NotFoundError):
        qwen.client().messages.create(model="claude-opus-4-6", max_tokens=4, messages=ASK)

    body = {"model": QWEN, "max_tokens": 4, "messages": ASK}
    with httpx.Client(base_url=qwen.url, timeout=120) as anonymous:
        for path in ("/v1/messages", "/v1/messages/count_tokens"):
            _assert_anthropic_error(anonymous.post(path, json=body), 401, "authentication_error")
    with qwen.http() as http:
        post = http.post
        _assert_anthropic_error(post("/v1/messages", content=b"{no"), 400, "invalid_request_error")
        for broken in (
            {"model": QWEN, "messages": ASK},  # no max_tokens
            body | {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
            body | {"messages": [{"role": "system", "content": "x"}]},
            body | {"tools": [{"type": "bash_20250124", "name": "bash"}]},
            body | {"tool_choice": {"type": "tool", "name": "get_weather"}},
            body | {"max_tokens": -1},
            body | {"temperature": "hot"},
        ):
            _assert_anthropic_error(post("/v1/messages", json=broken), 400, "invalid_request_error")
        _assert_anthropic_error(
            post("/v1/messages/count_tokens", json={"model": QWEN}), 400, "invalid_request_error"
        )
        long = body | {"messages": [{"role": "user", "content": "word " * 2500}]}
        message = _assert_anthropic_error(
            post("/v1/messages", json=long), 400, "invalid_request_error"
        )
        assert message.startswith("prompt is too long")
        huge = body | {"messages": [{"role": "user", "content": "x" * 300_000}]}
        _assert_anthropic_error(post("/v1/messages", json=huge), 413, "request_too_large")
        _assert_anthropic_error(
            post("/v1/messages", json=body | {"model": "claude-haiku-4-5"}), 404, "not_found_error"
        )


def test_pings_keep_a_quiet_stream_alive_and_a_disconnect_frees_its_work(qwen: Served) -> None:
    assert qwen.gate is not None
    body = {
        "model": QWEN,
        "max_tokens": 400,
        "stream": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": "Count from 1 to 300, one number per line."}],
    }
    with qwen.http() as http:
        before = parse_metrics(http.get("/metrics").text)
        events: list[SSEEvent] = []
        qwen.gate.close()  # the engine holds before its first step: the stream is quiet
        try:
            with http.stream("POST", "/v1/messages", json=body) as response:
                assert response.status_code == 200
                chunks, parser = response.iter_bytes(), SSEParser()
                while not any(e.event == "ping" for e in events):
                    events += parser.feed(next(chunks))
                qwen.gate.open()
                while not any(e.event == "content_block_delta" for e in events):
                    events += parser.feed(next(chunks))
        finally:
            qwen.gate.open()
        # the client left mid-stream: the engine ends its request at once
        deadline = time.monotonic() + 60
        while True:
            health = http.get("/health").json()
            if health["running"] == health["waiting"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        after = parse_metrics(http.get("/metrics").text)
    assert events[0].event == "message_start"
    ping = next(e for e in events if e.event == "ping")
    assert ping.json() == {"type": "ping"}
    assert health["running"] == health["waiting"] == 0
    aborted = 'infer_requests_total{finish_reason="abort"}'
    assert after[aborted] == before.get(aborted, 0) + 1


# --- a model that reasons, and Claude Code ----------------------------------------------------


def test_thinking_blocks_from_a_model_that_reasons(scripted: Served) -> None:
    client = scripted.client()
    scripted.say("<think>The user asks for a capital.</think>\n\nParis.")
    thinking = {"type": "enabled", "budget_tokens": 1024}
    whole = client.messages.create(model=TINY, max_tokens=64, messages=ASK, thinking=thinking)
    with client.messages.stream(
        model=TINY, max_tokens=64, messages=ASK, thinking=thinking
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == "The user asks for a capital."
    assert whole.content[0].signature == ""
    assert whole.content[1].text == "Paris." and whole.stop_reason == "end_turn"
    assert [b.to_dict() for b in final.content] == [
        {"type": "thinking", "thinking": "The user asks for a capital.", "signature": ""},
        {"type": "text", "text": "Paris."},
    ]
    starts = [(e.index, e.content_block.type) for e in events if e.type == "content_block_start"]
    assert starts == [(0, "thinking"), (1, "text")]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert deltas == sorted(deltas, key=lambda kind: kind != "thinking_delta")

    # Off (or not asked for): the prompt closes an empty block, and no thinking comes back.
    scripted.say("Paris.")
    off = client.messages.create(
        model=TINY, max_tokens=64, messages=ASK, thinking={"type": "disabled"}
    )
    unasked = client.messages.create(model=TINY, max_tokens=64, messages=ASK)
    adaptive = client.messages.count_tokens(model=TINY, messages=ASK, thinking={"type": "adaptive"})
    for answer in (off, unasked):
        assert [b.type for b in answer.content] == ["text"]
        total = answer.usage.input_tokens + (answer.usage.cache_read_input_tokens or 0)
        assert total > adaptive.input_tokens  # "<think>\n\n</think>\n\n" in the prompt

    # Thinking sent back in the history is accepted and not read again.
    history = [
        *ASK,
        {"role": "assistant", "content": whole.content},
        {"role": "user", "content": "Sure?"},
    ]
    plain = [*ASK, {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "Sure?"}]
    counts = [
        client.messages.count_tokens(model=TINY, messages=m, thinking=thinking).input_tokens
        for m in (history, plain)
    ]
    assert counts[0] == counts[1]


CLAUDE_CODE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219,oauth-2025-04-20,adaptive-thinking-2026-01-28,"
    "context-management-2025-06-27,prompt-caching-scope-2026-01-05,effort-2025-11-24",
    "anthropic-dangerous-direct-browser-access": "true",
    "user-agent": "claude-cli/2.1.69 (external, cli)",
    "x-app": "cli",
    "x-stainless-lang": "js",
    "x-stainless-retry-count": "0",
    "x-stainless-timeout": "600",
    "x-stainless-helper-method": "stream",
    "authorization": f"Bearer {KEY}",
}
CLAUDE_CODE_TOOLS = [
    {
        "name": "Read",
        "description": "Reads a file from the local filesystem. " * 8,
        "input_schema": {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {
                "file_path": {"type": "string", "description": "The absolute path"},
                "offset": {"type": "number"},
                "limit": {"type": "number"},
            },
            "required": ["file_path"],
            "additionalProperties": False,
        },
    },
    {
        "name": "Bash",
        "description": "Executes a given bash command in a persistent shell session. " * 8,
        "input_schema": {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {"command": {"type": "string"}, "timeout": {"type": "number"}},
            "required": ["command"],
            "additionalProperties": False,
        },
        "cache_control": {"type": "ephemeral"},
    },
]
SYSTEM_PROMPT = (
    "You are Claude Code, Anthropic's official CLI for Claude. You are an interactive CLI tool "
    "that helps users with software engineering tasks. Use the instructions below and the "
    "tools available to you to assist the user.\n"
) * 6


def claude_code_body(cch: str) -> dict[str, Any]:
    """The body Claude Code sends (as captured for 2.1.x, shortened): its billing line first."""
    billing = f"x-anthropic-billing-header: cc_version=2.1.69.a1b; cc_entrypoint=cli; cch={cch};"
    return {
        "model": TINY,
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "<system-reminder>\nAs you answer the user's "
                        "questions, you can use the following context.\n</system-reminder>",
                    },
                    {
                        "type": "text",
                        "text": "What does app.py do?",
                        "cache_control": {"type": "ephemeral"},
                    },
                ],
            }
        ],
        "system": [
            {"type": "text", "text": billing},
            {
                "type": "text",
                "text": SYSTEM_PROMPT,
                "cache_control": {"type": "ephemeral", "ttl": "1h"},
            },
        ],
        "tools": CLAUDE_CODE_TOOLS,
        "metadata": {
            "user_id": json.dumps(
                {"device_id": "5f1c", "account_uuid": "", "session_id": "0d9e-41aa"}
            )
        },
        "max_tokens": 32000,
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "stream": True,
    }


def _stream(http: httpx.Client, body: dict[str, Any]) -> list[SSEEvent]:
    with http.stream(
        "POST", "/v1/messages?beta=true", json=body, headers=CLAUDE_CODE_HEADERS
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return parse_sse(response.read())


def test_what_claude_code_sends(scripted: Served) -> None:
    scripted.say(
        "<think>Read it first.</think>\n\n<tool_call>\n"
        '{"name": "Read", "arguments": {"file_path": "/src/app.py"}}\n</tool_call>'
    )
    with httpx.Client(base_url=scripted.url, timeout=120) as http:
        first = _stream(http, claude_code_body("a5145"))
        second = _stream(http, claude_code_body("9e0f2"))  # the next request's stamp
        count_body = {
            k: v
            for k, v in claude_code_body("77aa1").items()
            if k in ("model", "messages", "system", "tools", "thinking")
        }
        counted = http.post(
            "/v1/messages/count_tokens?beta=true", json=count_body, headers=CLAUDE_CODE_HEADERS
        )
    names = [e.event for e in first]
    assert _squash(names) == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    blocks = [e.json()["content_block"] for e in first if e.event == "content_block_start"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"]
    assert blocks[1]["name"] == "Read" and blocks[1]["input"] == {}
    partial = "".join(
        e.json()["delta"].get("partial_json", "") for e in first if e.event == "content_block_delta"
    )
    assert json.loads(partial) == {"file_path": "/src/app.py"}
    end = next(e.json() for e in first if e.event == "message_delta")
    assert end["delta"]["stop_reason"] == "tool_use"
    prompt = first[0].json()["message"]["usage"]["input_tokens"]
    assert counted.status_code == 200 and counted.json() == {"input_tokens": prompt}
    # Only the billing stamp changed: the prefix cache serves all but the last block.
    usage = next(e.json() for e in second if e.event == "message_delta")["usage"]
    assert usage["cache_read_input_tokens"] + usage["input_tokens"] == prompt
    assert usage["input_tokens"] <= 16 < usage["cache_read_input_tokens"]


async def test_a_stream_that_fails_after_it_started_ends_with_an_error_event(
    qwen_model: LoadedModel,
) -> None:
    app, model, tokenizer = _scripted_app(qwen_model)
    model.script = tokenizer.encode("word " * 400, add_special_tokens=False)
    body = {"model": TINY, "max_tokens": 500, "stream": True, "messages": ASK}
    events: list[SSEEvent] = []
    async with running_server(app) as server:
        async with (
            httpx.AsyncClient(base_url=server.url, headers={"x-api-key": KEY}, timeout=60) as http,
            http.stream("POST", "/v1/messages", json=body) as response,
        ):
            async for event in iter_sse(response):
                events.append(event)
                if event.event == "message_start":
                    server.shutdown()  # running requests are ended: the stream fails
    names = [e.event for e in events if e.event != "ping"]
    assert names[0] == "message_start" and names[-1] == "error"
    assert "message_stop" not in names
    assert events[-1].json() == {
        "type": "error",
        "error": {
            "type": "overloaded_error",
            "message": "the request was cancelled (the server is shutting down)",
        },
    }
