"""Load a model and its tokenizer from a Hugging Face directory, a GGUF file or the hub.

Every path ends in :func:`infer.models.registry.create_model`, which takes the weights one
tensor at a time by their Hugging Face names: safetensors files are read tensor by tensor,
GGUF tensors are dequantized one by one, so there is never a second full copy in memory.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from safetensors import SafetensorError, safe_open
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from infer.models.base import CausalLM
from infer.models.config import ModelConfig
from infer.models.registry import create_model

DEFAULT_SOURCE = "default"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# What a hub download fetches: config, safetensors weights and tokenizer files, nothing else.
HUB_ALLOW_PATTERNS = [
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    "*.safetensors",
    WEIGHTS_INDEX_NAME,
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "*.model",
    "chat_template.*",
]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")

# GGUF architecture -> Hugging Face architecture.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
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


class LoadError(Exception):
    """A model could not be loaded. The message is one line that names the problem."""


@dataclass
class LoadedModel:
    """A model ready to run, with what a server needs to talk to it."""

    model: CausalLM
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    name: str  # the id users see: "SmolLM2-135M-Instruct", a dir or file name, a hub id
    eos_token_ids: list[int]
    chat_template: bool


def load_model(
    source: str, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
) -> LoadedModel:
    """Load a model and its tokenizer.

    Args:
        source: ``"default"`` (the embedded SmolLM2-135M-Instruct), a Hugging Face
            directory (config.json, safetensors, tokenizer files), a ``.gguf`` file, or a
            hub id ``org/name`` (downloaded when the hub is reachable).
        dtype: Dtype of the weights and activations.
        device: Torch device string.

    Raises:
        LoadError: The source is missing, corrupt, unsupported or cannot be downloaded.
    """
    if source == DEFAULT_SOURCE:
        # Imported here because default.py builds on this module.
        from infer.models.default import DEFAULT_MODEL_NAME, ensure_default_model

        return load_hf_dir(ensure_default_model(), dtype, device, name=DEFAULT_MODEL_NAME)
    path = Path(source).expanduser()
    if path.is_dir():
        return load_hf_dir(path, dtype, device)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return load_gguf(path, dtype, device)
        raise LoadError(f"{source} is neither a model directory nor a .gguf file")
    if _HUB_ID.fullmatch(source) and not source.lower().endswith(".gguf"):
        return load_hf_dir(download_from_hub(source), dtype, device, name=source)
    raise LoadError(f"model path does not exist: {source}")


def load_hf_dir(
    path: Path, dtype: torch.dtype, device: str, name: str | None = None
) -> LoadedModel:
    """Load a Hugging Face model directory (config.json + safetensors + tokenizer files)."""
    config_path = path / CONFIG_NAME
    if not config_path.is_file():
        raise LoadError(f"{path} has no {CONFIG_NAME}: not a Hugging Face model directory")
    config_dict = _read_json(config_path)
    config = _model_config(config_dict, path)
    files = _safetensors_files(path)
    tokenizer = _load_tokenizer(path)
    model = _create(config, _safetensors_weights(files), dtype, device, path)
    generation_path = path / GENERATION_CONFIG_NAME
    generation = _read_json(generation_path) if generation_path.is_file() else {}
    eos = _eos_token_ids(
        generation.get("eos_token_id"), config_dict.get("eos_token_id"), tokenizer.eos_token_id
    )
    return LoadedModel(
        model,
        tokenizer,
        config,
        name or path.resolve().name,
        eos,
        tokenizer.chat_template is not None,
    )


def load_gguf(path: Path, dtype: torch.dtype, device: str) -> LoadedModel:
    """Load a ``.gguf`` file: dequantized weights, config and tokenizer from its metadata."""
    checkpoint = GGUFCheckpoint(path)
    config = _model_config(checkpoint.config, path)
    tokenizer = checkpoint.tokenizer()
    model = _create(config, checkpoint.weights(), dtype, device, path)
    eos = _eos_token_ids(checkpoint.generation_config["eos_token_id"], tokenizer.eos_token_id)
    return LoadedModel(
        model, tokenizer, config, path.name, eos, tokenizer.chat_template is not None
    )


def download_from_hub(repo_id: str) -> Path:
    """Download a hub model's config, safetensors and tokenizer files (``HF_TOKEN`` honoured).

    Raises:
        LoadError: The hub is unreachable (or offline mode is on) and the files are not
            cached, or the repository does not exist or is gated.
    """
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except LocalEntryNotFoundError as e:
        reason = "the hub is unreachable (or HF_HUB_OFFLINE is set) and it is not cached"
        raise LoadError(f"cannot download {repo_id!r}: {reason}") from e
    except GatedRepoError as e:
        reason = "it is gated: accept its terms on the hub and set HF_TOKEN"
        raise LoadError(f"cannot download {repo_id!r}: {reason}") from e
    except RepositoryNotFoundError as e:
        reason = "no such model on the hub (or it is private: set HF_TOKEN)"
        raise LoadError(f"cannot download {repo_id!r}: {reason}") from e
    except Exception as e:  # HTTP errors, a full disk...: say what happened, on one line
        raise LoadError(f"cannot download {repo_id!r} from the hub ({_one_line(e)})") from e


class GGUFCheckpoint:
    """A GGUF file seen as a Hugging Face checkpoint: config, tokenizer and named weights.

    Raises:
        LoadError: The file cannot be parsed, or its architecture is unsupported.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = GGUFReader(path)
            self.arch = str(self._field("general.architecture"))
        except Exception as e:  # GGUFReader raises ValueError, KeyError, struct errors...
            raise LoadError(f"{path} is not a readable GGUF file ({_one_line(e)})") from e
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
            "eos_token_id": _eos_token_ids(*eos),
        }

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The tokenizer (and chat template) stored in the file's metadata."""
        try:
            return AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name)
        except Exception as e:
            raise LoadError(f"cannot build a tokenizer from {self.path} ({_one_line(e)})") from e

    def tensor_specs(self) -> list[tuple[str, tuple[int, ...]]]:
        """Hugging Face name and shape of every tensor, in file order, without reading them."""
        return [(self.hf_name(t.name), _torch_shape(t)) for t in self.reader.tensors]

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, float32 tensor)`` one at a time, dequantized and un-permuted."""
        for t in self.reader.tensors:
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

    def _tensor(self, t: ReaderTensor) -> torch.Tensor:
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape(_torch_shape(t))
        if self.arch == "llama" and t.name.endswith((".attn_q.weight", ".attn_q.bias")):
            w = _unpermute_rope_rows(w, self.config["num_attention_heads"])
        elif self.arch == "llama" and t.name.endswith((".attn_k.weight", ".attn_k.bias")):
            w = _unpermute_rope_rows(w, self.config["num_key_value_heads"])
        elif self.arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm scale; HF stores w
        return w

    def _field(self, key: str) -> Any:
        field = self.reader.fields.get(key)
        return None if field is None else field.contents()

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


def _torch_shape(t: ReaderTensor) -> tuple[int, ...]:
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


def _model_config(config: dict[str, Any], where: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(config)
    except ValueError as e:
        raise LoadError(f"{where}: {e}") from e


def _create(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: str,
    where: Path,
) -> CausalLM:
    try:
        return create_model(config, weights, dtype=dtype, device=device)
    except ValueError as e:
        raise LoadError(f"{where}: {e}") from e


def _safetensors_files(path: Path) -> list[Path]:
    """The weight files of a directory, each checked to have a readable header."""
    index = path / WEIGHTS_INDEX_NAME
    if (path / WEIGHTS_NAME).is_file():
        files = [path / WEIGHTS_NAME]
    elif index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise LoadError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise LoadError(f"{path} has neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}")
    for file in files:
        if not file.is_file():
            raise LoadError(f"weight file listed in {WEIGHTS_INDEX_NAME} is missing: {file}")
        with _open_safetensors(file):
            pass  # opening parses the header and checks it against the file size
    return files


def _safetensors_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with _open_safetensors(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                try:
                    tensor = f.get_tensor(name)
                except SafetensorError as e:
                    raise LoadError(f"corrupt safetensors file {file} ({_one_line(e)})") from e
                yield name, tensor


def _open_safetensors(file: Path) -> Any:
    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        raise LoadError(f"corrupt or truncated safetensors file {file} ({_one_line(e)})") from e


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # missing files, bad JSON, missing sentencepiece: all one story
        raise LoadError(f"cannot load the tokenizer from {path} ({_one_line(e)})") from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError(f"cannot read {path} ({_one_line(e)})") from e
    if not isinstance(data, dict):
        raise LoadError(f"{path} does not hold a JSON object")
    return data


def _eos_token_ids(*sources: int | list[int] | None) -> list[int]:
    """All end-of-sequence ids named by any source, deduplicated, in order of first mention."""
    ids: list[int] = []
    for source in sources:
        for i in source if isinstance(source, list | tuple) else [source]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    return line if len(line) <= 200 else line[:197] + "..."
