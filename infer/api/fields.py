"""The request fields several protocols share, written once: the sampling fields, structured
output's ``response_format``, and a ``prediction``.

Requests are validated by their models and nowhere else: unknown fields are refused (422),
and each value is checked under the name the client used (``max_tokens``, not the engine's
``max_new_tokens``) with the engine's own bounds (the types of :mod:`infer.engine.params`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from infer.api.engine_request import EngineRequest, Prompt
from infer.api.tools import ToolChoice
from infer.engine.params import (
    Bias,
    MaxTokens,
    Penalty,
    RepetitionPenalty,
    SamplingParams,
    Seed,
    StopStrings,
    Temperature,
    TokenId,
    TopK,
    TopP,
)
from infer.engine.request import TraceSpec


class Body(BaseModel):
    """A request body or a part of one: unknown fields refused, no NaN or infinity."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextPart(Body):
    """One text part of a message's content list."""

    type: Literal["text"]
    text: str


class Prediction(Body):
    """`prediction`: text the answer is expected to repeat (OpenAI's Predicted Outputs,
    such as the file an edit returns). Drafts are copied from it; the answer is the same
    with or without it, only faster where it matches."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class JSONSchemaFormat(Body):
    """`response_format.json_schema`: OpenAI's named schema."""

    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = Field(
        default_factory=lambda: {"type": "object"}
    )
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(Body):
    """`{"type": "text"}`, `{"type": "json_object"}` or `{"type": "json_schema", ...}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self

    def schema_or_none(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow; `None` for free text."""
        if self.type == "json_object":
            return {"type": "object"}
        return self.json_schema.schema_ if self.json_schema is not None else None


Stop = Annotated[str, Field(min_length=1)] | StopStrings | None


class SamplingFields(Body):
    """The sampling fields every generation route shares."""

    model: str | None = None
    max_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    repetition_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[TokenId, Bias] | None = None
    stop: Stop = None
    seed: Seed | None = None
    ignore_eos: bool = False  # keep generating past EOS (benchmarks; vLLM has it too)
    response_format: ResponseFormat | None = None
    prediction: Prediction | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _format_ends(self) -> SamplingFields:
        if self.ignore_eos and self.json_schema() is not None:
            raise ValueError("ignore_eos cannot be combined with a JSON response_format")
        return self

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        """OpenAI clients send `null` for fields they leave at their default."""
        return without_nulls(data, NULLABLE)

    def json_schema(self) -> dict[str, Any] | None:
        """The schema structured output must follow, or `None`."""
        return self.response_format.schema_or_none() if self.response_format else None

    def limit(self) -> int | None:
        """The client's token limit, if it set one."""
        return self.max_tokens

    def sampling_request(
        self,
        prompts: Sequence[Prompt],
        *,
        default_max_tokens: int,
        n: int = 1,
        logprobs: int = 0,
        prompt_logprobs: int | None = None,
        tools: ToolChoice | None = None,
        trace: TraceSpec | None = None,
        timeout_s: float | None = None,
    ) -> EngineRequest:
        """The engine request these fields ask for (every value was checked at parsing)."""
        params = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            repetition_penalty=self.repetition_penalty,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            seed=self.seed,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=dict(self.logit_bias or {}),
            prompt_logprobs=prompt_logprobs,
        )
        return EngineRequest(
            prompts,
            params,
            max_tokens=self.limit(),
            default_max_tokens=default_max_tokens,
            model=self.model,
            n=n,
            tools=tools,
            json_schema=self.json_schema(),
            prediction=self.prediction.text() if self.prediction is not None else None,
            trace=trace,
            timeout_s=timeout_s,
        )


# Fields whose `null` means "the default" (clients such as LangChain send them).
NULLABLE = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "n",
        "stream",
        "echo",
        "logprobs",
        "ignore_eos",
    }
)


def without_nulls(data: Any, nullable: frozenset[str]) -> Any:
    """A body without the ``null`` values of the fields in ``nullable`` (their default
    applies)."""
    if isinstance(data, dict):
        return {k: v for k, v in data.items() if v is not None or k not in nullable}
    return data
