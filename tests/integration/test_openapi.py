"""``/openapi.json`` and ``/docs``, and a bounded schemathesis run against a real server.

The server runs a tiny random model (fast whatever schemathesis asks for); schemathesis runs
as its own process against the server on loopback, with a fixed seed and deterministic
generation, checking that no response is a 5xx and every response matches its schema.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import trio

from support.apps import build_app
from support.server import running_server

ST = Path(sys.executable).parent / "st"


def _tiny_app(tiny_model, default_tokenizer, **server):
    eos = [default_tokenizer.eos_token_id]
    engine = {"max_seq_len": 128, "dtype": "float32"}
    return build_app(tiny_model, default_tokenizer, eos, "tiny", engine=engine, **server)


async def test_openapi_document_and_docs_page(tiny_model, default_tokenizer) -> None:
    async with (
        running_server(_tiny_app(tiny_model, default_tokenizer)) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as client,
    ):
        doc = (await client.get("/openapi.json")).json()
        docs = await client.get("/docs")
    assert doc["openapi"].startswith("3.") and doc["info"]["title"] == "infer"
    completions = doc["paths"]["/v1/completions"]["post"]
    body = completions["requestBody"]["content"]["application/json"]["schema"]
    schema = doc["components"]["schemas"].get(body.get("$ref", "").split("/")[-1], body)
    assert {"prompt", "n", "logit_bias", "response_format", "echo", "prompt_logprobs"} <= set(
        schema["properties"]
    )
    components = doc["components"]["schemas"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]
    chat_schema = chat["application/json"]["schema"]
    chat_schema = components.get(chat_schema.get("$ref", "").split("/")[-1], chat_schema)
    assert "prompt_logprobs" in chat_schema["properties"]
    assert "prompt_logprobs" in components["CompletionChoice"]["properties"]
    assert "prompt_logprobs" in components["ChatChoice"]["properties"]
    assert "prompt_tokens_details" in components["Usage"]["properties"]
    assert "cached_tokens" in components["PromptTokensDetails"]["properties"]
    assert {"200", "422"} <= set(completions["responses"])
    assert {"/tokenize", "/detokenize", "/v1/chat/completions", "/v1/generate"} <= set(doc["paths"])
    responses = doc["paths"]["/v1/responses"]["post"]
    body = responses["requestBody"]["content"]["application/json"]["schema"]
    schema = components.get(body.get("$ref", "").split("/")[-1], body)
    assert {"input", "instructions", "tools", "previous_response_id", "text"} <= set(
        schema["properties"]
    )
    assert {"200", "404", "422"} <= set(responses["responses"])
    answer = responses["responses"]["200"]["content"]["application/json"]["schema"]
    answer = components.get(answer.get("$ref", "").split("/")[-1], answer)
    assert {"output", "usage", "status", "previous_response_id"} <= set(answer["properties"])
    for path in ("/v1/messages", "/v1/messages/count_tokens"):  # Anthropic's, under its tag
        view = doc["paths"][path]["post"]
        assert view["tags"] == ["Anthropic"] and {"200", "400", "401", "404"} <= set(
            view["responses"]
        )
        error = view["responses"]["401"]["content"]["application/json"]["schema"]
        assert error.get("title", error.get("$ref", "")).endswith("AnthropicError")
    assert "Anthropic" in [t["name"] for t in doc["tags"]]
    assert docs.status_code == 200 and "swagger-ui" in docs.text


async def test_schemathesis_finds_no_server_error(
    tiny_model, default_tokenizer, tmp_path: Path
) -> None:
    async with running_server(_tiny_app(tiny_model, default_tokenizer)) as server:
        result = await trio.run_process(
            [
                str(ST),
                "run",
                f"{server.url}/openapi.json",
                "--checks",
                "not_a_server_error,response_schema_conformance",
                "--phases",
                "examples,fuzzing",
                "--max-examples",
                "10",
                "--generation-deterministic",
                "--request-timeout",
                "300",
                "--no-color",
            ],
            capture_stdout=True,
            stderr=subprocess.STDOUT,
            check=False,
            cwd=tmp_path,
        )  # schemathesis writes its cache into the working directory
    output = result.stdout.decode(errors="replace")
    assert result.returncode == 0, output[-6000:]
    assert "passed" in output.lower()


async def test_the_pages_are_served_from_the_package_and_open_without_a_key(
    tiny_model, default_tokenizer
) -> None:
    app = _tiny_app(tiny_model, default_tokenizer, api_keys=("k",))
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=60) as client,
    ):
        pages = {path: await client.get(path) for path in ("/", "/playground", "/docs")}
        assets = [
            await client.get(path)
            for path in (
                "/playground/app.js",
                "/playground/api.js",
                "/playground/schema.js",
                "/playground/style.css",
                "/docs/swagger-ui-bundle.js",
                "/docs/swagger-ui.css",
                "/docs/LICENSE",
            )
        ]
        missing = [
            await client.get(path)
            for path in ("/playground/nothere.js", "/playground/index.html", "/docs/index.html")
        ]
        doc = (await client.get("/openapi.json")).json()
        closed = await client.get("/v1/models")
        posted = await client.post("/playground", json={})
    for response in pages.values():
        assert response.status_code == 200 and response.headers["content-type"].startswith(
            "text/html"
        )
        # Nothing the page loads comes from elsewhere.
        assert "https://" not in response.text and "http://" not in response.text
    assert '<script type="module" src="/playground/app.js">' in pages["/"].text
    assert pages["/playground"].text == pages["/"].text
    assert all(r.status_code == 200 and r.content for r in assets)
    assert "javascript" in assets[0].headers["content-type"]
    assert all(r.status_code == 404 for r in missing)
    assert missing[0].json()["error"]["code"] == "not_found"
    assert not {"/", "/playground", "/docs"} & set(doc["paths"])  # pages are not the API
    assert closed.status_code == 401 and posted.status_code == 401
