"""The answer of OpenAI's ``/v1/embeddings``."""

from __future__ import annotations

import base64
from typing import Literal

from torch import Tensor
from typing_extensions import TypedDict


class EmbeddingUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class EmbeddingItem(TypedDict):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32


class EmbeddingList(TypedDict):
    """`POST /v1/embeddings`."""

    object: Literal["list"]
    data: list[EmbeddingItem]
    model: str
    usage: EmbeddingUsage


def embedding_list(
    model: str, vectors: Tensor, tokens: int, encoding: Literal["float", "base64"]
) -> EmbeddingList:
    """The answer: one item per row of ``vectors`` (``[N, D]`` float32), and the input
    tokens the model read (special tokens included)."""
    rows = vectors.float().contiguous()
    data: list[EmbeddingItem] = [
        {"object": "embedding", "index": i, "embedding": _encode(row, encoding)}
        for i, row in enumerate(rows)
    ]
    usage: EmbeddingUsage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _encode(row: Tensor, encoding: Literal["float", "base64"]) -> list[float] | str:
    if encoding == "base64":  # what numpy.frombuffer(..., dtype="float32") reads back
        return base64.b64encode(row.numpy().astype("<f4").tobytes()).decode("ascii")
    return [float(x) for x in row.tolist()]
