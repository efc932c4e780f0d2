"""Fixtures for the server stress tests: a tiny random Llama (fast) with the real tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from quart_trio import QuartTrio
from transformers import PreTrainedTokenizerBase

from infer.models.base import CausalLM
from support.apps import build_app


@pytest.fixture
def tiny_app(
    tiny_model: CausalLM, default_tokenizer: PreTrainedTokenizerBase
) -> Callable[..., QuartTrio]:
    """Build an app on the tiny model; it never emits EOS, so streams run to max_tokens.

    Keyword arguments go to ``ServerConfig``; ``engine`` (a dict) to ``EngineConfig``;
    ``gate`` wraps the model in a :class:`GatedModel`, ``model`` replaces it.
    """

    def build(model: torch.nn.Module | None = None, **kwargs: Any) -> QuartTrio:
        return build_app(model or tiny_model, default_tokenizer, [], "tiny", **kwargs)

    return build
