"""Ollama's and Anthropic's APIs, and ``/infill``, on a server of several models: SmolLM2 (the
default), Qwen2.5-Coder-0.5B (a longer context) and all-MiniLM-L6-v2, through the official
``ollama`` and ``anthropic`` clients.

Each dialect routes by the model a request names, loading it on demand, and describes that
model (its card, its context); Ollama lists every model and the loaded ones, embeds through
``/api/embed`` and ``/api/embeddings`` as ``/v1/embeddings`` does, unloads on
``keep_alive: 0``; each refuses the other kind of model in its own shape. One server walks
through it in order (each load costs a second or a few).
"""

from __future__ import annotations

import time
from typing import Any

import anthropic
import httpx
import pytest
import torch
import torch.nn.functional as F
import trio

from infer.engine.config import EngineConfig
from infer.server.app import create_app
from infer.server.config import ServerConfig
from support.server import running_server, wait_for

pytestmark = pytest.mark.slow

QWEN = "qwen2.5-coder-0.5b"
OLLAMA_QWEN = "qwen2.5-coder:0.5b"  # Ollama's spelling of it
MODELS = f"""
default = "smol"

[models.smol]
source = "default"

[models."{QWEN}"]
source = "qwen2.5-coder-0.5b"
max_seq_len = 1024

[models.all-minilm]
source = "all-minilm-l6-v2"
"""
TOTAL = "def total(items):\n    total = 0\n    for x in items:\n"
AFTER = "\n    return total\n"
GREEDY = {"temperature": 0, "num_predict": 16}
ASK = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["def add(a, b):\n    return a + b\n", "hello world", "日本語のテキスト 🎉"]


def _listed(response: Any) -> list[str]:
    return sorted(m.model for m in response.models)


def _refused(call: Any) -> Any:
    """The error a client call raises (it must raise one)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - each client's own error type
        return e
    raise AssertionError("the call was not refused")


def _walk(url: str) -> dict[str, Any]:
    """What the clients are told, in order: the models, their cards, a fill on Qwen,
    embeddings, Anthropic's messages, the refusals, keep-alive, and an unload."""
    from ollama import Client

    client, http = Client(host=url), httpx.Client(base_url=url, timeout=120)
    got: dict[str, Any] = {"tags": client.list(), "ps at start": client.ps()}
    fill = {"prompt": TOTAL, "suffix": AFTER, "options": GREEDY}
    got["fill"] = client.generate(model=OLLAMA_QWEN, **fill)  # type: ignore[arg-type]
    got["show qwen"] = client.show(OLLAMA_QWEN)
    got["show minilm"] = client.show("all-minilm:latest")
    # /infill routes by `model` and says the context of the model that answered;
    # llama.vim's "model": "" is the default (SmolLM2: it does not fill in the middle)
    code = {"input_prefix": TOTAL, "input_suffix": AFTER, "n_predict": 8}
    got["infill"] = http.post("/infill", json=code | {"model": QWEN})
    got["default infill"] = http.post("/infill", json=code | {"model": ""})
    got["embed"] = client.embed(model="all-minilm", input=TEXTS)
    got["embeddings"] = [client.embeddings(model="all-minilm", prompt=t) for t in TEXTS]
    openai = {"model": "all-minilm", "input": TEXTS, "encoding_format": "float"}
    got["openai"] = http.post("/v1/embeddings", json=openai).json()
    got["anthropic"] = _anthropic(url)
    got["refused"] = {
        "default fill": _refused(lambda: client.generate(model="smol", **fill)),  # type: ignore[arg-type]
        "generate": _refused(lambda: client.generate(model="all-minilm", prompt="x")),
        "chat": _refused(lambda: client.chat(model="all-minilm", messages=ASK)),
        "embed": _refused(lambda: client.embed(model="smol", input="x")),
        "embeddings": _refused(lambda: client.embeddings(model=OLLAMA_QWEN, prompt="x")),
        "unknown": _refused(lambda: client.show("llama3:8b")),
    }
    got["chat"] = client.chat(model="smol", messages=ASK, options=GREEDY, keep_alive="10m")
    got["kept for ever"] = client.embed(model="all-minilm", input=[], keep_alive=-1)
    got["ps"], got["ps at"] = client.ps(), time.time()
    got["unload"] = client.generate(model=OLLAMA_QWEN, keep_alive=0)
    got["ps after"] = client.ps()
    got["tags after"] = client.list()
    return got


def _anthropic(url: str) -> dict[str, Any]:
    client = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0)
    body: dict[str, Any] = {"max_tokens": 8, "messages": ASK, "extra_body": {"temperature": 0}}
    return {
        "qwen": client.messages.create(model=QWEN, **body),
        "count qwen": client.messages.count_tokens(model=QWEN, messages=ASK),  # type: ignore[arg-type]
        "count smol": client.messages.count_tokens(model="smol", messages=ASK),  # type: ignore[arg-type]
        "embedder": _refused(lambda: client.messages.create(model="all-minilm", **body)),
        "count embedder": _refused(
            lambda: client.messages.count_tokens(model="all-minilm", messages=ASK)  # type: ignore[arg-type]
        ),
        "unknown": _refused(lambda: client.messages.create(model="claude-haiku-4-5", **body)),
    }


def _cosines(a: list[list[float]], b: list[list[float]]) -> torch.Tensor:
    return F.cosine_similarity(torch.tensor(a), torch.tensor(b))


async def test_the_dialects_speak_for_every_model(tmp_path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(MODELS)
    engine = EngineConfig(max_seq_len=512, max_batch_size=4, kv_cache_gb=0.05)
    app = create_app(ServerConfig(models_file=str(path), engine=engine))
    state = app.extensions["infer"]
    async with running_server(app) as server:
        await wait_for(lambda: state.ready)
        got = await trio.to_thread.run_sync(_walk, server.url)

    # /api/tags lists every model, loaded or not; /api/ps the loaded ones (the default)
    every = sorted(["smol", QWEN, "all-minilm"])
    assert _listed(got["tags"]) == every == _listed(got["tags after"])
    assert _listed(got["ps at start"]) == ["smol"]
    # each model's own card, its model loaded to know it
    qwen, minilm = got["show qwen"], got["show minilm"]
    assert {"completion", "tools", "insert"} <= set(qwen.capabilities)
    assert ".Suffix" in qwen.template and qwen.modelinfo["qwen2.context_length"] == 1024
    assert minilm.capabilities == ["embedding"] and minilm.details.family == "bert"
    assert minilm.modelinfo["bert.context_length"] == 256  # as sentence-transformers cuts
    assert minilm.modelinfo["general.parameter_count"] == 22_565_376  # all but its pooler
    # a fill routed to Qwen while the default (SmolLM2) has no FIM tokens; Qwen loaded for
    # it, and its load_duration says how long it waited (SmolLM2 was loaded at start)
    fill = got["fill"]
    assert fill.model == OLLAMA_QWEN and fill.response.startswith("        total += x"), fill
    assert fill.load_duration > 100_000_000 > got["chat"].load_duration
    assert fill.load_duration + fill.prompt_eval_duration <= fill.total_duration
    # /api/embed and /api/embeddings give /v1/embeddings' vectors
    want = [d["embedding"] for d in got["openai"]["data"]]
    embed = got["embed"]
    assert embed.model == "all-minilm" and len(embed.embeddings) == 3
    assert _cosines(embed.embeddings, want).min() >= 0.9999
    assert embed.prompt_eval_count == got["openai"]["usage"]["prompt_tokens"]
    assert embed.total_duration > 0
    legacy = [e.embedding for e in got["embeddings"]]
    assert _cosines(legacy, want).min() >= 0.9999
    # the other kind of model, refused in Ollama's shape; an unknown one is a 404
    refused = got["refused"]
    assert refused["default fill"].status_code == 400
    assert "does not fill in the middle" in refused["default fill"].error
    for what in ("generate", "chat", "embed", "embeddings"):
        assert refused[what].status_code == 400, (what, refused[what])
    assert "'all-minilm' does not support generate" in refused["generate"].error
    assert "'all-minilm' does not support chat" in refused["chat"].error
    assert "'smol' does not support embeddings" in refused["embed"].error
    assert f"'{OLLAMA_QWEN}' does not support embeddings" in refused["embeddings"].error
    assert refused["unknown"].status_code == 404
    assert refused["unknown"].error == "model 'llama3:8b' not found"
    # keep_alive: "10m" from now, -1 for ever; 0 with nothing to generate unloads at once
    assert got["chat"].message.content and got["chat"].model == "smol"
    assert got["kept for ever"].embeddings == []  # no input: only loaded
    running = {m.model: m for m in got["ps"].models}
    assert sorted(running) == every and all(m.size_vram == 0 for m in running.values())
    left = running["smol"].expires_at.timestamp() - got["ps at"]
    assert 590 < left <= 600, left
    assert running["all-minilm"].expires_at.year == 9999
    assert running[QWEN].context_length == 1024 and running["smol"].context_length == 512
    assert running[QWEN].size > running["all-minilm"].size > 0
    assert got["unload"].done_reason == "unload"
    assert _listed(got["ps after"]) == ["all-minilm", "smol"]

    # Anthropic's messages and count_tokens go to the model named (the answer names it)
    anth = got["anthropic"]
    assert anth["qwen"].model == QWEN and anth["qwen"].content[0].text
    assert anth["count qwen"].input_tokens != anth["count smol"].input_tokens
    for name in ("embedder", "count embedder"):
        error = anth[name]
        assert isinstance(error, anthropic.BadRequestError), (name, error)
        assert error.body["error"]["type"] == "invalid_request_error", error.body  # type: ignore[index]
        assert "embedding model" in error.message
    assert isinstance(anth["unknown"], anthropic.NotFoundError)
    assert anth["unknown"].body["error"]["type"] == "not_found_error"

    infill, default_infill = got["infill"], got["default infill"]
    assert infill.status_code == 200, infill.text
    assert infill.json()["generation_settings"]["n_ctx"] == 1024
    assert "total" in infill.json()["content"]
    assert default_infill.status_code == 400 and "does not fill" in default_infill.text
