"""Fixtures for the server tests: apps on the real default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from quart_trio import QuartTrio

from infer.models.loader import LoadedModel, load_model
from support.apps import build_app

AppFactory = Callable[..., QuartTrio]


@pytest.fixture(scope="session")
def default_model_fp32() -> LoadedModel:
    """The default model in float32 (for tests that compare greedy runs across batches).

    In bfloat16 the logits are coarse enough that exact ties between the top two tokens are
    common, and batch composition moves logits by about one bf16 step; a greedy choice
    between tied tokens then depends on what else is in the batch. In float32 the batch
    noise is about 1e-5, far below the smallest margins, so greedy output is batch-invariant.
    """
    return load_model("default", dtype=torch.float32)


def app_factory(loaded: LoadedModel) -> AppFactory:
    """Build apps on ``loaded`` (see :func:`support.apps.build_app`: each with its own engine
    and KV cache on the shared weights), in the model's dtype."""
    dtype = str(loaded.model.dtype).removeprefix("torch.")

    def build(engine: dict[str, Any] | None = None, **kwargs: Any) -> QuartTrio:
        config = {"dtype": dtype} | (engine or {})
        return build_app(
            loaded.model,
            loaded.tokenizer,
            loaded.eos_token_ids,
            loaded.name,
            engine=config,
            **kwargs,
        )

    return build


@pytest.fixture
def real_app(default_model: LoadedModel) -> AppFactory:
    """Build apps serving the default model (bfloat16, loaded once per session)."""
    return app_factory(default_model)


@pytest.fixture
def real_app_fp32(default_model_fp32: LoadedModel) -> AppFactory:
    """Build apps serving the default model in float32."""
    return app_factory(default_model_fp32)


@pytest.fixture(scope="session")
def qwen_model() -> LoadedModel:
    """Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF, from its chunk packages), kept quantized."""
    return load_model("qwen2.5-coder-0.5b")


@pytest.fixture
def qwen_app(qwen_model: LoadedModel) -> AppFactory:
    """Build apps serving the real Qwen2.5 model."""
    return app_factory(qwen_model)
