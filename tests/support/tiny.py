"""Tiny random models of every family, written once: the transformers model, and our model
built from its weights.

The configs are 64 wide with 4 query heads over 2 KV heads and a 96-token vocabulary, with
each family's own traits (Qwen2: a large rope theta; Qwen3: an explicit head_dim and tied
embeddings; Gemma3: a sliding window, its query scale, its (1 + w) norms). Tests pass
keyword arguments for what they need beyond that (more layers, the real vocabulary...).
"""

from __future__ import annotations

from typing import Any

import torch
import transformers
from transformers import PreTrainedModel

from infer.models.base import CausalLM
from infer.models.config import ModelConfig
from infer.models.registry import create_model

FAMILIES = ("llama", "qwen2", "qwen3", "gemma3")
VOCAB = 96

_CLASSES: dict[str, tuple[type[transformers.PreTrainedConfig], type[PreTrainedModel]]] = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
}
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
_TRAITS: dict[str, dict[str, Any]] = {
    "llama": dict(tie_word_embeddings=False),
    "qwen2": dict(rope_theta=1e6, tie_word_embeddings=False),
    "qwen3": dict(head_dim=16, tie_word_embeddings=True),
    "gemma3": dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16),
}


def tiny_config(family: str, **fields: Any) -> transformers.PreTrainedConfig:
    """A tiny transformers config of ``family``; ``fields`` replace or add any field."""
    config_class, _ = _CLASSES[family]
    return config_class(**(_COMMON | _TRAITS[family] | fields))


def tiny_reference(
    family: str, *, seed: int = 0, perturb: bool = True, **fields: Any
) -> PreTrainedModel:
    """A random transformers model of ``family`` (eval mode, eager attention: its plain
    reference, which keeps Gemma's soft cap that SDPA drops).

    ``perturb`` moves norm weights and biases off their initial values (1, 0 for Gemma's,
    and 0), where they would hide mistakes in how we apply them.
    """
    torch.manual_seed(seed)
    _, model_class = _CLASSES[family]
    model = model_class(tiny_config(family, **fields)).eval()
    model.set_attn_implementation("eager")
    if perturb:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith(".bias"):
                    p.add_(torch.randn_like(p) * 0.2)
    return model


def ours_from(reference: PreTrainedModel, dtype: torch.dtype = torch.float32) -> CausalLM:
    """Our model of the same config on ``reference``'s weights (in memory, no files)."""
    config = reference.config.to_dict() | {"architectures": [type(reference).__name__]}
    return create_model(ModelConfig.from_hf(config), reference.state_dict().items(), dtype)
