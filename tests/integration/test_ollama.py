"""Ollama's API through a real server: the official ``ollama`` client and the bodies
Continue's Ollama provider sends (written from its ``core/llm/llms/Ollama.ts``) on the real
Qwen2.5-Coder-0.5B (greedy, short replies), then, on a tiny random model, every refusal in
Ollama's shape, the key on every route, and a client that leaves mid-stream.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import trio

from support.apps import build_app
from support.server import StepGate, parse_metrics, running_server, served, wait_for

pytestmark = pytest.mark.slow

KEY = "sk-ollama-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
QWEN = "qwen2.5-coder-0.5b"
TOTAL = "def total(items):\n    total = 0\n    for x in items:\n"
AFTER = "\n    return total\n"
GREEDY = {"temperature": 0, "num_predict": 24}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
# What Continue's autocomplete sends as stop words for Qwen2.5-Coder, and the stop
# /api/show's parameters give it
QWEN_STOPS = [
    "<|endoftext|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|im_end|>",
]
AppFactory = Callable[..., Any]


def _lines(response: httpx.Response) -> list[dict[str, Any]]:
    """An NDJSON body read as Continue reads it: split on newlines, each line JSON."""
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-ndjson"
    return [json.loads(line) for line in response.text.split("\n") if line.strip()]


def test_the_official_client(qwen_app: AppFactory) -> None:
    from ollama import Client

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }

    def run(url: str) -> dict[str, Any]:
        client = Client(host=url, headers=AUTH)
        fill = {"model": QWEN, "prompt": TOTAL, "suffix": AFTER, "options": GREEDY}
        asked = client.chat(model=QWEN, messages=[ASK], tools=[WEATHER], options=GREEDY)
        answer = {"role": "tool", "content": "18 degrees and sunny", "tool_name": "get_weather"}
        history = [ASK, asked.message, answer]
        return {
            "list": client.list(),
            "show": client.show(QWEN),
            "ps": client.ps(),
            "fill": client.generate(**fill),
            "pieces": list(client.generate(**fill, stream=True)),
            "asked": asked,
            "answered": client.chat(model=QWEN, messages=history, options=GREEDY),
            "streamed": list(
                client.chat(
                    model=QWEN, messages=[ASK], tools=[WEATHER], options=GREEDY, stream=True
                )
            ),
            "json": client.generate(
                model=QWEN, prompt="Name a person and their age.", format=schema, options=GREEDY
            ),
            "version": httpx.get(f"{url}/api/version", headers=AUTH).json(),
            "head": httpx.head(url, headers=AUTH),
        }

    got = trio.run(served, qwen_app(engine={"max_seq_len": 1024}, api_keys=(KEY,)), run)
    [listed] = got["list"].models
    assert listed.model == QWEN and listed.size > 0 and listed.digest.startswith("sha256:")
    assert listed.details.family == "qwen2" and listed.details.quantization_level == "Q4_K_M"
    show = got["show"]
    assert {"completion", "tools", "insert"} <= set(show.capabilities)
    assert ".Suffix" in show.template and show.modelinfo["qwen2.context_length"] == 1024
    assert got["ps"].models[0].context_length == 1024 and got["ps"].models[0].size_vram == 0
    # the fill is the FIM builder's, as /infill and OpenAI's suffix give it
    fill = got["fill"]
    assert fill.response == "        total += x" and fill.done and fill.done_reason == "stop"
    assert fill.eval_count > 0 and fill.prompt_eval_count > 0 and fill.total_duration > 0
    pieces = got["pieces"]
    assert "".join(p.response for p in pieces) == fill.response and len(pieces) > 2
    assert [p.done for p in pieces] == [False] * (len(pieces) - 1) + [True]
    assert pieces[-1].done_reason == "stop" and pieces[-1].eval_count == fill.eval_count
    # a tool call, its arguments an object, then the answer to its result
    [call] = got["asked"].message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    answered = got["answered"].message
    assert "18" in answered.content and not answered.tool_calls
    streamed_calls = [c for line in got["streamed"] for c in line.message.tool_calls or []]
    assert [c.function.arguments for c in streamed_calls] == [{"city": "Paris"}]
    assert got["streamed"][-1].done and got["streamed"][-1].done_reason == "stop"
    person = json.loads(got["json"].response)
    assert isinstance(person["name"], str) and isinstance(person["age"], int)
    assert re.fullmatch(r"\d+\.\d+\.\d+", got["version"]["version"])
    assert got["head"].status_code == 200


def continue_options(num_ctx: int, stop: list[str], num_predict: int = 24) -> dict[str, Any]:
    """``_getModelFileParams``: what Continue sends as ``options`` (undefined values dropped
    by JSON.stringify; ``num_ctx`` from /api/show)."""
    return {
        "temperature": 0,
        "num_predict": num_predict,
        "stop": stop,
        "num_ctx": num_ctx,
    }


def continue_parameters(show: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``ensureModelInfo``: each line of ``parameters`` as Continue reads it."""
    for line in show["parameters"].split("\n"):
        found = re.match(r"^(\S+)\s+((?:\".*\")|\S+)$", line)
        if found:
            yield found[1], found[2]


def test_what_continue_sends(qwen_app: AppFactory) -> None:
    model = "qwen2.5-coder:0.5b"  # Continue's modelMap name for qwen2.5-coder-0.5b
    headers = {"Content-Type": "application/json", **AUTH}

    def run(url: str) -> dict[str, Any]:
        client = httpx.Client(base_url=url, headers=headers, timeout=300)
        show = client.post("/api/show", json={"name": model}).json()
        params = list(continue_parameters(show))
        num_ctx = int(dict(params)["num_ctx"])
        stops = [*QWEN_STOPS, *(json.loads(v) for k, v in params if k == "stop")]

        def generate(prompt: str, **extra: Any) -> httpx.Response:
            options = continue_options(num_ctx, stops)
            body = {"model": model, "prompt": prompt, **extra, "options": options}
            return client.post("/api/generate", json=body | {"keep_alive": 1800, "stream": True})

        def chat(messages: list[Any], **extra: Any) -> httpx.Response:
            options = continue_options(num_ctx, [])
            body = {"model": model, "messages": messages, "options": options, "keep_alive": 1800}
            return client.post("/api/chat", json=body | {"stream": True} | extra)

        files = (
            "<|repo_name|>shop\n<|file_sep|>util.py\ndef add(a, b):\n    return a + b\n"
            "\n<|file_sep|>cart.py<|system_separator_istruction_repository_level|>"
        )
        call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        done = [
            {"role": "system", "content": "You are a helpful assistant."},
            ASK,
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "18 degrees and sunny"},
        ]
        return {
            "show": show,
            "num_ctx": num_ctx,
            "fim": generate(TOTAL, suffix=AFTER),
            "repo": generate(files + TOTAL, suffix=AFTER),
            "raw": generate(f"<|fim_prefix|>{TOTAL}<|fim_suffix|>{AFTER}<|fim_middle|>", raw=True),
            "tools": chat([{"role": "system", "content": "Be brief."}, ASK], tools=[WEATHER]),
            "result": chat(done),
            "missing": client.post("/api/show", json={"name": "llama3:8b"}),
            "unknown": client.post("/api/generate", json={"model": "llama3:8b", "prompt": "x"}),
        }

    got = trio.run(served, qwen_app(engine={"max_seq_len": 1024}, api_keys=(KEY,)), run)
    assert ".Suffix" in got["show"]["template"]  # Continue fills in the middle
    assert got["num_ctx"] == 1024
    for name in ("fim", "repo", "raw"):
        lines = _lines(got[name])
        text = "".join(line.get("response", "") for line in lines)
        assert "error" not in lines[-1] and lines[-1]["done"], name
        assert text.startswith("        total += x") and "<|" not in text, name
    tools = _lines(got["tools"])
    calls = [c for line in tools for c in line["message"].get("tool_calls", [])]
    assert [c["function"]["arguments"] for c in calls] == [{"city": "Paris"}]
    result = _lines(got["result"])
    assert "18" in "".join(line["message"]["content"] for line in result)
    # Continue JSON-parses a 404's body and reads the model's name out of it
    for response in (got["missing"], got["unknown"]):
        assert response.status_code == 404
        message = response.json()["error"].replace('"', "'")
        assert re.search(r"model '(.*)' not found", message)[1] == "llama3:8b"  # type: ignore[index]


ROUTES = [
    ("GET", "/api/version"),
    ("GET", "/api/tags"),
    ("GET", "/api/ps"),
    ("POST", "/api/show"),
    ("POST", "/api/generate"),
    ("POST", "/api/chat"),
    ("POST", "/api/embed"),
    ("POST", "/api/embeddings"),
    ("POST", "/api/pull"),
    ("POST", "/api/push"),
    ("POST", "/api/create"),
    ("POST", "/api/copy"),
    ("DELETE", "/api/delete"),
    ("HEAD", "/"),
]


MANAGE = ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete")


def _tiny(tiny_model: Any, tokenizer: Any, **server: Any) -> Any:
    engine = {"max_seq_len": 256, "dtype": "float32"}
    return build_app(tiny_model, tokenizer, (), "tiny", engine=engine, api_keys=(KEY,), **server)


def test_refusals_in_ollamas_shape_and_the_key_on_every_route(
    tiny_model: Any, default_tokenizer: Any
) -> None:
    generate = {"model": "tiny", "prompt": "hi"}
    refused = [
        ("/api/generate", b"{not json", 400, "malformed JSON"),
        ("/api/generate", {"prompt": "hi"}, 422, "model"),
        ("/api/generate", {"model": "nope", "prompt": "hi"}, 404, "model 'nope' not found"),
        ("/api/chat", {"model": "nope", "messages": []}, 404, "model 'nope' not found"),
        ("/api/embed", {"model": "nope", "input": "x"}, 404, "model 'nope' not found"),
        ("/api/generate", generate | {"think": True}, 400, "does not support thinking"),
        ("/api/generate", generate | {"images": ["aGk="]}, 422, "images are not supported"),
        ("/api/generate", generate | {"suffix": ")"}, 400, "does not fill in the middle"),
        ("/api/generate", generate | {"options": {"num_ctx": 4096}}, 400, "num_ctx"),
        ("/api/generate", generate | {"options": {"top_p": "x"}}, 422, "top_p"),
        ("/api/generate", generate | {"format": {"type": 3}}, 422, "not a JSON schema"),
        ("/api/generate", generate | {"keep_alive": "10"}, 422, "not a duration"),
        ("/api/generate", generate | {"raw": True, "system": "s"}, 422, "raw mode"),
        ("/api/chat", {"model": "tiny", "messages": [{"role": "robot"}]}, 422, "role"),
        (
            "/api/chat",
            {"model": "tiny", "messages": [ASK], "tools": [WEATHER], "format": "json"},
            422,
            "cannot be combined",
        ),  # fmt: skip
        ("/api/embed", {"model": "tiny", "input": ["a"]}, 400, "does not support embeddings"),
        ("/api/embeddings", {"model": "tiny", "prompt": "a"}, 400, "does not support embeddings"),
        ("/api/pull", {"model": "llama3"}, 400, "does not pull"),
        ("/api/show", {}, 422, "model is required"),
    ]

    def run(url: str) -> dict[str, Any]:
        client = httpx.Client(base_url=url, headers=AUTH, timeout=120)
        answers = []
        for path, body, _, _ in refused:
            sent = {"content": body} if isinstance(body, bytes) else {"json": body}
            answers.append(client.post(path, **sent))  # type: ignore[arg-type]
        bare = httpx.Client(base_url=url, timeout=120)
        return {
            "refused": answers,
            "keyless": [bare.request(method, path, json={}) for method, path in ROUTES],
            "load": client.post("/api/generate", json={"model": "tiny:latest"}),
            "unload": client.post("/api/chat", json={"model": "tiny", "keep_alive": 0}),
            "show": client.post("/api/show", json={"model": "tiny"}).json(),
            "openapi": client.get("/openapi.json").json(),
        }

    got = trio.run(served, _tiny(tiny_model, default_tokenizer), run)
    for (path, _, status, message), response in zip(refused, got["refused"], strict=True):
        assert response.status_code == status, (path, response.text)
        assert set(response.json()) == {"error"} and message in response.json()["error"]
    for (method, path), response in zip(ROUTES, got["keyless"], strict=True):
        assert response.status_code == 401, (method, path)
        if path.startswith("/api/"):
            assert set(response.json()) == {"error"}, path
    assert got["load"].json()["done_reason"] == "load" and got["load"].json()["done"]
    assert got["unload"].json()["done_reason"] == "unload"
    assert got["unload"].json()["message"] == {"role": "assistant", "content": ""}
    assert "insert" not in got["show"]["capabilities"] and ".Suffix" not in got["show"]["template"]
    doc = got["openapi"]
    assert "Ollama" in [tag["name"] for tag in doc["tags"]]
    for method, path in ROUTES[:-1]:
        path = "/api/{action}" if path in MANAGE else path
        assert doc["paths"][path][method.lower()]["tags"] == ["Ollama"], path
    generate_doc = doc["paths"]["/api/generate"]["post"]
    assert {"200", "404", "422"} <= set(generate_doc["responses"])


def test_a_client_that_leaves_mid_stream_frees_its_work(
    tiny_model: Any, default_tokenizer: Any
) -> None:
    gate = StepGate()
    app = _tiny(tiny_model, default_tokenizer, gate=gate)
    body = {"model": "tiny", "prompt": "Once upon a time", "raw": True}
    body |= {"options": {"num_predict": 200, "temperature": 0}}

    async def main() -> tuple[dict[str, Any], str]:
        async with (
            running_server(app) as server,
            httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as client,
        ):
            worker = app.extensions["infer"].worker
            with gate:
                gate.close()
                gate.allow(3)  # the prompt and two tokens, then the engine waits
                async with client.stream("POST", "/api/generate", json=body) as response:
                    first = json.loads(await anext(response.aiter_lines()))
                    assert worker.running == 1
            # the connection closed with the request still running; the gate is open again
            await wait_for(lambda: worker.running == 0 and worker.waiting == 0)
            return first, (await client.get("/metrics")).text

    first, metrics = trio.run(main)
    assert first.get("done") is False
    counts = parse_metrics(metrics)  # every series carries its model's label
    assert counts['infer_requests_total{finish_reason="abort"}'] == 1
    assert counts["infer_client_disconnects_total"] == 1
