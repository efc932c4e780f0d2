"""Generated bodies for Anthropic's routes (hypothesis, derandomized): whatever the body, the
answer is a 4xx in Anthropic's error shape, or a well-formed message or stream
(``message_start`` first, exactly one of ``message_stop`` or ``error`` last); never a 5xx.

Half the bodies are shaped as Anthropic's (each field of its type, its values odd: blocks a
text model cannot take, a tool result that answers nothing, a named tool not offered, a stop
sequence list too long), so that many are served; the others put junk anywhere."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.server import parse_sse, server_thread

ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
ERROR_TYPES = {"invalid_request_error", "not_found_error", "request_too_large"}

scalars = st.none() | st.booleans() | st.integers(-5, 2**40) | st.floats() | st.text(max_size=12)
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
text = st.text(max_size=16)
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries({"type": st.just("thinking"), "thinking": text, "signature": text}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": st.sampled_from(["toolu_1", "toolu_2"]),
            "name": st.sampled_from(["get_weather", "Read"]),
            "input": st.just({"city": "Paris"}) | st.just({}),
        }
    ),
    st.fixed_dictionaries(
        {"type": st.just("tool_result"), "tool_use_id": st.sampled_from(["toolu_1", "toolu_9"])},
        optional={
            "content": text | st.lists(st.just({"type": "text", "text": "22 C"}), max_size=2),
            "is_error": st.booleans(),
        },
    ),
    st.sampled_from(
        [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "x"}},
            {
                "type": "document",
                "source": {"type": "text", "media_type": "text/plain", "data": "x"},
            },
            {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {}},
            {"type": "redacted_thinking", "data": "abc"},
        ]
    ),
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant"]),
        "content": text | st.lists(block, min_size=1, max_size=3),
    }
)
tool = st.fixed_dictionaries(
    {
        "name": st.sampled_from(["get_weather", "Read"]),
        "input_schema": st.sampled_from(
            [
                {
                    "type": "object",
                    "properties": {"city": {"type": "string"}},
                    "required": ["city"],
                },
                {"type": "object"},
                {"type": "object", "properties": {"x": {"type": "nonsense"}}},
            ]
        ),
    },
    optional={
        "description": text,
        "type": st.sampled_from(["custom", "web_search_20250305"]),
        "cache_control": st.just({"type": "ephemeral"}),
    },
)
SHAPED: dict[str, st.SearchStrategy[Any]] = {
    "system": text | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": text})),
    "tools": st.lists(tool, max_size=2),
    "tool_choice": st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none"])},
        optional={
            "name": st.sampled_from(["get_weather", "Write"]),
            "disable_parallel_tool_use": st.booleans(),
        },
    ),
    "thinking": st.sampled_from(
        [
            {"type": "enabled", "budget_tokens": 1024},
            {"type": "disabled"},
            {"type": "adaptive"},
            {"type": "enabled", "budget_tokens": 0},
        ]
    ),
    "stop_sequences": st.lists(st.text(max_size=3), max_size=10),
    "temperature": st.floats(0, 2) | st.sampled_from([-1.0, 1e9]),
    "top_p": st.floats(0, 1),
    "top_k": st.integers(-1, 50),
    "metadata": st.fixed_dictionaries({"user_id": text}),
    "output_config": st.sampled_from(
        [{"effort": "medium"}, {"format": {"type": "json_schema", "schema": {"type": "object"}}}]
    ),
    "context_management": st.just({"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}),
    "cache_control": st.just({"type": "ephemeral"}),
}
shaped = st.fixed_dictionaries(
    {
        "model": st.sampled_from(["tiny", "tiny", "claude-sonnet-4-5"]),
        "max_tokens": st.integers(-1, 8),
        "messages": st.lists(message, min_size=1, max_size=3),
        "stream": st.booleans(),
    },
    optional=SHAPED,
)
anything = st.fixed_dictionaries(
    {}, optional={name: junk for name in ("model", "max_tokens", "messages", *SHAPED, "x")}
)
# What /v1/messages takes and count_tokens does not.
REPLY_ONLY = ("max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream", "metadata")


def check_response(r: httpx.Response) -> None:
    """A 4xx in Anthropic's shape, or a complete message or stream; never a 5xx."""
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code >= 400:
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] in ERROR_TYPES, body
        assert body["error"]["message"] and "Traceback" not in r.text
        return
    assert r.status_code == 200
    if not r.headers["content-type"].startswith("text/event-stream"):
        body = r.json()
        assert body.get("type") == "message" or set(body) == {"input_tokens"}, body
        return
    events = [e for e in parse_sse(r.content.decode("utf-8")) if e.event not in ("", "ping")]
    names = [e.event for e in events]
    assert names[0] == "message_start", names
    assert sum(n in ("message_stop", "error") for n in names) == 1, names
    assert names[-1] in ("message_stop", "error"), names
    starts = [e.json()["index"] for e in events if e.event == "content_block_start"]
    assert starts == list(range(len(starts)))


def test_generated_anthropic_bodies_never_get_a_5xx(tiny_app) -> None:
    app = tiny_app(engine={"max_seq_len": 512, "max_batch_size": 4}, heartbeat_s=30)
    with server_thread(app) as url, httpx.Client(base_url=url, timeout=120) as client:

        @settings(
            max_examples=300,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(route=st.sampled_from(ROUTES), body=shaped | anything | junk)
        def check(route: str, body: Any) -> None:
            if route.endswith("count_tokens") and isinstance(body, dict):
                body = {k: v for k, v in body.items() if k not in REPLY_ONLY}
            raw = json.dumps(body).encode()  # NaN and Infinity become bare literals
            r = client.post(route, content=raw, headers={"Content-Type": "application/json"})
            check_response(r)

        check()
        ok = client.post(
            "/v1/messages",
            json={
                "model": "tiny",
                "max_tokens": 3,
                "messages": [{"role": "user", "content": "Hi"}],
            },
        )
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] == 3
