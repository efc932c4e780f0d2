"""Several models on one port, through the real server: two generative models (the default
SmolLM2, twice under two names) and all-MiniLM-L6-v2, a spare one loaded on demand, and a
broken one. Routing by name and alias, loading on demand, keep-alive, a pinned model never
evicted by the memory budget, embeddings equal to sentence-transformers' through the
``openai`` client, a failed load answered clearly while the others serve, metrics per model.

One server walks through the story in order (each load costs a second or two).
"""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest
import torch
import torch.nn.functional as F
import trio

from infer.engine.config import EngineConfig
from infer.models import packaged
from infer.server.app import create_app
from infer.server.config import ServerConfig
from infer.server.host.embedding import embed
from support.server import parse_metrics, running_server, wait_for

pytestmark = pytest.mark.slow

MODELS = """
default = "chat"

[models.chat]
source = "default"
aliases = ["gpt-4o-mini"]

[models.complete]
source = "default"
pinned = true

[models.embed]
source = "all-minilm-l6-v2"

[models.spare]
source = "default"
keep_alive = "300ms"

[models.broken]
source = "/nonexistent/broken.gguf"
"""
# chat, complete and spare take 0.38 GB each (weights and a 0.05 GB KV cache), MiniLM 0.07:
# all but one SmolLM2 fit (the test narrows it to the bytes measured once they are loaded).
BUDGET_GB = 1.2
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "hello world",
    "The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと絵文字 🎉",
]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _openai_embeddings(base_url: str) -> dict[str, Any]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0)
    b64 = client.embeddings.create(model="embed", input=TEXTS)  # base64, the client's default
    floats = client.embeddings.create(model="embed", input=TEXTS, encoding_format="float")
    ids = client.embeddings.create(model="embed", input=[[7592, 2088]], dimensions=384)
    return {"base64": b64, "float": floats, "ids": ids}


async def _statuses(client: httpx.AsyncClient) -> dict[str, str]:
    cards = (await client.get("/v1/models")).json()["data"]
    return {c["id"]: c["status"] for c in cards}


async def _complete(client: httpx.AsyncClient, model: str) -> dict:
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_several_models_on_one_port(tmp_path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(MODELS)
    engine = EngineConfig(max_seq_len=512, max_batch_size=4, kv_cache_gb=0.05)
    config = ServerConfig(models_file=str(path), memory_budget_gb=BUDGET_GB, engine=engine)
    app = create_app(config)
    state = app.extensions["infer"]
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        await wait_for(lambda: state.ready)
        await wait_for(lambda: state.models.resolve("complete").loaded)  # pinned: at start
        assert await _statuses(client) == {
            "chat": "loaded",
            "gpt-4o-mini": "loaded",
            "complete": "loaded",
            "embed": "unloaded",
            "spare": "unloaded",
            "broken": "unloaded",
        }

        # Routing by name and alias; the same weights under two names answer alike, also
        # when both step at once (one at a time on the cores).
        named = [await _complete(client, m) for m in ("chat", "gpt-4o-mini")]
        assert [a["model"] for a in named] == ["chat"] * 2
        texts = {a["choices"][0]["text"] for a in named}
        together: dict[str, dict] = {}

        async def into(model: str) -> None:
            together[model] = await _complete(client, model)

        async with trio.open_nursery() as nursery:
            for m in ("chat", "complete"):
                nursery.start_soon(into, m)
        both = [together["chat"], together["complete"]]
        assert {a["choices"][0]["text"] for a in both} == texts and both[1]["model"] == "complete"
        unknown = await client.post("/v1/completions", json={"model": "gpt-5", "prompt": "x"})
        assert unknown.status_code == 422 and "'chat', 'gpt-4o-mini'" in unknown.text

        # MiniLM loads on demand; the openai client's vectors are sentence-transformers'.
        got = await trio.to_thread.run_sync(_openai_embeddings, f"{server.url}/v1")
        assert (await _statuses(client))["embed"] == "loaded"
        from sentence_transformers import SentenceTransformer

        reference = SentenceTransformer(str(packaged.extract("all-minilm-l6-v2")), device="cpu")
        want = reference.encode(TEXTS, convert_to_tensor=True)
        for answer in (got["base64"], got["float"]):
            vectors = torch.tensor([d.embedding for d in answer.data])
            assert [d.index for d in answer.data] == [0, 1, 2, 3] and answer.model == "embed"
            assert F.cosine_similarity(vectors, want).min() >= 0.9999
        assert got["float"].usage.prompt_tokens == got["base64"].usage.total_tokens > 20
        hello = torch.tensor(got["ids"].data[0].embedding)  # "hello world" as token ids
        assert F.cosine_similarity(hello, want[1], dim=0) >= 0.9999

        # Each kind refuses the other's work, clearly (a request that names no model is the
        # default's: chat); inputs past the model's length too.
        as_embedder = await client.post("/v1/embeddings", json={"input": "x"})
        as_generator = await client.post("/v1/completions", json={"model": "embed", "prompt": "x"})
        too_long = await client.post(
            "/v1/embeddings", json={"model": "embed", "input": ["ok", "word " * 300]}
        )
        for r, code in ((as_embedder, "wrong_model_kind"), (as_generator, "wrong_model_kind")):
            assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
        assert "'chat' is a text-generation model: it cannot compute" in as_embedder.text
        assert "cannot generate text" in as_generator.text
        assert too_long.status_code == 400 and "input 1 is 302 tokens long" in too_long.text

        # A model that cannot load fails its requests clearly; the others go on serving.
        broken = [await client.post("/v1/completions", json={"model": "broken", "prompt": "x"})]
        broken.append(await client.post("/v1/completions", json={"model": "broken", "prompt": "x"}))
        for r in broken:
            assert r.status_code == 500 and r.json()["error"]["code"] == "model_load_failed"
            assert "'broken' failed to load: model path does not exist" in r.text
        assert (await _complete(client, "chat"))["model"] == "chat"

        # The spare model does not fit beside the others: the least recently used idle
        # model that is not pinned (MiniLM) makes room; `complete`, older, is pinned. (The
        # budget, narrowed to the sizes measured here: MiniLM's room is just enough.)
        models, embedder = state.models, state.models.resolve("embed")
        spare = models.resolve("spare")
        assert models.used + spare.size > models.budget
        models.budget = models.used + spare.size - embedder.size // 2
        assert (await _complete(client, "spare"))["model"] == "spare"
        statuses = await _statuses(client)
        assert statuses["embed"] == "unloaded" and statuses["complete"] == "loaded"
        assert statuses["chat"] == "loaded"

        # Its keep-alive (300 ms) unloads it once idle, and its memory goes back.
        async with state.models.use("spare"):
            loaded = _rss()
        await wait_for(lambda: spare.status == "unloaded")
        assert _rss() < loaded - 100e6, (loaded, _rss())

        # Ollama's keep_alive 0 unloads a model as soon as its request is answered.
        done = await embed(state, "embed", ["a query"], keep_alive_s=0)
        assert done.model == "embed" and done.embeddings.vectors.shape == (1, 384)
        await wait_for(lambda: state.models.resolve("embed").status == "unloaded")

        text = (await client.get("/metrics")).text
    chat, complete = parse_metrics(text, "chat"), parse_metrics(text, "complete")
    assert chat['infer_requests_total{finish_reason="length"}'] == 4
    assert complete['infer_requests_total{finish_reason="length"}'] == 1
    assert chat['infer_requests_rejected_total{code="model_not_found"}'] == 1  # the default's
    assert chat['infer_requests_rejected_total{code="wrong_model_kind"}'] == 1
    embeddings = parse_metrics(text, "embed")
    assert embeddings['infer_requests_total{finish_reason="stop"}'] == 4
    assert embeddings['infer_requests_rejected_total{code="context_length_exceeded"}'] == 1
    assert (
        parse_metrics(text, "broken")['infer_requests_rejected_total{code="model_load_failed"}']
        == 2
    )
