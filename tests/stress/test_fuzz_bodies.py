"""Generated request bodies for every route (hypothesis, derandomized): whatever the body, the
answer is a 4xx with the JSON error shape and a stable code, or a well-formed success (a
stream with exactly one terminal); never a 5xx; and the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.server import parse_sse, server_thread

ROUTES = ("/v1/generate", "/v1/completions", "/v1/chat/completions", "/v1/inspect/attention")

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)
token_ids = st.lists(st.integers(min_value=-5, max_value=2**40), max_size=8)
part = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url", "input_audio"]) | junk},
    optional={
        "text": st.text(max_size=12) | junk,
        "image_url": st.just({"url": "data:image/png;base64,iVBORw0KGgo="}),
    },
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "developer", "tool", ""]) | junk,
        "content": st.text(max_size=30) | st.lists(part, max_size=3) | junk,
    },
    optional={"name": st.text(max_size=5) | junk},
)
small_int = st.integers(min_value=-3, max_value=80)
number = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 5)
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.sampled_from(["tiny", "gpt-4"]) | junk,
    "prompt": st.text(max_size=40) | token_ids | st.just([]) | junk,
    "messages": st.lists(message, max_size=3) | junk,
    "max_tokens": small_int | junk,
    "max_completion_tokens": small_int,
    "temperature": number | junk,
    "top_p": number,
    "top_k": small_int,
    "repetition_penalty": number,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=10) | junk,
    "seed": st.integers(min_value=-(2**70), max_value=2**70),
    "stream": st.booleans() | junk,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | junk}) | junk,
    "logprobs": st.booleans() | small_int | junk,
    "top_logprobs": small_int,
    "n": small_int,
    "trace": st.fixed_dictionaries({}, optional={"layer": small_int, "top_k": small_int}) | junk,
    "metrics_every": small_int,
    "timeout_s": number,
    "layer": small_int | junk,
    "head": small_int | junk,
    "ignore_eos": st.booleans() | junk,
    "unknown_field": junk,
}
bodies = st.fixed_dictionaries({}, optional=FIELDS)
raw = (
    bodies.map(lambda b: json.dumps(b).encode())  # NaN and Infinity become bare literals
    | junk.map(lambda j: json.dumps(j).encode())
    | st.binary(max_size=64)  # invalid UTF-8, truncated JSON
    | st.text(max_size=20).map(lambda t: b'{"prompt": "\xff\xfe' + t.encode() + b'"}')
)


def check_response(route: str, r: httpx.Response) -> None:
    """A 4xx with the error shape, or a complete success; never a 5xx."""
    assert r.status_code < 500, (route, r.status_code, r.text[:300])
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["code"], str) and error["code"] and error["message"]
        assert "Traceback" not in r.text
        return
    assert r.status_code == 200
    if not r.headers["content-type"].startswith("text/event-stream"):
        r.json()
        return
    events = parse_sse(r.content.decode("utf-8"))
    if route == "/v1/generate":
        names = [e.event for e in events if e.event]
        assert sum(n in ("done", "error") for n in names) == 1 and names[-1] in ("done", "error")
    else:
        data = [e.data for e in events if e.data is not None]
        assert data.count("[DONE]") == 1 and data[-1] == "[DONE]"


def test_generated_bodies_never_get_a_5xx(tiny_app) -> None:
    app = tiny_app(engine={"max_seq_len": 64, "max_batch_size": 4}, heartbeat_s=30)
    with server_thread(app) as url, httpx.Client(base_url=url, timeout=120) as client:

        @settings(
            max_examples=200,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(route=st.sampled_from(ROUTES), body=raw)
        def check(route: str, body: bytes) -> None:
            r = client.post(route, content=body, headers={"Content-Type": "application/json"})
            check_response(route, r)

        check()
        for route in ROUTES:  # 10 MB bodies
            r = client.post(
                route,
                content=b'{"prompt": "' + b"a" * 10_000_000 + b'"}',
                headers={"Content-Type": "application/json"},
            )
            assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        health = client.get("/health")
        ok = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 3})
    assert health.status_code == 200 and health.json()["status"] == "ready"
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
