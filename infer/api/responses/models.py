"""The body of OpenAI's ``/v1/responses`` (text and function calls), and what it becomes: a
chat conversation (:meth:`ResponsesRequest.conversation`, after the stored one it
continues) and the engine request for it (:meth:`ResponsesRequest.engine_request`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from infer.api.engine_request import EngineRequest, Prompt
from infer.api.errors import APIError, ErrorCode
from infer.api.fields import Body, without_nulls
from infer.api.messages import (
    MAX_TOOLS,
    CalledFunction,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    ToolCall,
    check_tool_results,
    check_tools,
    tool_choice,
)
from infer.engine.params import DEFAULT_MAX_TOKENS, MaxTokens, SamplingParams, Temperature, TopP


class InputText(Body):
    """A text part of a Responses message (`output_text` when an earlier output is sent
    back, with its annotations and logprobs)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


def _joined(content: str | list[InputText]) -> str:
    """A Responses item's text, given as one string or as text parts."""
    return content if isinstance(content, str) else "".join(part.text for part in content)


class InputMessage(Body):
    """A message of a Responses `input` (`type` may be left out)."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None
    phase: str | None = None

    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(Body):
    """A call the model made earlier (an output item sent back)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: FunctionName
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Body):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[InputText]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        return _joined(self.output)


class ReasoningInputItem(Body):
    """An earlier reasoning item sent back: accepted, not shown to the model again (as chat
    drops an earlier reply's reasoning)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


InputItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningInputItem


class FunctionTool(FunctionDefinition):
    """A function tool in the Responses shape (the only tool type served here): the chat
    route's function definition and its `type`."""

    type: Literal["function"]


class NamedFunctionChoice(Body):
    """`tool_choice: {"type": "function", "name": ...}`."""

    type: Literal["function"]
    name: FunctionName


class TextFormat(Body):
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

    def json_schema(self) -> dict[str, Any] | None:
        """The schema the output must follow; `None` for free text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "object"}
        return self.schema_ or {"type": "object"}


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Body):
    """Accepted; the served model reasons as its template lets it, whatever the effort."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


History = Callable[[str], Sequence[ChatMessage] | None]


class ResponsesRequest(Body):
    """`POST /v1/responses`: OpenAI's Responses API (text and function calls)."""

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: MaxTokens | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
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
        return without_nulls(data, NULLABLE)

    @model_validator(mode="after")
    def _honourable(self) -> ResponsesRequest:
        names = [t.name for t in self.tools or []]
        json_format = "text.format json_schema" if self.json_schema() is not None else None
        check_tools(names, self._choice(), self._forced(), json_format)
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise ValueError("input: give at least one item")
        if self.previous_response_id is None:
            check_tool_results(self.messages([]))
        return self

    def json_schema(self) -> dict[str, Any] | None:
        """The schema `text.format` asks the output to follow; `None`: free text."""
        fmt = self.text.format if self.text is not None else None
        return fmt.json_schema() if fmt is not None else None

    def conversation(self, stored: History) -> list[ChatMessage]:
        """The conversation this request continues (the one `previous_response_id` names,
        as ``stored`` finds it) and its input, without the instructions.

        Raises:
            APIError: The stored response is not found, or a call output answers no call.
        """
        history: Sequence[ChatMessage] = ()
        if self.previous_response_id is not None:
            found = stored(self.previous_response_id)
            if found is None:
                raise APIError(
                    ErrorCode.RESPONSE_NOT_FOUND,
                    f"previous_response_id {self.previous_response_id!r} names no stored "
                    "response (unknown, expired, or stored with store: false)",
                )
            history = found
        conversation = self.messages(history)
        try:
            check_tool_results(conversation)
        except ValueError as e:
            raise APIError(ErrorCode.INVALID_VALUE, f"input: {e}") from None
        return conversation

    def engine_request(self, conversation: Sequence[ChatMessage]) -> EngineRequest:
        """One reply to the instructions and the conversation, with the request's tools."""
        system = (
            [ChatMessage(role="system", content=self.instructions)] if self.instructions else []
        )
        tools = None
        if self.tools and self.tool_choice != "none":
            offered = [t.tool() for t in self.tools]
            choice, forced, parallel = self._choice(), self._forced(), self.parallel_tool_calls
            tools = tool_choice(offered, choice, forced, parallel)
        return EngineRequest(
            [Prompt(messages=[*system, *conversation])],
            SamplingParams(temperature=self.temperature, top_p=self.top_p),
            max_tokens=self.max_output_tokens,
            default_max_tokens=DEFAULT_MAX_TOKENS,
            model=self.model,
            tools=tools,
            json_schema=self.json_schema(),
        )

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

    def _choice(self) -> str | None:
        return self.tool_choice if isinstance(self.tool_choice, str) else None

    def _forced(self) -> str | None:
        choice = self.tool_choice
        return choice.name if isinstance(choice, NamedFunctionChoice) else None


NULLABLE = frozenset({"temperature", "top_p", "stream", "store", "metadata"})
