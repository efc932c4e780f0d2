"""What turns an encoder's hidden states into one vector per text, as a sentence-transformers
folder says: its ``modules.json`` (Transformer → Pooling → optional Normalize), the Pooling
module's ``config.json`` and the Transformer's ``sentence_bert_config.json``.

A folder with no ``modules.json`` (a plain Hugging Face encoder) gets what sentence-transformers
gives one: mean pooling, no normalisation, the tokenizer's or the model's length limit.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len_tokens", "lasttoken")
# sentence-transformers' older configs: one boolean per mode, in the order it concatenates them
_LEGACY_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class SentenceConfig:
    """How an embedding model reads a text and pools it.

    ``pooling`` holds one mode or several, whose vectors are concatenated in order.
    ``max_length`` counts every token the encoder reads, its special tokens included.
    """

    pooling: tuple[str, ...] = ("mean",)
    normalize: bool = False
    max_length: int = 512
    lowercase: bool = False  # the Transformer module lowercases text before tokenizing


def read_sentence_config(folder: Path, model_max: int) -> SentenceConfig:
    """The pooling, normalisation and length limit a model folder declares.

    Args:
        folder: The model directory.
        model_max: The longest input the encoder can take (its position table), the limit
            when the folder names none and the cap when it names a larger one.

    Raises:
        ValueError: A file is unreadable, or names a module or pooling mode infer does not run.
    """
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return SentenceConfig(max_length=min(_tokenizer_max(folder) or model_max, model_max))
    modules = _read(modules_path)
    if not isinstance(modules, list):
        raise ValueError(f"{modules_path} does not hold a list of modules")
    kinds = {str(m.get("type", "")).rpartition(".")[2]: m for m in modules}
    unknown = [kind for kind in kinds if kind not in _MODULES]
    if unknown:
        raise ValueError(
            f"modules.json names {', '.join(unknown)}: infer runs {', '.join(_MODULES)}"
        )
    transformer = _module_config(folder, kinds.get("Transformer"), "sentence_bert_config.json")
    pooling = _module_config(folder, kinds.get("Pooling"), "config.json")
    max_length = transformer.get("max_seq_length") or _tokenizer_max(folder) or model_max
    return SentenceConfig(
        pooling=_pooling_modes(pooling) if "Pooling" in kinds else ("mean",),
        normalize="Normalize" in kinds,
        max_length=min(int(max_length), model_max),
        lowercase=bool(transformer.get("do_lower_case", False)),
    )


def pool(hidden: Tensor, mask: Tensor, modes: tuple[str, ...]) -> Tensor:
    """One vector per row of right-padded hidden states.

    Args:
        hidden: ``[B, T, C]`` float32 hidden states.
        mask: ``[B, T]`` bool, True for real tokens (each row has at least one).
        modes: Pooling modes, concatenated in order.

    Returns:
        ``[B, C * len(modes)]`` float32.
    """
    lengths = mask.sum(1, keepdim=True).float()  # [B, 1]
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(hidden[:, 0])
        elif mode == "lasttoken":
            rows = torch.arange(hidden.shape[0], device=hidden.device)
            out.append(hidden[rows, lengths.squeeze(1).long() - 1])
        elif mode == "max":
            out.append(hidden.masked_fill(~mask[..., None], float("-inf")).amax(1))
        else:
            total = torch.bmm(mask[:, None, :].to(hidden.dtype), hidden).squeeze(1)  # [B, C]
            out.append(total / (lengths if mode == "mean" else lengths.sqrt()))
    return out[0] if len(out) == 1 else torch.cat(out, dim=-1)


def normalize(vectors: Tensor) -> Tensor:
    """Each row scaled to unit length (a zero row stays zero)."""
    return F.normalize(vectors, p=2.0, dim=-1)


def _pooling_modes(config: dict[str, Any]) -> tuple[str, ...]:
    mode = config.get("pooling_mode")
    if mode is None:
        legacy = tuple(name for key, name in _LEGACY_MODES.items() if config.get(key))
        modes = legacy or ("mean",)
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    unsupported = [m for m in modes if m not in POOLING_MODES]
    if unsupported:
        raise ValueError(
            f"unsupported pooling mode {unsupported[0]!r}; supported: {', '.join(POOLING_MODES)}"
        )
    if config.get("include_prompt") is False:
        raise ValueError(
            "pooling that leaves out a prompt (include_prompt: false) is not supported"
        )
    return modes


def _module_config(folder: Path, module: dict[str, Any] | None, name: str) -> dict[str, Any]:
    if module is None:
        return {}
    path = folder / str(module.get("path", "")) / name
    if not path.is_file():
        return {}
    config = _read(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return config


def _tokenizer_max(folder: Path) -> int | None:
    path = folder / "tokenizer_config.json"
    config = _read(path) if path.is_file() else {}
    value = config.get("model_max_length") if isinstance(config, dict) else None
    # transformers writes a huge sentinel for "no limit"
    return value if isinstance(value, int) and value < 1_000_000 else None


def _read(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path} ({e})") from e
