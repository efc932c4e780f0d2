"""Chat messages and function tools, as the protocols that converse take them, written once:
the history's messages and calls, the offered functions and their checks."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field, model_validator

from infer.api.fields import Body, TextPart
from infer.api.tools import Mode, Tool, ToolChoice

FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
MAX_TOOLS = 128


class OtherPart(BaseModel):
    """A content part OpenAI defines that a text model cannot take (refused, named)."""

    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_audio", "file", "refusal"]


class CalledFunction(Body):
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


class ToolCall(Body):
    """A call in an assistant message of the history."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Body):
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


class FunctionDefinition(Body):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None  # calls always fit their schema here

    @model_validator(mode="after")
    def _schema(self) -> FunctionDefinition:
        check_parameters(self.name, self.parameters)
        return self

    def tool(self) -> Tool:
        """The function as the chat template and the grammar take it."""
        return Tool(
            self.name, self.description, self.parameters or {"type": "object", "properties": {}}
        )


class ToolDefinition(Body):
    type: Literal["function"]
    function: FunctionDefinition


Tools = Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)]


def check_parameters(name: str, parameters: dict[str, Any] | None) -> None:
    """Refuse ``parameters`` that are not a JSON schema.

    Raises:
        ValueError: The message names the function.
    """
    if parameters is None:
        return
    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as e:
        raise ValueError(f"the parameters of {name!r} are not a JSON schema: {e.message}") from None


def check_tools(
    names: Sequence[str], choice: str | None, forced: str | None, json_format: str | None
) -> None:
    """The checks every request that offers tools passes: distinct names, a named choice
    among them, ``required`` with some, and no tool calls beside a JSON format.

    Args:
        names: The offered functions' names.
        choice: ``tool_choice`` when it is a string (``auto``, ``none``, ``required``).
        forced: The function ``tool_choice`` names, if it names one.
        json_format: The field that asks for a JSON format, if the request sets one.

    Raises:
        ValueError: The message says which check failed.
    """
    if len(set(names)) != len(names):
        raise ValueError("tools: two tools have the same name")
    if forced is not None and forced not in names:
        raise ValueError(f"tool_choice names {forced!r}, which is not in tools")
    if choice == "required" and not names:
        raise ValueError("tool_choice 'required' needs tools")
    if names and choice != "none" and json_format is not None:
        raise ValueError(f"{json_format} cannot be combined with tool calls")


def check_tool_results(messages: Sequence[ChatMessage]) -> None:
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


def tool_choice(
    tools: Sequence[Tool], choice: str | None, forced: str | None, parallel: bool | None
) -> ToolChoice:
    """The offered functions and how the model may call them: ``auto``, ``required``, or
    the ``forced`` function alone."""
    offered = tuple(tools)
    mode: Mode = "required" if choice == "required" else "auto"
    if forced is not None:
        mode = "forced"
        offered = tuple(t for t in offered if t.name == forced)
    return ToolChoice(offered, mode, parallel is not False)
