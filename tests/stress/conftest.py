"""Fixtures for the server stress tests: a tiny random Llama (fast) with the real tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from quart_trio import QuartTrio
from transformers import PreTrainedTokenizerBase

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.models.base import CausalLM
from infer.server.app import create_app
from infer.server.config import ServerConfig
from support.server import GatedModel, StepGate


@pytest.fixture
def tiny_app(
    tiny_model: CausalLM, default_tokenizer: PreTrainedTokenizerBase
) -> Callable[..., QuartTrio]:
    """Build an app on the tiny model; it never emits EOS, so streams run to max_tokens.

    Keyword arguments go to ``ServerConfig``; ``engine`` (a dict) to ``EngineConfig``;
    ``gate`` wraps the model in a :class:`GatedModel`, ``model`` replaces it.
    """

    def build(
        engine: dict[str, Any] | None = None,
        gate: StepGate | None = None,
        model: torch.nn.Module | None = None,
        **server: Any,
    ) -> QuartTrio:
        config = EngineConfig(**({"max_seq_len": 512, "max_batch_size": 4} | (engine or {})))
        net = model or (GatedModel(tiny_model, gate) if gate else tiny_model)
        eng = Engine(config, net, default_tokenizer, [], "tiny")  # type: ignore[arg-type]
        return create_app(ServerConfig(engine=config, **server), eng)

    return build
