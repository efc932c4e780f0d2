"""GGUF files (llama.cpp's format) read as Hugging Face checkpoints.

Tensors are read one at a time from a memory map (:mod:`infer.models.gguf_file`), kept
quantized (:mod:`infer.models.quant`) or dequantized (through the same decoding, or with the
``gguf`` package for the types that module does not hold), and renamed to Hugging Face
names; llama.cpp's permutation of Llama q/k rows (for its rope layout) is undone; the config
comes from the file's metadata and the tokenizer from transformers' GGUF support (cached
after the first load).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.quants import dequantize
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from infer.models import quant
from infer.models.config import eos_token_ids
from infer.models.derived_files import cache_dir, file_key
from infer.models.errors import LoadError
from infer.models.gguf_file import GGUFFile, GGUFTensor
from infer.models.quant import QuantTensor
from infer.models.tokenizer import load_tokenizer

# GGUF architecture -> Hugging Face architecture.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# ``<arch>.<key>`` metadata -> config.json field.
_GGUF_CONFIG_KEYS = {
    "block_count": "num_hidden_layers",
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
}
_GGUF_TOP_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# ``blk.N.<gguf>`` -> ``model.layers.N.<hf>``.
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma3 has four norms per layer, and its `ffn_norm` is the one before the MLP.
_GGUF_GEMMA3_LAYER_NAMES = _GGUF_LAYER_NAMES | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


class GGUFCheckpoint:
    """A GGUF file seen as a Hugging Face checkpoint: config, tokenizer and named weights.

    Raises:
        LoadError: The file cannot be parsed, or its architecture is unsupported.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = GGUFFile(path)
            self.arch = str(self._field("general.architecture"))
        except Exception as e:  # ValueError, struct errors, a bad type code...
            raise LoadError.caused_by(f"{path} is not a readable GGUF file", e) from e
        if self.arch not in GGUF_ARCHITECTURES:
            raise LoadError(
                f"unsupported GGUF architecture {self.arch!r} in {path}; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )
        self.tensors = {t.name: t for t in self.reader.tensors}
        if "rope_freqs.weight" in self.tensors:
            raise LoadError(f"{path} uses per-frequency rope factors (rope_freqs), not supported")
        try:
            self.config = self._config()
        except KeyError as e:
            raise LoadError(f"{path}: GGUF metadata lacks {e.args[0]!r}") from e
        eos = [self._field(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot")]
        self.generation_config = {
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": eos_token_ids(*eos),
        }

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer (and chat template) stored in the file's metadata.

        Building it parses the whole vocabulary again (slow for Qwen2.5's 151k tokens), so
        the result is saved under ``$INFER_CACHE_DIR/tokenizers/`` and later loads read that.
        """
        saved = cache_dir() / "tokenizers" / file_key(self.path)
        if (saved / "tokenizer_config.json").is_file():
            try:
                return load_tokenizer(saved)
            except Exception:  # a damaged cache: build it again
                pass
        try:
            tokenizer = AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        except Exception as e:
            raise LoadError.caused_by(f"cannot build a tokenizer from {self.path}", e) from e
        try:
            tmp = saved.with_name(f".{saved.name}.{os.getpid()}")
            tokenizer.save_pretrained(tmp)
            os.replace(tmp, saved)
        except OSError:
            pass  # a read-only cache only costs the next load the same time again
        return tokenizer

    def tensor_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """Hugging Face name and shape of every tensor, in file order, without reading them."""
        return [(self.hf_name(t.name), _torch_shape(t)) for t in self.reader.tensors]

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, float32 tensor)`` one at a time, dequantized and un-permuted."""
        for t in self.reader.tensors:
            yield self.hf_name(t.name), self._tensor(t)

    def quantized_weights(self) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
        """:meth:`weights`, but a :class:`QuantTensor` for every 2-D tensor of a type that
        :mod:`infer.models.quant` holds as the file has it."""
        for t in self.reader.tensors:
            kept = quant.from_gguf(t.tensor_type, t.data, _torch_shape(t))
            if kept is not None:
                yield self.hf_name(t.name), self._unpermuted(t, kept)
            else:
                yield self.hf_name(t.name), self._tensor(t)

    def hf_name(self, gguf_name: str) -> str:
        """The Hugging Face name of a GGUF tensor; unknown names pass through unchanged."""
        stem, dot, suffix = gguf_name.rpartition(".")
        if not dot:
            return gguf_name
        if stem in _GGUF_TOP_NAMES:
            return f"{_GGUF_TOP_NAMES[stem]}.{suffix}"
        parts = stem.split(".")
        layer_names = _GGUF_GEMMA3_LAYER_NAMES if self.arch == "gemma3" else _GGUF_LAYER_NAMES
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
            return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
        return gguf_name

    def _unpermuted(self, t: GGUFTensor, w: QuantTensor) -> QuantTensor:
        if self.arch == "llama" and t.name.endswith(".attn_q.weight"):
            heads = self.config["num_attention_heads"]
        elif self.arch == "llama" and t.name.endswith(".attn_k.weight"):
            heads = self.config["num_key_value_heads"]
        else:
            return w
        return quant.rows(w, _unpermute_rope_rows(torch.arange(w.shape[0]), heads))

    def _tensor(self, t: GGUFTensor) -> torch.Tensor:
        kept = quant.from_gguf(t.tensor_type, t.data, _torch_shape(t))
        if kept is not None:  # the same numbers as gguf's dequantize, in a fraction of the time
            w = kept.dequantize()
        else:
            w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            w = w.reshape(_torch_shape(t))
        if self.arch == "llama" and t.name.endswith((".attn_q.weight", ".attn_q.bias")):
            w = _unpermute_rope_rows(w, self.config["num_attention_heads"])
        elif self.arch == "llama" and t.name.endswith((".attn_k.weight", ".attn_k.bias")):
            w = _unpermute_rope_rows(w, self.config["num_key_value_heads"])
        elif self.arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm scale; HF stores w
        return w

    def fields(self, keys: Iterable[str]) -> dict[str, Any]:
        """The values of those metadata ``keys`` the file holds."""
        return {k: v for k in keys if (v := self._field(k)) is not None}

    def _field(self, key: str) -> Any:
        return self.reader.fields.get(key)

    def _config(self) -> dict[str, Any]:
        """A config.json dict built from the ``<arch>.*`` metadata."""
        config: dict[str, Any] = {
            "architectures": [GGUF_ARCHITECTURES[self.arch]],
            "model_type": "gemma3_text" if self.arch == "gemma3" else self.arch,
        }
        for key, hf_key in _GGUF_CONFIG_KEYS.items():
            value = self._field(f"{self.arch}.{key}")
            if value is not None:
                config[hf_key] = value
        embed = self.tensors.get("token_embd.weight")
        if embed is None:
            raise LoadError(f"{self.path} has no token_embd.weight tensor")
        config["vocab_size"] = int(embed.shape[1])
        config["tie_word_embeddings"] = "output.weight" not in self.tensors
        scaling = self._field(f"{self.arch}.rope.scaling.type")
        if scaling not in (None, "none"):
            factor = self._field(f"{self.arch}.rope.scaling.factor")
            config["rope_scaling"] = {"rope_type": scaling, "factor": factor}
        if self.arch == "gemma3":
            pattern = self._field("gemma3.attention.sliding_window_pattern")
            config.update(_gemma3_config(config, pattern))
        config["bos_token_id"] = self._field("tokenizer.ggml.bos_token_id")
        config["eos_token_id"] = self._field("tokenizer.ggml.eos_token_id")
        return config


def _torch_shape(t: GGUFTensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-first; torch wants them slowest-first.
    return tuple(int(n) for n in reversed(t.shape))


def _gemma3_config(config: dict[str, Any], pattern: int | list[bool] | None) -> dict[str, Any]:
    """Gemma3 settings that llama.cpp hard-codes rather than stores (as do HF's defaults)."""
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    # llama.cpp: 27B (62 layers) scales queries by hidden/heads, the others by head_dim.
    scalar = config["hidden_size"] // heads if config["num_hidden_layers"] == 62 else head_dim
    extra: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": 10_000.0,
        "sliding_window_pattern": 6,
    }
    if isinstance(pattern, int):
        extra["sliding_window_pattern"] = pattern
    elif isinstance(pattern, list):  # one flag per layer: True is a sliding-window layer
        extra["layer_types"] = ["sliding_attention" if s else "full_attention" for s in pattern]
    return extra


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp's converter interleaves each head's two rotary halves (rows ``[a0..a31,
    b0..b31]`` become ``[a0, b0, a1, b1, ...]``) for its rope kernel; HF models rotate halves.
    """
    rows = w.shape[0]
    w = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])  # [H, D/2, 2, ...]
    return w.transpose(1, 2).reshape(rows, *w.shape[3:])
