"""A normalized model configuration built from a checkpoint's ``config.json``, the names of
the files a model directory holds, the end-of-sequence ids its configs name, and what kind of
model a ``config.json`` describes (one that generates text, or one that embeds it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma3ForCausalLM",
)
# Encoders that embed text (infer/models/bert.py); they neither generate nor have a KV cache.
ENCODER_ARCHITECTURES = ("BertModel",)
ROPE_TYPES = ("default", "linear", "llama3")
# For a config.json that names no architectures.
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

# The files of a Hugging Face model directory that loading reads (and conversion writes).
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"


class ModelKind(StrEnum):
    """What a model does: generate text (a causal LM) or embed it (an encoder)."""

    GENERATE = "generate"
    EMBED = "embed"


def model_kind(config: dict[str, Any]) -> ModelKind:
    """The kind of model a Hugging Face ``config.json`` dict describes."""
    archs = config.get("architectures") or []
    if any(a in ENCODER_ARCHITECTURES for a in archs):
        return ModelKind.EMBED
    if not archs and config.get("model_type") == "bert":
        return ModelKind.EMBED
    return ModelKind.GENERATE


def eos_token_ids(*sources: int | list[int] | None) -> list[int]:
    """All end-of-sequence ids named by any source, deduplicated, in order of first mention."""
    ids: list[int] = []
    for source in sources:
        for i in source if isinstance(source, list | tuple) else [source]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings for one kind of layer."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the model code needs, in one shape for every family.

    ``layer_types[i]`` is ``"full"`` or ``"sliding"``; ``rope`` maps each layer type to its
    rotary settings (Gemma3 uses different bases for its local and global layers).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    attention_bias: bool = False  # q, k, v and o projections (Llama's flag)
    qkv_bias: bool = False  # q, k and v only (Qwen2)
    mlp_bias: bool = False
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()
    rope: dict[str, RopeConfig] = field(default_factory=dict)
    sliding_window: int | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None
    eos_token_id: int | list[int] | None = None

    @property
    def family(self) -> str:
        return self.architecture.removesuffix("ForCausalLM").lower()

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict.

        Raises:
            ValueError: The architecture or a rope type is unsupported, or a field is missing.
        """
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and not archs:
            arch = _MODEL_TYPES.get(d.get("model_type", ""))
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or d.get('model_type')!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            return _from_hf(arch, d)
        except KeyError as e:
            raise ValueError(f"config.json is missing field {e.args[0]!r}") from None


def _from_hf(arch: str, d: dict[str, Any]) -> ModelConfig:
    n_layers = d["num_hidden_layers"]
    heads = d["num_attention_heads"]
    gemma = arch == "Gemma3ForCausalLM"
    layer_types = _layer_types(d, n_layers, gemma)
    sliding = "sliding" in layer_types
    return ModelConfig(
        architecture=arch,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rms_norm_eps=d.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=d.get("tie_word_embeddings", gemma),
        max_position_embeddings=d.get("max_position_embeddings", 8192),
        attention_bias=d.get("attention_bias", False),
        qkv_bias=arch == "Qwen2ForCausalLM",
        mlp_bias=d.get("mlp_bias", False),
        hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "silu",
        layer_types=layer_types,
        rope=_rope_configs(d, gemma),
        sliding_window=d.get("sliding_window") if sliding else None,
        query_pre_attn_scalar=d.get("query_pre_attn_scalar") if gemma else None,
        final_logit_softcapping=d.get("final_logit_softcapping"),
        eos_token_id=d.get("eos_token_id"),
    )


def _layer_types(d: dict[str, Any], n_layers: int, gemma: bool) -> tuple[str, ...]:
    names = d.get("layer_types")
    if gemma and not names:
        pattern = d.get("sliding_window_pattern", 6)
        names = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)
        ]
    if not gemma and not d.get("use_sliding_window", False):
        names = None
    if not names:
        return ("full",) * n_layers
    if len(names) != n_layers:
        raise ValueError(f"layer_types has {len(names)} entries for {n_layers} layers")
    return tuple("sliding" if n == "sliding_attention" else "full" for n in names)


def _rope_configs(d: dict[str, Any], gemma: bool) -> dict[str, RopeConfig]:
    params = d.get("rope_parameters")
    if gemma:
        # transformers >= 5 nests per layer type; older checkpoints use flat keys.
        if params and "full_attention" in params:
            return {
                "full": _rope(params["full_attention"], 1_000_000.0),
                "sliding": _rope(params.get("sliding_attention") or {}, 10_000.0),
            }
        full = dict(d.get("rope_scaling") or {}, rope_theta=d.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": d.get("rope_local_base_freq", 10_000.0)}
        return {"full": _rope(full, 1_000_000.0), "sliding": _rope(local, 10_000.0)}
    if params:
        rope = _rope(params, 10_000.0)
    else:
        flat = dict(d.get("rope_scaling") or {}, rope_theta=d.get("rope_theta", 10_000.0))
        rope = _rope(flat, 10_000.0)
    return {"full": rope, "sliding": rope}


def _rope(p: dict[str, Any], default_theta: float) -> RopeConfig:
    rope_type = p.get("rope_type") or p.get("type") or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")
    return RopeConfig(
        theta=float(p.get("rope_theta", default_theta)),
        rope_type=rope_type,
        factor=float(p.get("factor", 1.0)),
        low_freq_factor=float(p.get("low_freq_factor", 1.0)),
        high_freq_factor=float(p.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(p.get("original_max_position_embeddings", 8192)),
    )
