"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) end to end, on CPU."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from infer import cli, kernels
from infer.engine.generate import generate
from infer.engine.params import SamplingParams
from infer.engine.prompts import encode_prompt
from infer.models.default import default_gguf_path
from infer.models.linear import QuantGatedLinear, QuantLinear
from infer.models.loader import LoadedModel, load_model

pytestmark = pytest.mark.slow

QUESTION = "What is the capital of France?"
# Our GGUF path does the same float32 arithmetic on the same dequantized weights as
# transformers' (observed difference: 0.0), so only summation-order noise is allowed.
GGUF_TOL = dict(atol=1e-3, rtol=1e-4)
# The cache stores weights as bfloat16 (see infer/models/default.py); run in float32 that
# rounding moves logits (magnitude ~40) by up to ~0.3, an order below the Q4 noise.
CACHE_ATOL = 0.6


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_gguf_path()  # the default model must be installed (make test installs it)


@pytest.fixture(scope="module")
def gguf_model(gguf_path: Path) -> LoadedModel:
    """The GGUF file loaded directly and dequantized, in float32."""
    return load_model(str(gguf_path), dtype=torch.float32, weights="bf16")


@pytest.fixture(scope="module")
def reference(gguf_path: Path, transformers_reference) -> PreTrainedModel:
    """transformers' own load of the same GGUF file, in float32."""
    # transformers' GGUF loading needs accelerate; `make test` installs it (dev extras), so
    # its absence is a broken set-up: fail rather than skip the parity check.
    if importlib.util.find_spec("accelerate") is None:
        pytest.fail("accelerate is not installed (pip install -e '.[dev]')")
    return transformers_reference(gguf_path)


def _chat_ids(loaded: LoadedModel) -> list[int]:
    return encode_prompt(
        loaded.tokenizer,
        loaded.model.config.vocab_size,
        turns=[{"role": "user", "content": QUESTION}],
    )


def _logits(loaded: LoadedModel, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    with torch.inference_mode():
        return loaded.model(x, torch.arange(len(ids)).unsqueeze(0)).logits[0]


def test_metadata(default_model: LoadedModel) -> None:
    assert default_model.name == "SmolLM2-135M-Instruct"
    assert default_model.eos_token_ids == [2]
    assert default_model.tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"
    assert default_model.chat_template
    c = default_model.config
    assert (c.architecture, c.num_hidden_layers, c.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (9, 3, 49152)
    assert c.tie_word_embeddings and c.rope["full"].theta == 100_000.0


def test_gguf_logits_match_transformers(
    gguf_model: LoadedModel, reference: PreTrainedModel
) -> None:
    ids = _chat_ids(gguf_model)
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(_logits(gguf_model, ids), expected, **GGUF_TOL)


def test_cache_holds_the_gguf_weights_in_bfloat16(
    gguf_model: LoadedModel, default_model: LoadedModel
) -> None:
    # default_model: the cache (a bf16 safetensors directory) as loaded, dense in bfloat16
    cached = dict(default_model.model.named_parameters())
    for name, weight in gguf_model.model.named_parameters():
        assert torch.equal(cached[name], weight.bfloat16()), name


def test_cache_in_float32_is_close_to_gguf(
    gguf_model: LoadedModel, default_model_fp32: LoadedModel
) -> None:
    cached = default_model_fp32  # the cache loaded in float32
    ids = _chat_ids(gguf_model)
    ours, exact = _logits(cached, ids), _logits(gguf_model, ids)
    assert (ours - exact).abs().max().item() < CACHE_ATOL
    assert torch.equal(ours.argmax(-1), exact.argmax(-1))


@pytest.mark.skipif(not kernels.has_quant(), reason="no AVX2: weights are dequantized")
def test_its_gguf_file_runs_with_its_q4_1_weights_kept(
    gguf_path: Path, gguf_model: LoadedModel
) -> None:
    """`--model <file>` keeps the Q4_1 weights (``default`` serves the bf16 cache: with 8-bit
    activations this 135M model answers the capital question wrongly, as llama.cpp does)."""
    kept = load_model(str(gguf_path))
    layer = kept.model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, QuantLinear)
    assert isinstance(layer.mlp.gate_up_proj, QuantGatedLinear)
    assert kept.model.decode_stack is not None
    ids = _chat_ids(gguf_model)
    quantized, exact = _logits(kept, ids).float(), _logits(gguf_model, ids)
    agree = (quantized.argmax(-1) == exact.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_greedy_chat_answer(default_model: LoadedModel) -> None:
    params = SamplingParams(max_new_tokens=32, temperature=0.0)
    ids = _chat_ids(default_model)
    tokens = list(generate(default_model.model, ids, params, default_model.eos_token_ids))
    assert "Paris" in default_model.tokenizer.decode(tokens, skip_special_tokens=True)


def test_cli_generate_chat(default_model: LoadedModel, capsys: pytest.CaptureFixture[str]) -> None:
    # default_model first: the cache exists, so the CLI only loads it.
    argv = ["generate", "--chat", "--prompt", QUESTION, "--temperature", "0", "--max-tokens", "32"]
    assert cli.main(argv) == 0
    assert "Paris" in capsys.readouterr().out


def test_cli_reads_prompts_from_stdin(
    default_model: LoadedModel, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("sys.stdin", io.StringIO(f"{QUESTION}\n\nWhat is 2+2?\n"))
    argv = ["generate", "--chat", "--temperature", "0", "--max-tokens", "16"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("\n") >= 2 and "Paris" in out


@pytest.mark.skipif(
    not kernels.has_bf16(), reason="bf16 batch invariance needs the AVX512-BF16 kernels"
)
def test_bf16_engine_output_is_the_same_alone_and_batched(default_model: LoadedModel) -> None:
    """bf16 through the CPU kernels: a request's greedy tokens do not depend on its batch
    (other requests decoding beside it, its prompt prefilled in chunks with theirs)."""
    import random

    from infer.bench.workloads import PromptSource
    from infer.engine.config import EngineConfig
    from infer.engine.engine import Engine

    rng = random.Random(1)
    source = PromptSource(default_model.tokenizer)
    prompts = [list(source.prompt(rng.randint(20, 200), rng)) for _ in range(5)]

    def run(batch: list[list[int]]) -> list[list[int]]:
        engine = Engine(
            EngineConfig(max_batch_size=8, max_seq_len=512, prefill_token_budget=96),
            default_model.model,
            default_model.tokenizer,
            default_model.eos_token_ids,
        )
        params = SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True)
        ids = [engine.add_request(p, params).request_id for p in batch]
        tokens: dict[str, list[int]] = {i: [] for i in ids}
        with torch.inference_mode():
            while engine.has_work():
                for out in engine.step():
                    if out.token_id is not None:
                        tokens[out.request_id].append(out.token_id)
        return [tokens[i] for i in ids]

    together = run(prompts)
    assert [run([p])[0] for p in prompts] == together
    assert all(len(t) == 24 for t in together)
