"""The bodies of infer's own routes (``/v1/generate``, attention inspection, vLLM's
``/tokenize`` and ``/detokenize``), and what a generation becomes: the engine request
(:meth:`GenerateRequest.engine_request`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictInt, StrictStr, model_validator

from infer.api.engine_request import EngineRequest, Prompt
from infer.api.fields import Body, SamplingFields
from infer.api.messages import ChatMessage, Tools, tool_choice
from infer.api.tools import ToolChoice
from infer.engine.params import DEFAULT_MAX_TOKENS, MAX_LOGPROBS
from infer.engine.request import TraceSpec

MAX_DETOKENIZE = 65536  # token ids per /detokenize

PromptField = StrictStr | list[StrictInt]


class TraceOptions(Body):
    """Per-token trace: the `top_k` likeliest tokens and, with `layer`, its attention."""

    layer: Annotated[int, Field(ge=0)] | None = None
    top_k: Annotated[int, Field(ge=1, le=MAX_LOGPROBS)] = 5


class PromptOrMessages(Body):
    """A body that takes exactly one of a prompt and a conversation."""

    model: str | None = None
    prompt: PromptField | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one(self) -> PromptOrMessages:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self

    def as_prompt(self) -> Prompt:
        return Prompt(self.prompt, self.messages)


class GenerateRequest(SamplingFields, PromptOrMessages):
    """`POST /v1/generate`: the native event stream."""

    request_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")] | None = None
    timeout_s: Annotated[float, Field(gt=0.0)] | None = None
    trace: TraceOptions | None = None
    metrics_every: Annotated[int, Field(ge=1)] | None = None

    def engine_request(self) -> EngineRequest:
        """One completion of the prompt, with its traces and time limit."""
        trace = TraceSpec(self.trace.top_k, self.trace.layer) if self.trace else None
        return self.sampling_request(
            [self.as_prompt()],
            default_max_tokens=DEFAULT_MAX_TOKENS,
            trace=trace,
            timeout_s=self.timeout_s,
        )


class InspectRequest(PromptOrMessages):
    """`POST /v1/inspect/attention`."""

    layer: Annotated[int, Field(ge=0)]
    head: Annotated[int, Field(ge=0)]


class TokenizeRequest(PromptOrMessages):
    """`POST /tokenize` (vLLM's shape): a prompt, or messages through the chat template."""

    prompt: StrictStr | None = None
    # rendered with the messages, as a chat request that offers them renders them
    tools: Tools | None = None
    add_special_tokens: bool = False  # the generation routes add none
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _tools_with_messages(self) -> TokenizeRequest:
        if self.tools and self.messages is None:
            raise ValueError("tools go with messages")
        return self

    def tool_choice(self) -> ToolChoice | None:
        """The tools the template renders with the messages."""
        if not self.tools:
            return None
        return tool_choice([t.function.tool() for t in self.tools], "auto", None, None)


class DetokenizeRequest(Body):
    """`POST /detokenize` (vLLM's shape)."""

    model: str | None = None
    tokens: Annotated[list[StrictInt], Field(max_length=MAX_DETOKENIZE)]
