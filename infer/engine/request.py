"""A request's state as the engine sees it, and what one step reports back for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Any

import torch

from infer.engine.detokenizer import IncrementalDetokenizer
from infer.engine.params import SamplingParams

if TYPE_CHECKING:
    from infer.engine.grammar import GrammarState


class RequestStatus(IntEnum):
    """Lifecycle; the order means something: everything from FINISHED on is final."""

    WAITING = 0
    PREFILL = 1
    DECODE = 2
    FINISHED = 3
    FAILED = 4
    ABORTED = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED


class FinishReason(StrEnum):
    """How a request ended normally."""

    STOP = "stop"  # a stop string matched
    EOS = "eos"  # the model produced an end-of-sequence token
    LENGTH = "length"  # max_new_tokens reached


class ErrorCode(StrEnum):
    """Every error a client can see, and how it is answered: one place for all of them.

    Each member is its stable wire code (JSON error bodies carry the value, native stream
    events the name), its HTTP status, whether a retry may succeed (retryable 503s carry
    ``Retry-After``), and the message it carries unless a more specific one is given. A
    request that fails after it started ends with one of these instead of a
    :class:`FinishReason`; the ones before that are refusals at the HTTP edge.
    """

    status: int
    retryable: bool
    message: str

    def __new__(cls, value: str, status: int, retryable: bool, message: str) -> ErrorCode:
        member = str.__new__(cls, value)
        member._value_ = value
        member.status, member.retryable, member.message = status, retryable, message
        return member

    # The end of a request that had started.
    CANCELLED = "cancelled", 503, True, "the request was cancelled (the server is shutting down)"
    TIMEOUT = "timeout", 504, False, "the request reached its time limit"
    OUT_OF_MEMORY = "out_of_memory", 503, True, "out of memory; retry later"
    INFERENCE_FAILED = "inference_failed", 500, False, "inference failed"
    INVALID_REQUEST = "invalid_request", 422, False, "the engine refused the request"
    OVERLOADED = "overloaded", 503, True, "the server is overloaded; retry shortly"
    SUPERSEDED = "superseded", 409, False, "another connection resumed this request"
    STOPPED = "stopped", 409, False, "the client stopped the request"
    # Refusals before a request starts.
    INVALID_JSON = "invalid_json", 400, False, "malformed JSON body"
    EMPTY_PROMPT = "empty_prompt", 400, False, "prompt is empty"
    INVALID_LAST_EVENT_ID = (
        "invalid_last_event_id",
        400,
        False,
        "Last-Event-ID must be an event id (an integer >= 0)",
    )
    INVALID_API_KEY = (
        "invalid_api_key",
        401,
        False,
        "a valid API key is required (Authorization: Bearer <key>)",
    )
    ORIGIN_NOT_ALLOWED = "origin_not_allowed", 403, False, "this origin is not allowed"
    NOT_FOUND = "not_found", 404, False, "no such route"
    RESPONSE_NOT_FOUND = (
        "response_not_found",
        404,
        False,
        "previous_response_id names no stored response (unknown, expired or not stored)",
    )
    REQUEST_NOT_FOUND = (
        "request_not_found",
        404,
        False,
        "request_id names no resumable request (unknown, or forgotten after its window)",
    )
    METHOD_NOT_ALLOWED = "method_not_allowed", 405, False, "method not allowed"
    REQUEST_TIMEOUT = "request_timeout", 408, False, "the request took too long to arrive"
    REQUEST_ID_CONFLICT = (
        "request_id_conflict",
        409,
        False,
        "this request_id is in use by another request",
    )
    BODY_TOO_LARGE = "body_too_large", 413, False, "the request body is too large"
    PROMPT_TOO_LARGE = "prompt_too_large", 413, False, "the prompt is too large"
    INVALID_VALUE = "invalid_value", 422, False, "a field has an invalid value"
    INVALID_MESSAGES = "invalid_messages", 422, False, "the chat template refused the messages"
    INVALID_SCHEMA = "invalid_schema", 422, False, "the JSON schema cannot be compiled"
    NO_CHAT_TEMPLATE = "no_chat_template", 422, False, "the model has no chat template"
    CONTEXT_LENGTH_EXCEEDED = (
        "context_length_exceeded",
        422,
        False,
        "prompt + max_tokens exceed the context length",
    )
    MODEL_NOT_FOUND = "model_not_found", 422, False, "that model is not served here"
    RATE_LIMITED = "rate_limited", 429, True, "rate limit exceeded"
    INTERNAL_ERROR = "internal_error", 500, False, "internal server error"
    QUEUE_FULL = "queue_full", 503, True, "the server is busy; retry shortly"
    NOT_READY = "not_ready", 503, True, "the model is still loading"
    SHUTTING_DOWN = "shutting_down", 503, True, "the server is shutting down"

    @property
    def finish_reason(self) -> str:
        """What a request that ends this way counts as in ``infer_requests_total``, and, for a
        timeout, the ``finish_reason`` an OpenAI response reports instead of an error."""
        if self in (ErrorCode.CANCELLED, ErrorCode.STOPPED):
            return "abort"
        return "length" if self is ErrorCode.TIMEOUT else "error"


@dataclass
class TraceSpec:
    """Per-token trace wanted by the client: top-k alternatives and one layer's attention."""

    top_k: int = 5
    layer: int | None = None


@dataclass(eq=False)
class Request:
    """One generation request, owned by the engine thread (compared by identity)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    trace: TraceSpec | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    outcome: FinishReason | ErrorCode | None = None  # set once it has finished
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    text_len: int = 0  # characters of text sent so far
    num_cached: int = 0  # tokens of this request already in the KV cache
    prefill_len: int = 0  # tokens to prefill before decoding (prompt + output if preempted)
    first_token_time: float | None = None
    finish_time: float | None = None
    grammar_state: GrammarState | None = None  # structured output: set on its first step
    cached_tokens: int | None = None  # prompt tokens the prefix cache gave it when it started
    # Prompt tokens 1... scored so far (prompt_logprobs); the first token has no score.
    prompt_scores: list[PromptLogprob] = field(default_factory=list)
    prompt_reported: bool = False  # its scores went out with an output

    @property
    def scores_prompt(self) -> bool:
        """Whether the request's prompt tokens are to be scored (``prompt_logprobs``)."""
        return self.params.prompt_logprobs is not None

    @property
    def unscored(self) -> int:
        """The first position whose logits still have a prompt token to score."""
        return len(self.prompt_scores) if self.scores_prompt else self.prompt_len

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt and output ids: the sequence the KV cache holds."""
        return self.prompt_ids + self.output_ids

    @property
    def history(self) -> list[int]:
        """Prompt and output ids (what the repetition penalty looks at)."""
        return self.token_ids

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def finish(self, status: RequestStatus, outcome: FinishReason | ErrorCode) -> None:
        self.status, self.outcome = status, outcome
        self.finish_time = time.monotonic()


@dataclass
class Logprobs:
    """A generated token's log-probability and its likeliest alternatives, with their text."""

    token: str
    logprob: float
    top: list[tuple[str, float]]  # most likely first


@dataclass
class PromptLogprob:
    """One prompt token's log-probability given the tokens before it, its rank among the
    whole vocabulary (1: the likeliest), and the likeliest tokens at its position."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass
class StepOutput:
    """What one step produced for one request: a token, or the end, or both.

    Outputs a slow reader has not taken yet may be merged into one (see the server's
    stream); ``num_tokens`` then counts the tokens it stands for.
    """

    request_id: str
    token_id: int | None
    text_delta: str
    outcome: FinishReason | ErrorCode | None = None  # set on the last output only
    message: str | None = None  # an error's client-safe detail (else the code's message)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_tokens: int = 0  # tokens this output stands for
    text_offset: int = 0  # characters of the request's text before this delta
    logprobs: Logprobs | None = None
    trace: dict[str, Any] | None = None
    # On a request's first output, when it scores its prompt: tokens 1... (token 0 has none).
    prompt_logprobs: list[PromptLogprob] | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return self.outcome is not None
