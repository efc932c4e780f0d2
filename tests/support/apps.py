"""Apps (not started) serving a model in memory, each with an engine and KV cache of its own:
the one way the tests build them, on the real models and the tiny random ones alike."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from quart_trio import QuartTrio
from transformers import PreTrainedTokenizerBase

from infer.engine.config import EngineConfig
from infer.engine.engine import Engine
from infer.models.fim import find_fim_tokens
from infer.server.app import create_app
from infer.server.config import ServerConfig
from support.server import GatedModel, StepGate


def build_app(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    eos_token_ids: Sequence[int] = (),
    name: str = "tiny",
    *,
    engine: dict[str, Any] | None = None,
    gate: StepGate | None = None,
    **server: Any,
) -> QuartTrio:
    """An app (not started) serving ``model`` with an engine of its own.

    ``engine`` (a dict) goes to ``EngineConfig`` over ``max_seq_len=512, max_batch_size=4``;
    ``gate`` wraps the model in a :class:`GatedModel`; other keywords go to ``ServerConfig``.
    """
    config = EngineConfig(**({"max_seq_len": 512, "max_batch_size": 4} | (engine or {})))
    net = GatedModel(model, gate) if gate else model
    fim = find_fim_tokens(tokenizer)
    eng = Engine(config, net, tokenizer, eos_token_ids, name, fim=fim)  # type: ignore[arg-type]
    return create_app(ServerConfig(engine=config, **server), eng)
