"""Which served models stay in memory: the memory budget, pins and keep-alive, as policy;
and what a model costs and takes to bring in (:func:`estimated_size`, :func:`load`).

The policy is pure functions over what the server knows of each model (:class:`Resident`);
the server loads, unloads and keeps the clock. A model may be unloaded only when it is
loaded, idle (no request is being admitted to it or read from it) and not pinned. To make
room for another, the least recently used such models go first, and only as many as needed;
a model whose keep-alive has run out since it went idle goes on its own.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from infer.engine.config import DEFAULT_KV_CACHE_GB, DTYPES, EngineConfig
from infer.engine.embed import Embedder
from infer.engine.engine import Engine
from infer.models.config import ModelKind
from infer.models.errors import WrongKindError
from infer.models.footprint import source_bytes
from infer.models.loader import load_model
from infer.models.packaged import PACKAGED_FOLDERS


class Resident(Protocol):
    """What the policy reads of a served model."""

    @property
    def loaded(self) -> bool: ...
    @property
    def busy(self) -> bool: ...
    @property
    def pinned(self) -> bool: ...
    @property
    def size(self) -> int: ...  # bytes it holds (or will hold) in memory
    @property
    def last_used(self) -> float: ...
    @property
    def expires_at(self) -> float: ...  # when its keep-alive ends (inf: never, or busy)


def evictable(models: Sequence[Resident]) -> list[Resident]:
    """The models that may be unloaded now, least recently used first."""
    idle = [m for m in models if m.loaded and not m.busy and not m.pinned]
    return sorted(idle, key=lambda m: m.last_used)


def to_evict(models: Sequence[Resident], need: int, budget: int) -> list[Resident] | None:
    """The models to unload so that ``need`` more bytes fit in ``budget``.

    Args:
        models: Every served model (those loaded count against the budget).
        need: Bytes the model about to load takes.
        budget: Bytes all loaded models may take together.

    Returns:
        The least recently used idle unpinned models whose bytes make room (none when it
        fits already), or ``None`` when even all of them would not.
    """
    used = sum(m.size for m in models if m.loaded)
    chosen: list[Resident] = []
    for model in evictable(models):
        if used + need <= budget:
            break
        chosen.append(model)
        used -= model.size
    return chosen if used + need <= budget else None


def expired(models: Sequence[Resident], now: float) -> list[Resident]:
    """The models whose keep-alive has run out (idle, unpinned, loaded)."""
    return [m for m in evictable(models) if m.expires_at <= now]


def next_expiry(models: Sequence[Resident]) -> float:
    """When the next keep-alive runs out (``inf``: none will)."""
    return min((m.expires_at for m in evictable(models)), default=math.inf)


def estimated_size(config: EngineConfig) -> int:
    """Bytes a model will hold, before it is first loaded: its files, and a generative
    model's KV cache budget (the packaged encoders have none)."""
    kv = 0 if config.model in PACKAGED_FOLDERS else (config.kv_cache_gb or DEFAULT_KV_CACHE_GB)
    return source_bytes(config.model, config.weights) + int(kv * 1e9)


def load(config: EngineConfig) -> Engine | Embedder:
    """Load ``config.model``: an engine for a generative model, an embedder for an encoder
    (call it in a thread that may own an OpenMP team: loading runs torch work).

    Raises:
        LoadError: The model cannot be loaded.
    """
    try:
        return Engine.from_config(config)
    except WrongKindError:  # found from its config, before its weights were read
        pass
    where = (DTYPES[config.dtype], config.device, config.weights)
    return Embedder(load_model(config.model, *where, kind=ModelKind.EMBED))
