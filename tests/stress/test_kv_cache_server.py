"""The paged KV cache as a client sees it: prefix reuse and block counts in /metrics."""

from __future__ import annotations

import httpx

from support.server import metrics, running_server

SYSTEM = "You are a careful assistant. Answer in one short sentence, and never guess. " * 4


async def test_shared_prefix_is_reused_and_blocks_come_back(tiny_app) -> None:
    app = tiny_app()
    async with (
        running_server(app) as server,
        httpx.AsyncClient(base_url=server.url, timeout=120) as client,
    ):
        answers = []
        for question in ("What is two plus two?", "Name a colour."):
            body = {"model": "tiny", "prompt": SYSTEM + question, "max_tokens": 8, "temperature": 0}
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 200
            answers.append(r.json()["choices"][0]["text"])
        stats = await metrics(client)
    assert stats["infer_prefix_cache_hits_total"] > 0
    assert stats["infer_prefix_cache_queries_total"] >= stats["infer_prefix_cache_hits_total"]
    assert stats["infer_kv_blocks_total"] > 0 and stats["infer_kv_blocks_used"] == 0
    assert stats["infer_preemptions_total"] == 0
