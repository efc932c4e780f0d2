"""Request bodies, validated by pydantic; unknown fields are refused (422).

Value checks live here so that a bad field is reported under the name the client used
(``max_tokens``, not the engine's ``max_new_tokens``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from infer.engine.sampler import MAX_LOGPROBS, MAX_STOP_STRINGS, MAX_TEMPERATURE

SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextPart(_Body):
    """One part of a message's content list (only text is supported)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string."""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: bool = False


class TraceOptions(_Body):
    """Per-token trace: the ``top_k`` likeliest tokens and, with ``layer``, its attention."""

    layer: Annotated[int, Field(ge=0)] | None = None
    top_k: Annotated[int, Field(ge=1, le=MAX_LOGPROBS)] = 5


Prompt = StrictStr | list[StrictInt]
Stop = str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None


class SamplingFields(_Body):
    """The sampling fields every generation route shares."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    stop: Stop = None
    seed: Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)] | None = None
    ignore_eos: bool = False  # keep generating past EOS (benchmarks; vLLM has it too)
    user: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class _OpenAIFields(SamplingFields):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1)] = 1

    @model_validator(mode="after")
    def _one_choice(self) -> _OpenAIFields:
        if self.n != 1:
            raise ValueError("n > 1 is not supported: send one request per completion")
        return self


class CompletionRequest(_OpenAIFields):
    """``POST /v1/completions``."""

    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class ChatCompletionRequest(_OpenAIFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


class GenerateRequest(SamplingFields):
    """``POST /v1/generate``: the native event stream."""

    prompt: Prompt | None = None
    messages: list[ChatMessage] | None = None
    timeout_s: Annotated[float, Field(gt=0.0)] | None = None
    trace: TraceOptions | None = None
    metrics_every: Annotated[int, Field(ge=1)] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> GenerateRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class InspectRequest(_Body):
    """``POST /v1/inspect/attention``."""

    model: str | None = None
    prompt: Prompt | None = None
    messages: list[ChatMessage] | None = None
    layer: Annotated[int, Field(ge=0)]
    head: Annotated[int, Field(ge=0)]

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> InspectRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self
