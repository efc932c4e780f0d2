"""Ollama's answers in its shapes: the model list, show and ps, the lines of a generation
(``/api/generate``'s ``response``, ``/api/chat``'s ``message``) and its last line with the
counts and durations (nanoseconds), the embedding answers, and ``{"error": "..."}``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, NotRequired

from typing_extensions import TypedDict

from infer.api.errors import APIError, ErrorCode
from infer.api.ollama.card import ModelCard, human_number
from infer.api.writer import Timing
from infer.engine.request import Failure, FinishReason, Outcome

if TYPE_CHECKING:
    from torch import Tensor

# The Ollama release whose API these routes follow (its api/types.go); clients compare it
# with the release a feature needs (Copilot Chat asks for 0.6.4 or later).
VERSION = "0.32.0"
# When a model that is never unloaded expires (ps)
FOREVER = "9999-12-31T23:59:59Z"

DoneReason = Literal["stop", "length", "load", "unload"]


class OllamaError(TypedDict):
    """Every error of Ollama's routes, and the line that ends a stream that failed."""

    error: str


class OllamaVersion(TypedDict):
    version: str


class OllamaModelDetails(TypedDict):
    parent_model: str
    format: str
    family: str
    families: list[str]
    parameter_size: str
    quantization_level: str


class OllamaListedModel(TypedDict):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: OllamaModelDetails


class OllamaListResponse(TypedDict):
    """`GET /api/tags`: every served model under each of its names, loaded or not."""

    models: list[OllamaListedModel]


class OllamaRunningModel(OllamaListedModel):
    expires_at: str
    size_vram: int
    context_length: int


class OllamaProcessResponse(TypedDict):
    """`GET /api/ps`: the loaded models, and when each one's keep-alive ends."""

    models: list[OllamaRunningModel]


class OllamaShowResponse(TypedDict):
    """`POST /api/show`: how the model prompts, its parameters, sizes and capabilities."""

    modelfile: str
    parameters: str
    template: str
    details: OllamaModelDetails
    model_info: dict[str, Any]
    capabilities: list[str]
    modified_at: str


class OllamaCalledFunction(TypedDict):
    index: int
    name: str
    arguments: dict[str, Any]


class OllamaReplyCall(TypedDict):
    id: str
    function: OllamaCalledFunction


class OllamaReplyMessage(TypedDict):
    role: Literal["assistant"]
    content: str
    thinking: NotRequired[str]
    tool_calls: NotRequired[list[OllamaReplyCall]]


class OllamaReplyLine(TypedDict):
    """What every line of a reply has; the last one is `done`, with `done_reason`, the counts
    and the durations in nanoseconds."""

    model: str
    created_at: str
    done: bool
    done_reason: NotRequired[DoneReason]
    total_duration: NotRequired[int]
    load_duration: NotRequired[int]
    prompt_eval_count: NotRequired[int]
    prompt_eval_duration: NotRequired[int]
    eval_count: NotRequired[int]
    eval_duration: NotRequired[int]


class OllamaGenerateResponse(OllamaReplyLine):
    """`POST /api/generate` with `stream: false`, and each line of its stream."""

    response: str
    thinking: NotRequired[str]


class OllamaChatResponse(OllamaReplyLine):
    """`POST /api/chat` with `stream: false`, and each line of its stream."""

    message: OllamaReplyMessage


class OllamaEmbedResponse(TypedDict):
    """`POST /api/embed`: a vector per input, in order (durations in nanoseconds)."""

    model: str
    embeddings: list[list[float]]
    total_duration: int
    load_duration: int
    prompt_eval_count: int


class OllamaEmbeddingResponse(TypedDict):
    """`POST /api/embeddings`: the vector of `prompt` (none for no prompt)."""

    embedding: list[float]


def error_body(error: APIError) -> OllamaError:
    """Ollama's error shape: the message alone."""
    return {"error": error.message}


def not_found(model: str) -> APIError:
    """A model this server does not serve, as Ollama (and Continue, which reads it) words
    it."""
    return APIError(ErrorCode.NOT_FOUND, f"model '{model}' not found")


@contextmanager
def refusing(model: str, what: Literal["generate", "chat", "embeddings"]) -> Iterator[None]:
    """Say a refusal of the other kind of model (an embedding model asked for text, or one
    that generates text asked for embeddings) as Ollama does, naming its route."""
    try:
        yield
    except APIError as e:
        if e.code is not ErrorCode.WRONG_MODEL_KIND:
            raise
        kind = "a model that generates text" if what == "embeddings" else "an embedding model"
        route = "/api/generate or /api/chat" if what == "embeddings" else "/api/embed"
        message = f"{model!r} does not support {what}: it is {kind} (use {route})"
        raise APIError(e.code, message) from None


def cannot_manage(action: str) -> APIError:
    """``pull``, ``push``, ``create``, ``copy``, ``delete``: not here."""
    return APIError(
        ErrorCode.INVALID_REQUEST,
        f"this server does not {action} models: it serves the models it was started with "
        "(infer serve --model, --models-file)",
    )


def version() -> OllamaVersion:
    return {"version": VERSION}


def timestamp(unix: float) -> str:
    """RFC 3339 in UTC, as Go writes a time (``2024-05-01T12:00:00.123456Z``)."""
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def details(card: ModelCard) -> OllamaModelDetails:
    return {
        "parent_model": "",
        "format": card.file_format,
        "family": card.family,
        "families": [card.family],
        "parameter_size": human_number(count) if (count := card.parameter_count()) else "",
        "quantization_level": card.quantization,
    }


def listed(card: ModelCard) -> list[OllamaListedModel]:
    """A model under each of its names."""
    about = {"modified_at": timestamp(card.loaded_at), "size": card.size, "digest": card.digest}
    return [
        {"name": name, "model": name, **about, "details": details(card)}  # type: ignore[typeddict-item]
        for name in card.names
    ]


def model_list(*cards: ModelCard) -> OllamaListResponse:
    return {"models": [model for card in cards for model in listed(card)]}


def running(*cards: ModelCard) -> OllamaProcessResponse:
    """The loaded models, each under each of its names."""
    models = []
    for card in cards:
        expires = timestamp(card.expires_at) if math.isfinite(card.expires_at) else FOREVER
        extra = {"expires_at": expires, "size_vram": 0, "context_length": card.context_length}
        models += [{**model, **extra} for model in listed(card)]
    return {"models": models}  # type: ignore[typeddict-item]


def show(card: ModelCard) -> OllamaShowResponse:
    return {
        "modelfile": card.modelfile(),
        "parameters": card.parameters(),
        "template": card.template(),
        "details": details(card),
        "model_info": card.model_info(),
        "capabilities": card.capabilities(),
        "modified_at": timestamp(card.loaded_at),
    }


def loaded(model: str, unload: bool, chat: bool) -> dict[str, Any]:
    """The answer to a request with nothing to generate (an empty prompt or conversation):
    Ollama loads (or, with ``keep_alive: 0``, unloads) the model and says so."""
    body: dict[str, Any] = {"model": model, "created_at": timestamp(time.time())}
    if chat:
        body["message"] = {"role": "assistant", "content": ""}
    else:
        body["response"] = ""
    return body | {"done": True, "done_reason": "unload" if unload else "load"}


def done_reason(outcome: Outcome) -> DoneReason | None:
    """How a reply that ended so reports its end; ``None``: it failed (a time limit ends it
    as ``length``)."""
    if isinstance(outcome, Failure):
        return "length" if outcome is Failure.TIMEOUT else None
    return "length" if outcome is FinishReason.LENGTH else "stop"


def durations(
    timing: Timing, now: float, prompt: int, generated: int, load_s: float = 0.0
) -> dict[str, int]:
    """The counts and the durations (nanoseconds) of the last line. ``load_s``: how long the
    request waited for its model to be loaded; reading the prompt counts from then (its wait
    in the queue included)."""
    first = timing.first_token_at if timing.first_token_at is not None else now
    return {
        "total_duration": _ns(now - timing.arrival),
        "load_duration": _ns(load_s),
        "prompt_eval_count": prompt,
        "prompt_eval_duration": _ns(max(0.0, first - timing.arrival - load_s)),
        "eval_count": generated,
        "eval_duration": _ns(now - first),
    }


def embedded(
    model: str, vectors: Tensor, tokens: int, spent: float, load_s: float = 0.0
) -> OllamaEmbedResponse:
    """``/api/embed``'s answer: ``spent`` seconds from the request's arrival, ``load_s`` of
    them waiting for the model to be loaded."""
    return {
        "model": model,
        "embeddings": vectors.tolist(),
        "total_duration": _ns(spent),
        "load_duration": _ns(load_s),
        "prompt_eval_count": tokens,
    }


def embedding(vectors: Tensor) -> OllamaEmbeddingResponse:
    """``/api/embeddings``' answer: the one vector (none for no prompt)."""
    return {"embedding": vectors[0].tolist() if len(vectors) else []}


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))
