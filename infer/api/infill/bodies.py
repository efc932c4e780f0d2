"""The answers of llama.cpp's ``/infill`` in its shapes: the completion object (non-streamed,
and the last event of a stream), each streamed piece, and its error body.

llama.vim matches the raw body against ``"content":"`` (no space after the colon): every
body goes out as compact JSON, as Quart writes it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NotRequired

from typing_extensions import TypedDict

from infer.api.errors import APIError
from infer.engine.request import FinishReason, Outcome

StopType = Literal["none", "eos", "limit", "word"]


class Timings(TypedDict):
    """What the completion cost, as llama.cpp reports it (milliseconds)."""

    cache_n: int  # prompt tokens the prefix cache served
    prompt_n: int  # prompt tokens read this time
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class GenerationSettings(TypedDict):
    n_ctx: int
    n_predict: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: list[str]
    n_indent: int
    t_max_predict_ms: int
    samplers: list[str]


class InfillResponse(TypedDict):
    """`POST /infill`: the completion (``n_cmpl`` > 1: a list of them). With
    ``response_fields``, only those fields, each under its path (``timings/prompt_n``)."""

    index: int
    content: str
    tokens: list[int]
    id_slot: int
    stop: bool
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: GenerationSettings
    has_new_line: bool
    truncated: bool
    stop_type: StopType
    stopping_word: str
    tokens_cached: int
    timings: Timings


class InfillPiece(TypedDict):
    """One streamed piece of the completion (``data:`` lines; the last is the whole
    :class:`InfillResponse` with empty ``content``)."""

    index: int
    content: str
    tokens: list[int]
    stop: bool
    id_slot: int
    tokens_predicted: int
    tokens_evaluated: int


class InfillErrorDetail(TypedDict):
    code: int
    message: str
    type: str
    n_prompt_tokens: NotRequired[int]
    n_ctx: NotRequired[int]


class InfillError(TypedDict):
    """Every error of ``/infill``, as llama.cpp words it (``code`` is the HTTP status)."""

    error: InfillErrorDetail


def error_body(error: APIError) -> InfillError:
    """llama.cpp's error shape."""
    kind = {501: "not_supported_error", 503: "unavailable_error"}.get(error.status, error.type)
    if error.status >= 500 and error.status not in (501, 503):
        kind = "server_error"
    return {"error": {"code": error.status, "message": error.message, "type": kind}}


def stop_type(outcome: Outcome | None) -> StopType:
    """llama.cpp's word for how a completion ended."""
    if outcome == FinishReason.EOS:
        return "eos"
    if outcome == FinishReason.STOP:
        return "word"
    if outcome == FinishReason.LENGTH:
        return "limit"
    return "none"


def timings(cached: int, read: int, prompt_s: float, predicted: int, predicted_s: float) -> Timings:
    """llama.cpp's ``timings`` from token counts and seconds."""
    prompt_ms, predicted_ms = prompt_s * 1000, predicted_s * 1000
    return {
        "cache_n": cached,
        "prompt_n": read,
        "prompt_ms": round(prompt_ms, 3),
        "prompt_per_token_ms": round(prompt_ms / read, 3) if read else 0.0,
        "prompt_per_second": round(1000 * read / prompt_ms, 3) if prompt_ms > 0 else 0.0,
        "predicted_n": predicted,
        "predicted_ms": round(predicted_ms, 3),
        "predicted_per_token_ms": round(predicted_ms / predicted, 3) if predicted else 0.0,
        "predicted_per_second": round(1000 * predicted / predicted_ms, 3)
        if predicted_ms > 0
        else 0.0,
    }


def only(body: Mapping[str, Any], paths: Sequence[str]) -> dict[str, Any]:
    """The fields ``paths`` name (``a/b`` a nested one), each under its path; a path that
    names nothing is left out (llama.cpp's ``response_fields``)."""
    picked: dict[str, Any] = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            if not isinstance(value, Mapping) or key not in value:
                break
            value = value[key]
        else:
            picked[path] = value
    return picked
