"""Prompt log-probabilities and prefix-cache usage over a real server.

``echo`` with ``logprobs`` on ``/v1/completions`` (OpenAI's legacy shape, ``max_tokens: 0``
included), vLLM's ``prompt_logprobs`` on completions and chat, streamed and whole; the
scores are checked against a plain forward of the same model over the prompt. And
``usage.prompt_tokens_details.cached_tokens`` on every route that reports usage.
"""

from __future__ import annotations

import math

import httpx
import pytest
import torch

from infer.models.loader import LoadedModel
from support.server import parse_sse, running_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
# About 60 tokens: with a 16-token prefill budget the prompt runs in four chunks, and it
# fills three full KV blocks the prefix cache can serve.
PROMPT = (
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of "
    "Italy is Rome. The capital of Spain is Madrid. The capital of Portugal is Lisbon."
)
BLOCK = 16
TOLERANCE = 1e-3  # float32 model: the paged path and the plain forward differ by ~1e-5


def _client(server) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=300)


def _reference(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    """``[T-1, V]`` float32 log-probabilities of a plain forward (no KV cache): row ``i`` is
    the distribution of token ``i + 1``."""
    model = loaded.model
    with torch.inference_mode():
        out = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))
    return torch.log_softmax(out.logits[0, :-1].float(), dim=-1)


async def _post(client: httpx.AsyncClient, path: str, body: dict) -> dict:
    r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


async def test_echo_logprobs_score_the_prompt(real_app_fp32, default_model_fp32) -> None:
    tokenizer = default_model_fp32.tokenizer
    ids = tokenizer.encode(PROMPT)
    ref = _reference(default_model_fp32, ids)
    body = {"model": MODEL, "prompt": PROMPT, "echo": True, "logprobs": 2, "temperature": 0}
    app = real_app_fp32(engine={"prefill_token_budget": BLOCK})
    async with running_server(app) as server, _client(server) as client:
        # The prompt's blocks are in the prefix cache: scoring must recompute them.
        warm = await _post(client, "/v1/completions", body | {"echo": False, "max_tokens": 1})
        only = await _post(client, "/v1/completions", body | {"max_tokens": 0})
        more = await _post(client, "/v1/completions", body | {"max_tokens": 3})
    assert warm["choices"][0]["logprobs"]["tokens"]  # a plain request's logprobs still work

    choice = only["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert only["usage"]["completion_tokens"] == 0
    assert only["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # none reused
    lp = choice["logprobs"]
    assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = ref.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    got = torch.tensor(lp["token_logprobs"][1:])
    assert torch.allclose(got, expected, atol=TOLERANCE), (got - expected).abs().max()
    best = ref.max(dim=1).values
    for top, value in zip(lp["top_logprobs"][1:], best.tolist(), strict=True):
        assert len(top) == 2 and max(top.values()) == pytest.approx(value, abs=TOLERANCE)
    assert lp["text_offset"][0] == 0
    ends = lp["text_offset"][1:] + [len(PROMPT)]
    for token, start, end in zip(lp["tokens"], lp["text_offset"], ends, strict=True):
        assert PROMPT[start:end] == token

    # With generated tokens: the prompt's entries first, then theirs, offsets running on.
    lp3 = more["choices"][0]["logprobs"]
    assert len(lp3["tokens"]) == len(ids) + 3
    assert lp3["token_logprobs"][: len(ids)] == lp["token_logprobs"]
    assert more["choices"][0]["text"] == PROMPT + "".join(lp3["tokens"][len(ids) :])
    assert lp3["text_offset"][len(ids)] == len(PROMPT)
    assert all(v <= 0 for v in lp3["token_logprobs"][1:])


async def test_vllm_prompt_logprobs(real_app_fp32, default_model_fp32) -> None:
    tokenizer = default_model_fp32.tokenizer
    ids = tokenizer.encode(PROMPT)
    ref = _reference(default_model_fp32, ids)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 2}
    async with running_server(real_app_fp32()) as server, _client(server) as client:
        whole = await _post(
            client,
            "/v1/completions",
            {"model": MODEL, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 3},
        )
        chatted = await _post(client, "/v1/chat/completions", chat | {"prompt_logprobs": 1})
        plain = await _post(client, "/v1/chat/completions", chat)
    scores = whole["choices"][0]["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    assert whole["choices"][0]["logprobs"] is None  # logprobs were not asked for
    for i, entry in enumerate(scores[1:]):
        token, row = ids[i + 1], ref[i]
        actual = entry[str(token)]
        assert actual["decoded_token"] == tokenizer.decode([token])
        assert actual["logprob"] == pytest.approx(float(row[token]), abs=TOLERANCE)
        better = (
            int((row > row[token] + TOLERANCE).sum()),
            int((row > row[token] - TOLERANCE).sum()),
        )
        assert 1 + better[0] <= actual["rank"] <= 1 + better[1]
        assert len(entry) in (3, 4)  # the top 3, and the prompt's token if it is not there
        assert sorted(v["rank"] for v in entry.values())[:3] == [1, 2, 3]
        best = min(entry.values(), key=lambda v: v["rank"])
        assert best["logprob"] == pytest.approx(float(row.max()), abs=TOLERANCE)

    chat_scores = chatted["choices"][0]["prompt_logprobs"]
    assert len(chat_scores) == chatted["usage"]["prompt_tokens"] and chat_scores[0] is None
    assert all(
        math.isfinite(v["logprob"]) and v["logprob"] <= 0
        for entry in chat_scores[1:]
        for v in entry.values()
    )
    assert "prompt_logprobs" not in plain["choices"][0]


async def test_streamed_prompt_logprobs_come_first(real_app_fp32) -> None:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "echo": True,
        "logprobs": 1,
        "prompt_logprobs": 1,
        "max_tokens": 3,
        "temperature": 0,
    }
    async with running_server(real_app_fp32()) as server, _client(server) as client:
        whole = await _post(client, "/v1/completions", body)
        r = await client.post("/v1/completions", json=body | {"stream": True})
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi!"}]}
        chat |= {"max_tokens": 2, "prompt_logprobs": 0, "stream": True, "temperature": 0}
        c = await client.post("/v1/chat/completions", json=chat)
    chunks = [e.json() for e in parse_sse(r.text) if e.data != "[DONE]"]
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT  # the echo waits for its scores and comes with them
    assert first["prompt_logprobs"] == whole["choices"][0]["prompt_logprobs"]
    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    text = ""
    for chunk in chunks:
        choice = chunk["choices"][0]
        text += choice["text"]
        for key, values in streamed.items():
            values += (choice["logprobs"] or {}).get(key, [])
    assert text == whole["choices"][0]["text"]
    for key, values in streamed.items():
        assert values == whole["choices"][0]["logprobs"][key]

    chat_chunks = [e.json() for e in parse_sse(c.text) if e.data != "[DONE]"]
    scored = [ch for ch in chat_chunks if "prompt_logprobs" in ch["choices"][0]]
    assert len(scored) == 1 and scored[0]["choices"][0]["prompt_logprobs"][0] is None
    assert chat_chunks.index(scored[0]) == 1  # right after the role, before any content


async def test_cached_tokens_count_the_prefix_cache(real_app) -> None:
    """The same long prompt twice: none of it cached the first time, whole blocks the
    second; on each route's usage (the second time streamed, in the usage chunk)."""

    def prompt(tag: str) -> str:
        return f"{tag}. {PROMPT} {PROMPT}"  # six full blocks, a distinct first block per case

    streamed = {"stream": True, "stream_options": {"include_usage": True}}
    chat = [{"role": "user", "content": prompt("Chat")}]
    cases = [
        ("/v1/completions", {"model": MODEL, "prompt": prompt("Text"), "max_tokens": 2}),
        ("/v1/chat/completions", {"model": MODEL, "messages": chat, "max_tokens": 2}),
        ("/v1/generate", {"prompt": prompt("Native"), "max_tokens": 2}),
    ]
    async with running_server(real_app()) as server, _client(server) as client:
        for path, body in cases:
            native = path == "/v1/generate"
            first = await client.post(path, json=body)
            second = await client.post(path, json=body if native else body | streamed)
            assert first.status_code == second.status_code == 200, (first.text, second.text)
            if native:
                usages = [parse_sse(r.text)[-1].json()["usage"] for r in (first, second)]
            else:
                events = [e for e in parse_sse(second.text) if e.data != "[DONE]"]
                usages = [first.json()["usage"], events[-1].json()["usage"]]
            assert usages[0]["prompt_tokens_details"] == {"cached_tokens": 0}, path
            cached = usages[1]["prompt_tokens_details"]["cached_tokens"]
            assert 0 < cached < usages[1]["prompt_tokens"] and cached % BLOCK == 0, path
