"""Request and response bodies as pydantic models.

Requests are validated here and nowhere else: unknown fields are refused (422), and each
value is checked under the name the client used (`max_tokens`, not the engine's
`max_new_tokens`) with the engine's own bounds. Responses are built as plain dicts by
:mod:`infer.api`; their models here document them in `/openapi.json` (and the schemathesis
test checks the answers against them).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from infer.engine.params import (
    MAX_LOGPROBS,
    Bias,
    Logprobs,
    MaxNewTokens,
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

if TYPE_CHECKING:
    from infer.engine.grammar import Grammar

MAX_CHOICES = 16  # n per prompt
MAX_FANOUT = 64  # engine requests per request: prompts times n
MAX_DETOKENIZE = 65536  # token ids per /detokenize


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class TextPart(_Body):
    """One text part of a message's content list."""

    type: Literal["text"]
    text: str


class Prediction(_Body):
    """`prediction`: text the answer is expected to repeat (OpenAI's Predicted Outputs,
    such as the file an edit returns). Drafts are copied from it; the answer is the same
    with or without it, only faster where it matches."""

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class OtherPart(BaseModel):
    """A content part OpenAI defines that a text model cannot take (refused, named)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "refusal"]


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class CalledFunction(_Body):
    name: FunctionName
    arguments: str | dict[str, Any]  # a JSON text, as OpenAI sends it, or the object

    def arguments_object(self) -> dict[str, Any] | str:
        """The arguments as an object when they are a JSON object's text (templates render
        them with `tojson`), else as given."""
        if isinstance(self.arguments, dict):
            return self.arguments
        try:
            value = json.loads(self.arguments)
        except ValueError:
            return self.arguments
        return value if isinstance(value, dict) else self.arguments


class ToolCall(_Body):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart | OtherPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    reasoning_content: str | None = None  # an earlier reply's reasoning: not sent back
    reasoning: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ChatMessage:
        for part in self.content if isinstance(self.content, list) else []:
            if isinstance(part, OtherPart):
                raise ValueError(
                    f"content parts of type {part.type!r} are not supported: "
                    "this server serves a text-only model"
                )
        if self.audio is not None:
            raise ValueError("audio is not supported: this server serves a text-only model")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        """The content as one string."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content if isinstance(part, TextPart))


class StreamOptions(_Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; chunks are never padded here


class TraceOptions(_Body):
    """Per-token trace: the `top_k` likeliest tokens and, with `layer`, its attention."""

    layer: Annotated[int, Field(ge=0)] | None = None
    top_k: Annotated[int, Field(ge=1, le=MAX_LOGPROBS)] = 5


class JSONSchemaFormat(_Body):
    """`response_format.json_schema`: OpenAI's named schema."""

    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    schema_: Annotated[dict[str, Any], Field(alias="schema")] = Field(
        default_factory=lambda: {"type": "object"}
    )
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(_Body):
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


TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Prompt = StrictStr | list[StrictInt]
Prompts = StrictStr | list[StrictStr] | list[StrictInt] | list[TokenIds]
Stop = Annotated[str, Field(min_length=1)] | StopStrings | None


class SamplingFields(_Body):
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

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def json_schema(self) -> dict[str, Any] | None:
        """The schema structured output must follow, or `None`."""
        return self.response_format.schema_or_none() if self.response_format else None

    def limit(self) -> int | None:
        """The client's token limit, if it set one."""
        return self.max_tokens

    def sampling_params(
        self,
        max_new_tokens: int,
        seed: int | None,
        logprobs: int = 0,
        grammar: Grammar | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's parameters for one choice (every value was checked at parsing)."""
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            repetition_penalty=self.repetition_penalty,
            stop=self.stop_list(),
            seed=seed,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=dict(self.logit_bias or {}),
            grammar=grammar,
            prompt_logprobs=prompt_logprobs,
        )

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        """OpenAI clients send `null` for fields they leave at their default."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in _NULLABLE}
        return data


# Fields whose `null` means "the default" (clients such as LangChain send them).
_NULLABLE = frozenset(
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


class _OpenAIFields(SamplingFields):
    """Fields both OpenAI routes take; those with no meaning here are accepted and ignored."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    # Accepted, no effect on a local server (OpenAI's storage, tiers and tracing).
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # What a router in front (SGLang Model Gateway) adds to every body. Only the values
    # that describe what this server does anyway are accepted.
    skip_special_tokens: Literal[True] = True
    spaces_between_special_tokens: Literal[True] = True
    no_stop_trim: Literal[False] = False
    return_hidden_states: Literal[False] = False


class CompletionRequest(_OpenAIFields):
    """`POST /v1/completions`.

    `echo` with `logprobs` scores the prompt: its tokens start each choice's
    `logprobs`. `max_tokens: 0` (with `echo` or `prompt_logprobs`) generates nothing.
    """

    prompt: Prompts
    max_tokens: MaxNewTokens | None = None
    logprobs: Logprobs | None = None
    echo: bool = False
    prompt_logprobs: Logprobs | None = None
    best_of: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _honourable(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of > self.n:
            raise ValueError(
                "best_of > n is not supported: every sampled completion is returned (use n)"
            )
        if self.suffix:
            raise ValueError("suffix is not supported: the models here do not fill in the middle")
        if len(self.prompt_list()) * self.n > MAX_FANOUT:
            raise ValueError(
                f"prompt: at most {MAX_FANOUT} completions per request (prompts times n)"
            )
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise ValueError(
                "max_tokens: 0 is only allowed with echo or prompt_logprobs "
                "(the answer would be empty)"
            )
        return self

    def scored_prompt(self) -> int | None:
        """Alternatives per prompt token the answer shows; `None`: the prompt is not
        scored. (`max_tokens: 0` with a bare `echo` scores it too: the engine runs the
        prompt for its scores only.)"""
        wanted = [k for k in (self.prompt_logprobs, self.echo_logprobs()) if k is not None]
        if not wanted and self.max_tokens == 0:
            return 0
        return max(wanted) if wanted else None

    def echo_logprobs(self) -> int | None:
        """Alternatives per echoed prompt token; `None`: the echo has no logprobs."""
        return self.logprobs if self.echo else None

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, one per group of `n` choices, in order."""
        p = self.prompt
        if isinstance(p, str) or not p:
            return [cast(str | list[int], p)]
        if isinstance(p[0], int):
            return [cast(list[int], p)]
        return list(cast(list[str] | list[list[int]], p))


class FunctionDefinition(_Body):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # calls always fit their schema here

    @model_validator(mode="after")
    def _schema(self) -> FunctionDefinition:
        if self.parameters is not None:
            try:
                jsonschema.validators.validator_for(self.parameters).check_schema(self.parameters)
            except jsonschema.SchemaError as e:
                raise ValueError(
                    f"the parameters of {self.name!r} are not a JSON schema: {e.message}"
                ) from None
        return self


class ToolDefinition(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_OpenAIFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. enable_thinking
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    # Router extras (see _OpenAIFields): the template always opens a new assistant turn;
    # separate_reasoning: false leaves a reasoning block in the content; reasoning streams.
    continue_final_message: Literal[False] = False
    add_generation_prompt: Literal[True] = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    @model_validator(mode="after")
    def _honourable(self) -> ChatCompletionRequest:
        if self.audio is not None or (self.modalities and "audio" in self.modalities):
            raise ValueError("audio output is not supported: this server generates text")
        if self.web_search_options is not None:
            raise ValueError("web_search_options is not supported: this server has no web access")
        if self.functions or self.function_call is not None:
            raise ValueError("functions and function_call are deprecated by OpenAI: use tools")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if self.wants_tools() and self.json_schema() is not None:
            raise ValueError("response_format cannot be combined with tool calls")
        check_tool_results(self.messages)
        return self

    def limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def wants_tools(self) -> bool:
        """Whether the request needs tool calling (`tools` given and not switched off)."""
        return bool(self.tools) and self.tool_choice != "none"


def check_tool_results(messages: list[ChatMessage]) -> None:
    """Every tool message answers a call an earlier assistant message made.

    Raises:
        ValueError: One answers no call (the message says which).
    """
    called: set[str] = set()
    for i, m in enumerate(messages):
        called.update(c.id for c in m.tool_calls or [])
        if m.role == "tool" and m.tool_call_id not in called:
            raise ValueError(
                f"messages.{i}: tool_call_id {m.tool_call_id!r} answers no earlier tool call"
            )


# --- /v1/responses ---------------------------------------------------------------------------


class InputText(_Body):
    """A text part of a Responses message (`output_text` when an earlier output is sent
    back, with its annotations and logprobs)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _joined(content: str | list[InputText]) -> str:
    """A Responses item's text, given as one string or as text parts."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class InputMessage(_Body):
    """A message of a Responses `input` (`type` may be left out)."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(_Body):
    """A call the model made earlier (an output item sent back)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: FunctionName
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Body):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return _joined(self.output)


class ReasoningInputItem(_Body):
    """An earlier reasoning item sent back: accepted, not shown to the model again (as chat
    drops an earlier reply's reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem


class FunctionTool(_Body):
    """A function tool in the Responses shape (the only tool type served here)."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def definition(self) -> FunctionDefinition:
        """The chat route's function definition (checks the parameters' schema)."""
        return FunctionDefinition(
            name=self.name,
            description=self.description,
            parameters=self.parameters,
            strict=self.strict,
        )

    @model_validator(mode="after")
    def _schema(self) -> FunctionTool:
        self.definition()
        return self


class NamedFunctionChoice(_Body):
    """`tool_choice: {"type": "function", "name": ...}`."""

    type: Literal["function"]
    name: FunctionName


class TextFormat(_Body):
    """`text.format`: free text, any JSON object, or JSON that fits a named schema."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] | None = None
    description: str | None = None
    schema_: Annotated[dict[str, Any] | None, Field(alias="schema")] = None
    strict: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if (self.type == "json_schema") != (self.schema_ is not None):
            raise ValueError("schema is required with type json_schema, and only then")
        return self

    def response_format(self) -> ResponseFormat:
        """The chat route's `response_format` for this format."""
        if self.type != "json_schema":
            return ResponseFormat(type=self.type)
        named = JSONSchemaFormat(
            name=self.name or "response",
            description=self.description,
            schema_=self.schema_ or {"type": "object"},
            strict=self.strict,
        )
        return ResponseFormat(type="json_schema", json_schema=named)


class TextConfig(_Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Body):
    """Accepted; the served model reasons as its template lets it, whatever the effort."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Body):
    """`POST /v1/responses`: OpenAI's Responses API (text and function calls)."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    stream: bool = False
    previous_response_id: Annotated[str, Field(min_length=1, max_length=128)] | None = None
    store: bool = True
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] = (
        Field(default_factory=dict)
    )
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    user: str | None = None
    # Accepted, no effect on a local server (OpenAI's tiers, caching and tracing).
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    truncation: Literal["disabled"] | None = None
    background: Literal[False] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if isinstance(data, dict):
            nullable = {"temperature", "top_p", "stream", "store", "metadata"}
            return {k: v for k, v in data.items() if v is not None or k not in nullable}
        return data

    @model_validator(mode="after")
    def _honourable(self) -> ResponsesRequest:
        names = [t.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError("tools: two tools have the same name")
        choice = self.tool_choice
        if isinstance(choice, NamedFunctionChoice) and choice.name not in names:
            raise ValueError(f"tool_choice names {choice.name!r}, which is not in tools")
        if choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        if self.wants_tools() and self.response_format() is not None:
            raise ValueError("text.format json_schema cannot be combined with tool calls")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValueError("input: give at least one item")
        if self.previous_response_id is None:
            check_tool_results(self.messages([]))
        return self

    def wants_tools(self) -> bool:
        """Whether the request needs tool calling (`tools` given and not switched off)."""
        return bool(self.tools) and self.tool_choice != "none"

    def response_format(self) -> ResponseFormat | None:
        """The chat route's `response_format` (`None`: free text)."""
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        return fmt.response_format()

    def sampling_fields(self) -> SamplingFields:
        """The fields admission reads, under the chat route's names."""
        return SamplingFields(
            model=self.model,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            response_format=self.response_format(),
            user=self.user,
        )

    def function_definitions(self) -> list[FunctionDefinition]:
        return [t.definition() for t in self.tools or []]

    def forced_tool(self) -> str | None:
        """The tool `tool_choice` names, if it names one."""
        choice = self.tool_choice
        return choice.name if isinstance(choice, NamedFunctionChoice) else None

    def messages(self, history: Sequence[ChatMessage]) -> list[ChatMessage]:
        """This request's input as chat messages after `history` (an earlier response's
        conversation), without the instructions.

        Calls become the tool calls of an assistant message (joined to the assistant
        message just before them), call outputs tool messages named after their call.
        """
        out = list(history)
        if isinstance(self.input, str):
            return [*out, ChatMessage(role="user", content=self.input)]
        names = {c.id: c.function.name for m in out for c in m.tool_calls or []}
        for item in self.input:
            if isinstance(item, InputMessage):
                out.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallItem):
                names[item.call_id] = item.name
                call = ToolCall(
                    id=item.call_id,
                    function=CalledFunction(name=item.name, arguments=item.arguments),
                )
                last = out[-1] if out else None
                if last is not None and last.role == "assistant":
                    out[-1] = last.model_copy(
                        update={"tool_calls": [*(last.tool_calls or []), call]}
                    )
                else:
                    out.append(ChatMessage(role="assistant", tool_calls=[call]))
            elif isinstance(item, FunctionCallOutputItem):
                out.append(
                    ChatMessage(
                        role="tool",
                        content=item.text(),
                        tool_call_id=item.call_id,
                        name=names.get(item.call_id),
                    )
                )
        return out


class _PromptOrMessages(_Body):
    """A body that takes exactly one of a prompt and a conversation."""

    model: str | None = None
    prompt: Prompt | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one(self) -> _PromptOrMessages:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class GenerateRequest(SamplingFields, _PromptOrMessages):
    """`POST /v1/generate`: the native event stream."""

    request_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9._-]{1,64}$")] | None = None
    timeout_s: Annotated[float, Field(gt=0.0)] | None = None
    trace: TraceOptions | None = None
    metrics_every: Annotated[int, Field(ge=1)] | None = None


class InspectRequest(_PromptOrMessages):
    """`POST /v1/inspect/attention`."""

    layer: Annotated[int, Field(ge=0)]
    head: Annotated[int, Field(ge=0)]


class TokenizeRequest(_PromptOrMessages):
    """`POST /tokenize` (vLLM's shape): a prompt, or messages through the chat template."""

    prompt: StrictStr | None = None
    # rendered with the messages, as a chat request that offers them renders them
    tools: Annotated[list[ToolDefinition], Field(max_length=128)] | None = None
    add_special_tokens: bool = False  # the generation routes add none
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _tools_with_messages(self) -> TokenizeRequest:
        if self.tools and self.messages is None:
            raise ValueError("tools go with messages")
        return self


class DetokenizeRequest(_Body):
    """`POST /detokenize` (vLLM's shape)."""

    model: str | None = None
    tokens: Annotated[list[StrictInt], Field(max_length=MAX_DETOKENIZE)]


# --- response bodies (documentation) --------------------------------------------------------


class StopResponse(BaseModel):
    """`DELETE /v1/generate/{request_id}`: the request was stopped."""

    request_id: str
    stopped: bool


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str


class ErrorResponse(BaseModel):
    """Every error before a stream starts (4xx, 5xx)."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class CompletionTokensDetails(BaseModel):
    accepted_prediction_tokens: int = Field(description="tokens of the prediction the answer kept")
    rejected_prediction_tokens: int = Field(
        description="tokens of the prediction that were tried and not kept"
    )


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails | None = Field(
        None, description="with a `prediction`: how much of it the answer used"
    )


class PromptTokenLogprob(BaseModel):
    """One token of vLLM's `prompt_logprobs` entries (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = Field(
        None, description="with prompt_logprobs: null for the first prompt token, then each's"
    )


class CompletionResponse(BaseModel):
    """`POST /v1/completions` with `stream: false`."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class OutputCall(BaseModel):
    id: str
    type: Literal["function"]
    function: dict[str, str]  # name, and arguments: a JSON text that fits the tool's schema


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # null when the reply is only tool calls
    tool_calls: list[OutputCall] | None = None
    reasoning_content: str | None = None  # a thinking template's reasoning block
    reasoning: str | None = None  # the same text, under vLLM's newer name


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | None = Field(
        None, description="with prompt_logprobs: null for the first prompt token, then each's"
    )


class ChatCompletionResponse(BaseModel):
    """`POST /v1/chat/completions` with `stream: false`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None  # None while the model loads (its context decides it)


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class Health(BaseModel):
    status: str
    model: str
    running: int
    waiting: int


class AttentionResponse(BaseModel):
    """`POST /v1/inspect/attention`."""

    layer: int
    head: int
    tokens: list[str]
    attn: list[list[float]]


class ResponseUsageInput(BaseModel):
    cached_tokens: int = Field(description="input tokens served from the prefix cache")


class ResponseUsageOutput(BaseModel):
    reasoning_tokens: int


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponseUsageInput
    output_tokens: int
    output_tokens_details: ResponseUsageOutput
    total_tokens: int


class ResponseOutputItem(BaseModel):
    """A `message` (`role`, `content`: output_text parts), `function_call`
    (`call_id`, `name`, `arguments`) or `reasoning` (`summary`, `content`) item."""

    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["message", "function_call", "reasoning"]
    status: Literal["in_progress", "completed", "incomplete"]


class ResponseObject(BaseModel):
    """`POST /v1/responses` with `stream: false` (streamed: the same object ends the
    `response.completed`/`response.incomplete`/`response.failed` event)."""

    model_config = ConfigDict(extra="allow")  # the echoed request fields
    id: str
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "failed", "in_progress"]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    model: str
    output: list[ResponseOutputItem]
    usage: ResponseUsage | None
    previous_response_id: str | None
