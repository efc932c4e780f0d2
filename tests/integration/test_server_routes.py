"""Every route's happy path and every error status, over a real Hypercorn and the real model."""

from __future__ import annotations

import logging

import httpx
import pytest

from support.server import running_server

pytestmark = pytest.mark.slow

PROMPT = "The quick brown fox"
MODEL = "SmolLM2-135M-Instruct"


def assert_error(r: httpx.Response, status: int, code: str) -> dict:
    """The response is the JSON error shape with this status and code, and no traceback."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "code"}
    assert body["error"]["code"] == code, body
    assert body["error"]["message"] and "Traceback" not in r.text
    return body["error"]


async def test_health_models_and_metrics(real_app) -> None:
    async with (
        running_server(real_app()) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        health = await client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ready"
        models = (await client.get("/v1/models")).json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
        r = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0},
        )
        assert r.status_code == 200
        metrics = await client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = metrics.text
    at = f'model="{MODEL}"'  # every series is labelled with its model
    for name in (
        f"infer_requests_running{{{at}}} 0.0",
        f"infer_requests_waiting{{{at}}} 0.0",
        f'infer_requests_total{{finish_reason="length",{at}}} 1.0',
        f"infer_client_disconnects_total{{{at}}} 0.0",
        f"infer_generated_tokens_total{{{at}}} 4.0",
        f"infer_time_to_first_token_seconds_count{{{at}}} 1.0",
        f'infer_time_to_first_token_seconds_bucket{{le="+Inf",{at}}} 1.0',
        f"infer_inter_token_latency_seconds_count{{{at}}} 3.0",
    ):
        assert name in text.splitlines(), name


async def test_served_model_names_are_aliases_and_gateway_probes_answer(real_app) -> None:
    """``--served-model-name`` (repeatable): each name is listed and accepted, the first is
    the one responses carry; the gateway's probes and vLLM's three gauges answer."""
    async with (
        running_server(real_app(served_model_names=("smol", "default"))) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        models = (await client.get("/v1/models")).json()
        answers = [
            await client.post(
                "/v1/completions", json={"model": name, "prompt": PROMPT, "max_tokens": 2}
            )
            for name in ("smol", "default", MODEL)
        ]
        unknown = await client.post(
            "/v1/completions", json={"model": "gpt-4", "prompt": PROMPT, "max_tokens": 2}
        )
        model_info = (await client.get("/get_model_info")).json()
        server_info = (await client.get("/get_server_info")).json()
        also = (await client.get("/server_info")).json()
        metrics = (await client.get("/metrics")).text.splitlines()
    assert [m["id"] for m in models["data"]] == ["smol", "default"]
    assert all(r.status_code == 200 and r.json()["model"] == "smol" for r in answers)
    assert_error(unknown, 422, "model_not_found")
    assert model_info["served_model_name"] == "smol" and model_info["is_generation"] is True
    assert model_info["max_context_length"] == 512
    assert server_info == also and server_info["served_model_names"] == ["smol", "default"]
    assert server_info["max_running_requests"] == 4
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f'vllm:{name}{{model="smol"}} 0.0' in metrics


async def test_completion_and_chat_bodies(real_app, default_model) -> None:
    tokenizer = default_model.tokenizer
    async with (
        running_server(real_app()) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        r = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": PROMPT,
                "max_tokens": 6,
                "temperature": 0,
                "logprobs": 2,
            },
        )
        by_ids = await client.post(
            "/v1/completions",
            json={
                "model": MODEL,
                "prompt": tokenizer.encode(PROMPT),
                "max_tokens": 6,
                "temperature": 0,
            },
        )
        chat = await client.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "Say hi."}],
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 1,
            },
        )
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"]
    assert body["usage"] == {
        "prompt_tokens": len(tokenizer.encode(PROMPT)),
        "completion_tokens": 6,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert len(choice["logprobs"]["tokens"]) == 6
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
    assert by_ids.json()["choices"][0]["text"] == choice["text"]  # ids prompt == text prompt

    body = chat.json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"]
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] and content[0]["logprob"] <= 0
    assert all(len(entry["top_logprobs"]) == 1 for entry in content)


async def test_inspect_attention(real_app, default_model) -> None:
    config = default_model.model.config
    async with (
        running_server(real_app()) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        r = await client.post(
            "/v1/inspect/attention", json={"prompt": PROMPT, "layer": 3, "head": 2}
        )
        chat = await client.post(
            "/v1/inspect/attention",
            json={"messages": [{"role": "user", "content": "hi"}], "layer": 0, "head": 0},
        )
        bad_layer = await client.post(
            "/v1/inspect/attention",
            json={"prompt": PROMPT, "layer": config.num_hidden_layers, "head": 0},
        )
        bad_head = await client.post(
            "/v1/inspect/attention",
            json={"prompt": PROMPT, "layer": 0, "head": config.num_attention_heads},
        )
    body = r.json()
    t = len(default_model.tokenizer.encode(PROMPT))
    assert (body["layer"], body["head"], len(body["tokens"])) == (3, 2, t)
    assert "".join(body["tokens"]) == PROMPT
    attn = body["attn"]
    assert len(attn) == t and all(len(row) == t for row in attn)
    for i, row in enumerate(attn):
        assert sum(row) == pytest.approx(1.0, abs=1e-3)
        assert all(x == 0 for x in row[i + 1 :])  # causal
    assert chat.status_code == 200 and len(chat.json()["attn"]) == len(chat.json()["tokens"])
    assert "layer" in assert_error(bad_layer, 422, "invalid_value")["message"]
    assert "head" in assert_error(bad_head, 422, "invalid_value")["message"]


async def test_400_and_422(real_app) -> None:
    ok = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    async with (
        running_server(real_app()) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        post = client.post
        assert_error(await post("/v1/completions", content=b"{not json"), 400, "invalid_json")
        assert_error(await post("/v1/completions", json=[1, 2]), 400, "invalid_json")
        assert_error(await post("/v1/completions", json=ok | {"prompt": ""}), 400, "empty_prompt")
        assert_error(await post("/v1/completions", json=ok | {"prompt": []}), 400, "empty_prompt")
        assert_error(
            await post("/v1/chat/completions", json={"model": MODEL, "messages": []}),
            400,
            "empty_prompt",
        )
        assert_error(await post("/v1/generate", json={"prompt": ""}), 400, "empty_prompt")

        error = assert_error(
            await post("/v1/completions", json=ok | {"foo": 1}), 422, "invalid_value"
        )
        assert "foo" in error["message"]
        assert (
            "best_of"
            in assert_error(
                await post("/v1/completions", json=ok | {"best_of": 2}), 422, "invalid_value"
            )["message"]
        )
        assert_error(
            await post("/v1/completions", json=ok | {"model": "gpt-4"}), 422, "model_not_found"
        )
        for field, value in (
            ("temperature", -1),
            ("top_p", 0),
            ("max_tokens", 0),
            ("top_k", -1),
            ("repetition_penalty", 0),
            ("logprobs", 21),
        ):
            error = assert_error(
                await post("/v1/completions", json=ok | {field: value}), 422, "invalid_value"
            )
            assert field in error["message"]
        assert_error(
            await post("/v1/completions", json=ok | {"prompt": [10**9]}), 422, "invalid_value"
        )
        error = assert_error(
            await post("/v1/completions", json=ok | {"max_tokens": 600}),
            400,
            "context_length_exceeded",
        )
        assert "512 tokens (--max-seq-len)" in error["message"]
        assert_error(
            await post("/v1/generate", json={"prompt": PROMPT, "trace": {"layer": 99}}),
            422,
            "invalid_value",
        )
        assert_error(
            await post(
                "/v1/generate",
                json={"prompt": PROMPT, "messages": [{"role": "user", "content": "x"}]},
            ),
            422,
            "invalid_value",
        )
        assert_error(await client.get("/nowhere"), 404, "not_found")
        assert_error(await client.get("/v1/completions"), 405, "method_not_allowed")
        metrics = (await client.get("/metrics")).text
    assert f'infer_requests_rejected_total{{code="empty_prompt",model="{MODEL}"}} 4.0' in metrics


async def test_a_prompt_past_2048_tokens_fits_the_models_own_context(real_app, caplog) -> None:
    """Unset, max_seq_len is the model's context (SmolLM2's 8192), said at start, and the
    prompt text limit follows it (18 KB passes); past it, every generating route answers 400
    naming the limit and the flag."""
    text = "hello " * 3000  # 3001 tokens, 18 KB
    app = real_app(engine={"max_seq_len": None, "max_batch_size": 1})
    with caplog.at_level(logging.INFO, logger="infer.server"):
        async with (
            running_server(app) as server,
            httpx.AsyncClient(base_url=server.url, timeout=120) as client,
        ):
            assert (await client.get("/v1/models")).json()["data"][0]["max_model_len"] == 8192
            body = {"model": MODEL, "prompt": text, "max_tokens": 2, "temperature": 0}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] > 2048
            for route, prompt in (
                ("/v1/completions", {"prompt": text}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
                ("/v1/generate", {"prompt": text}),
            ):
                r = await client.post(route, json=prompt | {"model": MODEL, "max_tokens": 6200})
                message = assert_error(r, 400, "context_length_exceeded")["message"]
                assert "8192 tokens (--max-seq-len; here the model's context)" in message, route
    assert "max sequence length 8192 (the model's context)" in caplog.text


async def test_413_prompt_and_body_size(real_app) -> None:
    app = real_app(max_prompt_bytes=64, max_body_bytes=4096)
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        at_limit = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "é" * 32, "max_tokens": 1}
        )  # 64 bytes: accepted
        assert at_limit.status_code == 200
        assert_error(
            await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "é" * 33, "max_tokens": 1}
            ),
            413,
            "prompt_too_large",
        )
        messages = [{"role": "user", "content": "x" * 40}]  # the template adds more bytes
        assert_error(
            await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}),
            413,
            "prompt_too_large",
        )
        assert_error(
            await client.post("/v1/generate", json={"prompt": "y" * 65}), 413, "prompt_too_large"
        )
        assert_error(
            await client.post("/v1/completions", json={"model": MODEL, "prompt": "z" * 5000}),
            413,
            "body_too_large",
        )


async def test_401_api_keys(real_app) -> None:
    app = real_app(api_keys=("key-one", "key-two"))
    request = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        assert (await client.get("/health")).status_code == 200  # stays open
        missing = await client.post("/v1/completions", json=request)
        assert_error(missing, 401, "invalid_api_key")
        assert missing.headers["www-authenticate"] == "Bearer"
        for auth in ("Bearer key-three", "Bearer key-one2", "Basic key-one", "key-one"):
            r = await client.post("/v1/completions", json=request, headers={"Authorization": auth})
            assert_error(r, 401, "invalid_api_key")
        assert_error(await client.get("/v1/models"), 401, "invalid_api_key")
        for key in ("key-one", "key-two"):
            r = await client.post(
                "/v1/completions", json=request, headers={"Authorization": f"Bearer {key}"}
            )
            assert r.status_code == 200


async def test_429_rate_limit(real_app) -> None:
    app = real_app(rate_limit=1.0, rate_burst=2)  # 2 at once, then one a minute
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        for _ in range(2):  # invalid bodies are cheap and still count
            assert (await client.post("/v1/completions", json={})).status_code == 422
        limited = await client.post("/v1/completions", json={})
        error = assert_error(limited, 429, "rate_limited")
        assert int(limited.headers["retry-after"]) >= 1 and "retry" in error["message"]
        assert (await client.get("/health")).status_code == 200  # GETs are not limited
        assert (await client.get("/v1/models")).status_code == 200


async def test_cors_allowlist(real_app) -> None:
    app = real_app(cors_origins=("https://app.example",), api_keys=("k",))
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        ok = await client.options(
            "/v1/completions", headers=preflight | {"Origin": "https://app.example"}
        )
        denied = await client.options(
            "/v1/completions", headers=preflight | {"Origin": "https://evil.example"}
        )
        get = await client.get("/health", headers={"Origin": "https://app.example"})
        other = await client.get("/health", headers={"Origin": "https://evil.example"})
    assert ok.status_code == 204  # a preflight needs no API key
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "Authorization" in ok.headers["access-control-allow-headers"]
    assert_error(denied, 403, "origin_not_allowed")
    assert "access-control-allow-origin" not in denied.headers
    assert get.headers["access-control-allow-origin"] == "https://app.example"
    assert "Origin" in get.headers["vary"]
    assert "access-control-allow-origin" not in other.headers


async def test_ignore_eos_generates_exactly_max_tokens(real_app) -> None:
    body = {
        "model": MODEL,
        "max_tokens": 40,
        "temperature": 0,
        "messages": [{"role": "user", "content": "What is 2+2?"}],
    }
    async with (
        running_server(real_app()) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        natural = (await client.post("/v1/chat/completions", json=body)).json()
        assert natural["choices"][0]["finish_reason"] == "stop"  # the short answer ends at EOS
        assert natural["usage"]["completion_tokens"] < 40
        forced = (
            await client.post("/v1/chat/completions", json=body | {"ignore_eos": True})
        ).json()
        assert forced["choices"][0]["finish_reason"] == "length"
        assert forced["usage"]["completion_tokens"] == 40
