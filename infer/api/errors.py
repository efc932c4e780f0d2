"""Every error a client can see: one table, :class:`ErrorCode`, and :class:`APIError`.

The engine reports its own outcomes (:class:`~infer.engine.request.Failure`,
:class:`~infer.engine.request.Refusal`); here each, and every refusal at the HTTP edge, gets
its stable wire code, HTTP status, error type, retryability and message. How an error reads
on the wire is its protocol's: each package under :mod:`infer.api` has its error-body
builder (OpenAI's ``{"error": {"message", "type", "code"}}``), and the server's edge answers
a request in the shape of the protocol it called.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from typing_extensions import TypedDict

from infer.engine.request import Failure, Refusal

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}
RETRY_AFTER_S = "1"  # what a retryable 503 asks a client to wait


class ErrorCode(StrEnum):
    """Each member is its stable wire code (JSON error bodies carry the value, native stream
    events the name), its HTTP status, whether a retry may succeed (retryable 503s carry
    ``Retry-After``), and the message it carries unless a more specific one is given."""

    status: int
    retryable: bool
    message: str

    def __new__(cls, value: str, status: int, retryable: bool, message: str) -> ErrorCode:
        member = str.__new__(cls, value)
        member._value_ = value
        member.status, member.retryable, member.message = status, retryable, message
        return member

    # How a request that had started ends (the engine's failures, and the server's own).
    CANCELLED = "cancelled", 503, True, "the request was cancelled (the server is shutting down)"
    TIMEOUT = "timeout", 504, False, "the request reached its time limit"
    OUT_OF_MEMORY = "out_of_memory", 503, True, "out of memory; retry later"
    INFERENCE_FAILED = "inference_failed", 500, False, "inference failed"
    OVERLOADED = "overloaded", 503, True, "the server is overloaded; retry shortly"
    SUPERSEDED = "superseded", 409, False, "another connection resumed this request"
    STOPPED = "stopped", 409, False, "the client stopped the request"
    # Refusals before a request starts (the engine's refusals among them).
    INVALID_JSON = "invalid_json", 400, False, "malformed JSON body"
    EMPTY_PROMPT = "empty_prompt", 400, False, "prompt is empty"
    INVALID_LAST_EVENT_ID = "invalid_last_event_id", 400, False, "Last-Event-ID is not an event id"
    INVALID_API_KEY = "invalid_api_key", 401, False, "send a valid key: Authorization: Bearer <key>"
    ORIGIN_NOT_ALLOWED = "origin_not_allowed", 403, False, "this origin is not allowed"
    NOT_FOUND = "not_found", 404, False, "no such route"
    RESPONSE_NOT_FOUND = "response_not_found", 404, False, "no such stored response"
    REQUEST_NOT_FOUND = "request_not_found", 404, False, "no such resumable request"
    INVALID_REQUEST = "invalid_request", 400, False, "the request is invalid"
    # 400 as OpenAI answers it: clients that shorten and retry look for this status and code.
    CONTEXT_LENGTH_EXCEEDED = (
        "context_length_exceeded",
        400,
        False,
        "prompt + max_tokens exceed the max sequence length (--max-seq-len)",
    )
    METHOD_NOT_ALLOWED = "method_not_allowed", 405, False, "method not allowed"
    REQUEST_TIMEOUT = "request_timeout", 408, False, "the request took too long to arrive"
    REQUEST_ID_CONFLICT = "request_id_conflict", 409, False, "this request_id is in use"
    BODY_TOO_LARGE = "body_too_large", 413, False, "the request body is too large"
    PROMPT_TOO_LARGE = "prompt_too_large", 413, False, "the prompt is too large"
    INVALID_VALUE = "invalid_value", 422, False, "a field has an invalid value"
    INVALID_MESSAGES = "invalid_messages", 422, False, "the chat template refused the messages"
    INVALID_SCHEMA = "invalid_schema", 422, False, "the JSON schema cannot be compiled"
    NO_CHAT_TEMPLATE = "no_chat_template", 422, False, "the model has no chat template"
    FIM_NOT_SUPPORTED = (
        "fim_not_supported",
        400,
        False,
        "the model has no fill-in-the-middle tokens: it does not fill in the middle",
    )
    MODEL_NOT_FOUND = "model_not_found", 422, False, "that model is not served here"
    WRONG_MODEL_KIND = (
        "wrong_model_kind",
        400,
        False,
        "the model cannot serve this route (an embedding model generates no text)",
    )
    MODEL_LOAD_FAILED = "model_load_failed", 500, False, "the model failed to load"
    RATE_LIMITED = "rate_limited", 429, True, "rate limit exceeded"
    INTERNAL_ERROR = "internal_error", 500, False, "internal server error"
    QUEUE_FULL = "queue_full", 503, True, "the server is busy; retry shortly"
    NOT_READY = "not_ready", 503, True, "the model is still loading"
    SHUTTING_DOWN = "shutting_down", 503, True, "the server is shutting down"

    @classmethod
    def of(cls, outcome: Failure | Refusal) -> ErrorCode:
        """The code of an engine outcome (each has the same wire value)."""
        return cls[outcome.name]

    @property
    def finish_reason(self) -> str:
        """What a request that ends this way counts as in ``infer_requests_total``."""
        if self in (ErrorCode.CANCELLED, ErrorCode.STOPPED):
            return "abort"
        return "length" if self is ErrorCode.TIMEOUT else "error"


class APIError(Exception):
    """An error answered with a stable code, in the shape of the caller's protocol.

    Args:
        code: What went wrong; it gives the status, and the message unless one is given.
        message: A more specific message, for people (never an exception's own text).
        headers: Extra response headers (``Retry-After`` for a retryable 503 is added).
        status: Only for HTTP errors that no code names (a malformed request line).
    """

    def __init__(
        self,
        code: ErrorCode,
        message: str | None = None,
        headers: Mapping[str, str] | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message or code.message)
        self.code = code
        self.message = message or code.message
        self.status = status or code.status
        self.headers = dict(headers or {})
        if code.retryable and self.status == 503:
            self.headers.setdefault("Retry-After", RETRY_AFTER_S)

    @property
    def type(self) -> str:
        """The error's type, by its status (OpenAI's names)."""
        default = "server_error" if self.status >= 500 else "invalid_request_error"
        return ERROR_TYPES.get(self.status, default)


class ErrorDetail(TypedDict):
    message: str
    type: str
    code: str


class ErrorResponse(TypedDict):
    """Every error before a stream starts (4xx, 5xx)."""

    error: ErrorDetail


def error_body(error: APIError) -> ErrorResponse:
    """The error body of OpenAI's routes and infer's own: ``{"error": {"message", "type",
    "code"}}`` (also what an OpenAI stream's error chunk carries)."""
    return {"error": {"message": error.message, "type": error.type, "code": error.code.value}}
