"""OpenAI request fields over a real server: n, list prompts, echo, penalties, logit_bias, 422s."""

from __future__ import annotations

from collections import Counter, defaultdict

import httpx
import pytest

from support.server import parse_sse, running_server

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Name a colour."}]


def _client(server) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.url, timeout=300)


async def _tokens(client: httpx.AsyncClient, body: dict) -> list[int]:
    """The token ids a /v1/generate stream produced."""
    r = await client.post("/v1/generate", json={"max_tokens": 12, "ignore_eos": True} | body)
    assert r.status_code == 200, r.text
    return [e.json()["token_id"] for e in parse_sse(r.text) if e.event == "token"]


async def test_default_valued_fields_are_accepted(real_app) -> None:
    """What OpenAI clients send by default, and every field with no meaning here."""
    chat = {
        "model": MODEL,
        "messages": CHAT,
        "max_completion_tokens": 4,
        "presence_penalty": 0,
        "frequency_penalty": 0,
        "response_format": {"type": "text"},
        "logit_bias": {},
        "n": 1,
        "seed": 3,
        "stop": ["\n\n"],
        "user": "u",
        "store": False,
        "metadata": {"k": "v"},
        "service_tier": "auto",
        "parallel_tool_calls": True,
        "tool_choice": "none",
        "stream_options": None,
        "logprobs": True,
        "top_logprobs": 2,
        "temperature": None,
        "top_p": None,
        "modalities": ["text"],
        "reasoning_effort": "low",
        "prediction": {"type": "content", "content": "x"},
        "messages_extra": None,
    }
    chat.pop("messages_extra")
    completion = {
        "model": MODEL,
        "prompt": "Hello",
        "max_tokens": 4,
        "best_of": 1,
        "echo": False,
        "suffix": None,
        "logprobs": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "n": 1,
        "user": "u",
        "seed": None,
    }
    async with running_server(real_app()) as server, _client(server) as client:
        r = await client.post("/v1/chat/completions", json=chat)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["content"]
        r = await client.post("/v1/completions", json=completion)
        assert r.status_code == 200, r.text


async def test_fields_that_cannot_be_honoured_are_named(real_app) -> None:
    base = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    chat = {"model": MODEL, "messages": CHAT, "max_tokens": 2}
    image = [
        {"type": "text", "text": "what is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
    ]
    cases = [
        ("/v1/completions", base | {"best_of": 3, "n": 2}, "best_of", "invalid_value"),
        ("/v1/completions", base | {"suffix": "end", "echo": True}, "suffix", "invalid_value"),
        ("/v1/completions", base | {"max_tokens": 0}, "max_tokens", "invalid_value"),
        ("/v1/completions", base | {"prompt_logprobs": 21}, "prompt_logprobs", "invalid_value"),
        ("/v1/completions", base | {"prompt_logprobs": -1}, "prompt_logprobs", "invalid_value"),
        (
            "/v1/chat/completions",
            chat | {"prompt_logprobs": 21},
            "prompt_logprobs",
            "invalid_value",
        ),
        ("/v1/chat/completions", chat | {"max_tokens": 0}, "max_tokens", "invalid_value"),
        ("/v1/completions", base | {"n": 65}, "n", "invalid_value"),
        ("/v1/completions", base | {"prompt": ["a"] * 33, "n": 2}, "prompt", "invalid_value"),
        ("/v1/completions", base | {"logit_bias": {"1": 101}}, "logit_bias", "invalid_value"),
        ("/v1/completions", base | {"logit_bias": {"99999999": 1}}, "logit_bias", "invalid_value"),
        ("/v1/completions", base | {"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
        ("/v1/completions", base | {"not_openai": 1}, "not_openai", "invalid_value"),
        (
            "/v1/chat/completions",
            chat | {"tools": [{"type": "function", "function": {"name": "f", "parameters": 5}}]},
            "parameters",
            "invalid_value",
        ),
        (
            "/v1/chat/completions",
            chat | {"messages": [{"role": "user", "content": image}]},
            "image_url",
            "invalid_value",
        ),
        (
            "/v1/chat/completions",
            chat | {"audio": {"voice": "x", "format": "mp3"}},
            "audio",
            "invalid_value",
        ),
        (
            "/v1/chat/completions",
            chat | {"modalities": ["text", "audio"]},
            "audio",
            "invalid_value",
        ),
        (
            "/v1/chat/completions",
            chat | {"web_search_options": {}},
            "web_search_options",
            "invalid_value",
        ),
    ]
    async with running_server(real_app()) as server, _client(server) as client:
        for path, body, field, code in cases:
            r = await client.post(path, json=body)
            assert r.status_code == 422, (field, r.text)
            error = r.json()["error"]
            assert error["code"] == code and field in error["message"], (field, error)
        # a model without fill-in-the-middle tokens (SmolLM2) cannot take a suffix
        r = await client.post("/v1/completions", json=base | {"suffix": "end"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "fim_not_supported"


async def test_n_and_list_prompts_fan_out_with_reproducible_seeds(real_app_fp32) -> None:
    """One choice per prompt and n, in order; choice seeds derive from the request seed."""
    body = {
        "model": MODEL,
        "prompt": ["Once upon a time", "The sky is"],
        "n": 2,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 11,
        "ignore_eos": True,
    }
    async with running_server(real_app_fp32()) as server, _client(server) as client:
        first = (await client.post("/v1/completions", json=body)).json()
        again = (await client.post("/v1/completions", json=body)).json()
        alone = (
            await client.post("/v1/completions", json=body | {"prompt": "Once upon a time", "n": 1})
        ).json()
        ids = (await client.post("/tokenize", json={"prompt": "Once upon a time"})).json()
        by_ids = (
            await client.post("/v1/completions", json=body | {"prompt": ids["tokens"], "n": 1})
        ).json()
        nested = (
            await client.post(
                "/v1/completions", json=body | {"prompt": [ids["tokens"], ids["tokens"]], "n": 1}
            )
        ).json()
        sky = (await client.post("/tokenize", json={"prompt": "The sky is"})).json()
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2, 3]
    assert texts == [c["text"] for c in again["choices"]]
    assert alone["choices"][0]["text"] == texts[0]  # choice 0 keeps the request's seed
    assert by_ids["choices"][0]["text"] == texts[0]
    assert texts[0] != texts[1]  # each choice samples with its own seed
    # Two prompts, n=1: the second is choice 1, so it gets choice 1's seed.
    assert [c["text"] for c in nested["choices"]] == texts[:2]
    assert first["usage"]["completion_tokens"] == 4 * 6
    # Each prompt counted once, whatever n.
    assert first["usage"]["prompt_tokens"] == ids["count"] + sky["count"]


async def test_streamed_choices_carry_their_index_and_usage_counts_all(real_app_fp32) -> None:
    body = {
        "model": MODEL,
        "messages": CHAT,
        "n": 3,
        "max_tokens": 5,
        "seed": 5,
        "ignore_eos": True,
    }
    async with running_server(real_app_fp32()) as server, _client(server) as client:
        whole = (await client.post("/v1/chat/completions", json=body)).json()
        r = await client.post(
            "/v1/chat/completions",
            json=body | {"stream": True, "stream_options": {"include_usage": True}},
        )
    events = parse_sse(r.text)
    assert events[-1].data == "[DONE]"
    chunks = [e.json() for e in events[:-1]]
    texts: dict[int, str] = defaultdict(str)
    finished = Counter()
    for chunk in chunks[:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        finished[choice["index"]] += choice["finish_reason"] is not None
    assert finished == {0: 1, 1: 1, 2: 1}
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == []
    streamed_usage = chunks[-1]["usage"]
    # The same prompt again: the prefix cache now serves part of it.
    assert streamed_usage.pop("prompt_tokens_details")["cached_tokens"] > 0
    assert whole["usage"].pop("prompt_tokens_details") == {"cached_tokens": 0}
    assert streamed_usage == whole["usage"]
    assert whole["usage"]["completion_tokens"] == 15


async def test_echo_puts_the_prompt_first(real_app) -> None:
    body = {"model": MODEL, "prompt": "The sky is", "max_tokens": 3, "echo": True}
    async with running_server(real_app()) as server, _client(server) as client:
        whole = (await client.post("/v1/completions", json=body)).json()
        r = await client.post("/v1/completions", json=body | {"stream": True})
    assert whole["choices"][0]["text"].startswith("The sky is")
    first = parse_sse(r.text)[0].json()
    assert first["choices"][0]["text"] == "The sky is"


async def test_logit_bias_bans_and_forces_tokens(real_app) -> None:
    async with running_server(real_app()) as server, _client(server) as client:
        greedy = await _tokens(client, {"prompt": "1, 2, 3,", "temperature": 0})
        banned = {str(t): -100 for t in set(greedy)}
        after_ban = await _tokens(
            client, {"prompt": "1, 2, 3,", "temperature": 0, "logit_bias": banned}
        )
        sampled = await _tokens(
            client, {"prompt": "1, 2, 3,", "temperature": 1.0, "seed": 1, "logit_bias": banned}
        )
        forced = await _tokens(
            client, {"prompt": "1, 2, 3,", "temperature": 1.0, "logit_bias": {"1234": 100}}
        )
    assert not set(after_ban) & set(greedy) and not set(sampled) & set(greedy)
    assert forced == [1234] * 12


async def test_presence_and_frequency_penalties_reduce_repetition(real_app) -> None:
    prompt = "Repeat after me: la la la la la la la la"
    async with running_server(real_app()) as server, _client(server) as client:
        plain = await _tokens(client, {"prompt": prompt, "temperature": 0, "max_tokens": 24})
        freq = await _tokens(
            client, {"prompt": prompt, "temperature": 0, "max_tokens": 24, "frequency_penalty": 2.0}
        )
        seeded = {"prompt": prompt, "temperature": 1.0, "seed": 4, "max_tokens": 24}
        sampled = await _tokens(client, seeded)
        presence = await _tokens(client, seeded | {"presence_penalty": 2.0})
        negative = await _tokens(
            client, {"prompt": prompt, "temperature": 0, "max_tokens": 24, "presence_penalty": -2.0}
        )

    def top_count(tokens: list[int]) -> int:
        return Counter(tokens).most_common(1)[0][1]

    assert freq != plain and top_count(freq) < top_count(plain)
    assert presence != sampled  # the exact arithmetic is tests/unit/test_logits.py's
    assert top_count(negative) >= top_count(plain)  # a negative penalty favours repeats


async def test_tokenize_detokenize_and_model_card(real_app, default_model) -> None:
    tok = default_model.tokenizer
    async with running_server(real_app()) as server, _client(server) as client:
        plain = (
            await client.post(
                "/tokenize", json={"prompt": "Hello world", "return_token_strs": True}
            )
        ).json()
        chat = (await client.post("/tokenize", json={"messages": CHAT})).json()
        back = (await client.post("/detokenize", json={"tokens": plain["tokens"]})).json()
        bad = await client.post("/detokenize", json={"tokens": [10**9]})
        empty = await client.post("/tokenize", json={"prompt": ""})
        neither = await client.post("/tokenize", json={})
        models = (await client.get("/v1/models")).json()
    assert plain["tokens"] == tok.encode("Hello world", add_special_tokens=False)
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == 512
    assert plain["token_strs"] == tok.convert_ids_to_tokens(plain["tokens"])
    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False)
    assert back == {"prompt": "Hello world"}
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_value"
    assert empty.status_code == 200 and empty.json()["count"] == 0
    assert neither.status_code == 422
    assert models["data"][0]["max_model_len"] == 512
