"""A request's state as the engine sees it, and what one step reports back for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Any

import torch

from infer.engine.detokenizer import IncrementalDetokenizer
from infer.engine.params import SamplingParams
from infer.engine.speculative import DraftState

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


class Failure(StrEnum):
    """How a request ended without finishing: stopped by its caller, who says why, or
    failed in the engine. What a client sees for each is the server's business."""

    CANCELLED = "cancelled"  # its caller stopped it (a client left, a shutdown)
    TIMEOUT = "timeout"  # it reached its time limit
    OVERLOADED = "overloaded"  # its reader fell too far behind
    OUT_OF_MEMORY = "out_of_memory"
    INFERENCE_FAILED = "inference_failed"


Outcome = FinishReason | Failure


class Refusal(StrEnum):
    """Why a prompt or a request cannot be taken (:class:`RequestError`)."""

    EMPTY_PROMPT = "empty_prompt"
    PROMPT_TOO_LARGE = "prompt_too_large"
    INVALID_VALUE = "invalid_value"  # token ids outside the vocabulary, a missing layer
    INVALID_MESSAGES = "invalid_messages"  # the chat template refused them
    NO_CHAT_TEMPLATE = "no_chat_template"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class RequestError(ValueError):
    """A request the engine cannot take; ``reason`` says why, the message says how."""

    def __init__(self, reason: Refusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason


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
    trace: TraceSpec | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    outcome: Outcome | None = None  # set once it has finished
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    text_len: int = 0  # characters of text sent so far
    num_cached: int = 0  # tokens of this request already in the KV cache
    prefill_len: int = 0  # tokens to prefill before decoding (prompt + output if preempted)
    grammar_state: GrammarState | None = None  # structured output: set on its first step
    cached_tokens: int | None = None  # prompt tokens the prefix cache gave it when it started
    # Prompt tokens 1... scored so far (prompt_logprobs); the first token has no score.
    prompt_scores: list[PromptLogprob] = field(default_factory=list)
    prompt_reported: bool = False  # its scores went out with an output
    drafts: DraftState = field(default_factory=DraftState)  # speculative decoding
    draft: list[int] = field(default_factory=list)  # the draft tokens this step verifies
    model_draft: int = 0  # draft tokens the draft model is to write this step
    first_token_at: float | None = None  # the engine clock when its first token came
    heal_left: str = ""  # what of params.healing the output has not spelled yet

    @property
    def scores_prompt(self) -> bool:
        """Whether the request's prompt tokens are to be scored (``prompt_logprobs``)."""
        return self.params.prompt_logprobs is not None

    @property
    def unscored(self) -> int:
        """The first position whose logits still have a prompt token to score."""
        return len(self.prompt_scores) if self.scores_prompt else self.prompt_len

    @property
    def room(self) -> int:
        """Tokens it may still generate."""
        return self.params.max_new_tokens - len(self.output_ids)

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

    def finish(self, status: RequestStatus, outcome: Outcome) -> None:
        self.status, self.outcome = status, outcome


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
    outcome: Outcome | None = None  # set on the last output only
    message: str | None = None  # an error's client-safe detail (else the code's message)
    stop: str | None = None  # the stop string that ended it (outcome STOP)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_tokens: int = 0  # tokens this output stands for
    text_offset: int = 0  # characters of the request's text before this delta
    logprobs: Logprobs | None = None
    trace: dict[str, Any] | None = None
    # On a request's first output, when it scores its prompt: tokens 1... (token 0 has none).
    prompt_logprobs: list[PromptLogprob] | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    drafted: bool = False  # its token was a draft token the model agreed with
    # Of the request's prediction so far: tokens the answer kept, and tokens drafted but not.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.outcome is not None
