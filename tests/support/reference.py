"""Plain reference implementations of sampling steps, to check the engine's fast paths, and
transformers' load of a GGUF file, to check the models."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import safetensors.torch
import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from infer.engine.params import SamplingParams
from infer.engine.sampler import _candidates
from support.cache import cached


def apply_top_k(logits: Tensor, k: int) -> Tensor:
    """Keep exactly the ``k`` largest of ``[V]`` logits (ties keep k); 0 or ``k >= V``: all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    top = torch.topk(logits, k)
    return torch.full_like(logits, -math.inf).scatter_(-1, top.indices, top.values)


def apply_top_p(logits: Tensor, p: float) -> Tensor:
    """Keep the smallest set of likeliest tokens whose mass reaches ``p`` (a full sort)."""
    if p >= 1.0:
        return logits
    probs, ids = torch.sort(torch.softmax(logits, dim=-1), descending=True)
    before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ahead of each
    keep = ids[: max(1, int((before < p).sum()))]
    return torch.full_like(logits, -math.inf).scatter_(-1, keep, logits[keep])


def sampling_probs(logits: Tensor, params: SamplingParams, history: Sequence[int]) -> Tensor:
    """The ``[V]`` distribution the engine's sampler draws one row from (0 where masked).

    Raises:
        ValueError: ``params`` is greedy (there is no distribution to draw from).
    """
    if params.greedy:
        raise ValueError("sampling_probs needs temperature > 0")
    weights, ids = _candidates(logits, params, history)
    weights = weights / weights.sum()
    return weights if ids is None else torch.zeros_like(logits).scatter_(-1, ids, weights)


def transformers_gguf(path: Path, cache: Path | None = None) -> PreTrainedModel:
    """transformers' own load of a GGUF file, in float32: the independent reference the real
    models' logits are checked against.

    Converting the file takes transformers tens of seconds, so with ``cache`` (a folder, see
    :func:`support.cache.cached`) what it built, its config and its float32 state dict, is
    kept there, and a later run loads that through the same model class instead: the same
    tensors, the same forward.
    """
    return cached(cache, path, lambda: _convert(path), _save, _load, version=1)


def _save(model: PreTrainedModel, folder: Path) -> None:
    config = model.config.to_dict()
    config.pop("quantization_config", None)  # the weights are kept dequantized
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    safetensors.torch.save_model(model, str(folder / "model.safetensors"))


def _load(folder: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def _convert(path: Path) -> PreTrainedModel:
    """``from_pretrained(gguf_file=...)``, unchanged in what it loads, with two of gguf's
    pure functions shared between the calls transformers makes to them.

    transformers reads the file's metadata twice (once for the config, once with the
    tensors), and gguf's reader parses a vocabulary of 150k-260k strings in Python each
    time (~12 s apiece here): the two reads share one reader. It also asks gguf for its
    tensor-name map once per module of the model (~400 times, ~40 ms apiece, for the same
    architecture and depth): those share one map.
    """
    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def shared(source: Any, mode: str = "r") -> Any:
        key = (str(source), mode)
        if key not in readers:
            readers[key] = original_reader(source, mode)
        return readers[key]

    # transformers imports both from gguf inside each call
    gguf.GGUFReader = shared
    gguf.get_tensor_name_map = functools.cache(original_map)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=torch.float32
        )
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = original_reader, original_map
    return model.eval()
