"""A request's state as the engine sees it, and what one step reports back for it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import IntEnum, StrEnum
from typing import TYPE_CHECKING, Any

import torch

from infer.engine.detokenizer import IncrementalDetokenizer
from infer.engine.sampler import SamplingParams

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
    STOP = "stop"  # a stop string matched
    EOS = "eos"  # the model produced an end-of-sequence token
    LENGTH = "length"  # max_new_tokens (or the server's time limit) reached
    ABORT = "abort"  # the client went away or the server cancelled it
    ERROR = "error"  # the forward failed


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
    finish_reason: FinishReason | None = None
    error: str | None = None
    error_code: str | None = None
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    num_cached: int = 0  # tokens of this request already in the KV cache
    prefill_len: int = 0  # tokens to prefill before decoding (prompt + output if preempted)
    first_token_time: float | None = None
    finish_time: float | None = None
    grammar_state: GrammarState | None = None  # structured output: set on its first step

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


    def finish(
        self,
        status: RequestStatus,
        reason: FinishReason,
        error: str | None = None,
        error_code: str | None = None,
    ) -> None:
        self.status, self.finish_reason = status, reason
        self.error, self.error_code = error, error_code
        self.finish_time = time.monotonic()


@dataclass
class StepOutput:
    """What one step produced for one request (a token, or the end, or both)."""

    request_id: str
    token_id: int | None
    text_delta: str
    finished: bool
    finish_reason: str | None = None
    error: str | None = None
    error_code: str | None = None  # OUT_OF_MEMORY, INFERENCE_FAILED, ...
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    trace: dict[str, Any] | None = None
