"""The native event stream of ``/v1/generate``, built from a request's outputs, and the
bodies of infer's other routes (their types are what ``/openapi.json`` documents).

``started`` → (``token`` [``trace``])* with ``metrics`` every N tokens → exactly one of
``done`` or ``error``. Output coalesced for a slow reader arrives as one ``token`` event
carrying several tokens' text (``count`` > 1, ``i`` the index of the last one).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, NotRequired

from typing_extensions import TypedDict

from infer.api.usage import Usage
from infer.engine.request import FinishReason, StepOutput

Event = tuple[dict[str, Any], str]  # payload, event name


class StopResponse(TypedDict):
    """`DELETE /v1/generate/{request_id}`: the request was stopped."""

    request_id: str
    stopped: bool


class AttentionResponse(TypedDict):
    """`POST /v1/inspect/attention`."""

    layer: int
    head: int
    tokens: list[str]
    attn: list[list[float]]


class TokenizeResponse(TypedDict):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: NotRequired[list[str]]


class DetokenizeResponse(TypedDict):
    prompt: str


def started(request_id: str, model: str, created: int) -> Event:
    """The first event of a stream."""
    return {
        "id": request_id,
        "model": model,
        "created": datetime.fromtimestamp(created, UTC).isoformat(),
    }, "started"


def events(out: StepOutput, rate: dict[str, Any] | None = None) -> list[Event]:
    """The events of one output, before the terminal one (:func:`done`, :func:`error`).

    Args:
        out: The output.
        rate: A :func:`metrics` payload to send after the token (when one is due).
    """
    result: list[Event] = []
    i = out.completion_tokens - 1
    if out.num_tokens or out.text_delta:
        token: dict[str, Any] = {"i": i, "token": out.text_delta, "token_id": out.token_id}
        if out.num_tokens > 1:
            token["count"] = out.num_tokens
        result.append((token, "token"))
    if out.trace is not None:
        result.append(({"i": i, **out.trace}, "trace"))
    if rate is not None:
        result.append((rate, "metrics"))
    return result


def metrics_due(out: StepOutput, every: int | None) -> bool:
    """Whether this output's tokens passed a multiple of ``every``."""
    tokens = out.completion_tokens
    return bool(every and out.num_tokens and tokens // every > (tokens - out.num_tokens) // every)


def done(reason: FinishReason, usage: Usage) -> Event:
    """The terminal event of a request that finished."""
    return {"finish_reason": reason.value, "usage": usage}, "done"


def error(name: str, message: str, retryable: bool, usage: Usage | None) -> Event:
    """The terminal event of a request that failed (``usage``: what it had made, if known)."""
    payload: dict[str, Any] = {"code": name, "message": message, "retryable": retryable}
    if usage is not None:
        payload["usage"] = usage
    return payload, "error"


def metrics(
    tokens: int, arrival: float, first_token_at: float | None, now: float
) -> dict[str, Any]:
    """A ``metrics`` payload: tokens so far, decode rate, time to first token."""
    first = first_token_at if first_token_at is not None else now
    decode_s = now - first
    rate = (tokens - 1) / decode_s if tokens > 1 and decode_s > 0 else 0.0
    return {
        "tokens": tokens,
        "tokens_per_sec": round(rate, 3),
        "ttft_ms": round((first - arrival) * 1000, 3),
    }
