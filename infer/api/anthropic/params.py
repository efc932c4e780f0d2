"""The parts of Anthropic's request bodies: content blocks, tools and how the model may call
them, thinking, the output's format and the metadata (:mod:`.models` holds the bodies).

Blocks a text model with client tools cannot take (images, documents, what Anthropic's own
server tools wrote) are refused by name. ``cache_control`` is accepted everywhere and means
nothing here: the prefix cache keeps every prompt's blocks anyway.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from infer.api.fields import Body
from infer.api.messages import FunctionName, check_parameters
from infer.api.tools import Tool

# Content blocks a text model with client tools cannot take, and why (refused by name).
_NOT_TEXT = "this server serves a text-only model"
_SERVER_SIDE = "tools run on Anthropic's servers are not served here (give client tools)"
UNSUPPORTED_BLOCKS = {
    "image": _NOT_TEXT,
    "document": _NOT_TEXT,
    "search_result": _NOT_TEXT,
    "container_upload": _NOT_TEXT,
} | {
    kind: _SERVER_SIDE
    for kind in (
        "server_tool_use",
        "web_search_tool_result",
        "web_fetch_tool_result",
        "code_execution_tool_result",
        "bash_code_execution_tool_result",
        "text_editor_code_execution_tool_result",
        "tool_search_tool_result",
        "mcp_tool_use",
        "mcp_tool_result",
    )
}


class CacheControlParam(Body):
    """`cache_control`: accepted; the prefix cache keeps every prompt's blocks anyway."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlockParam(Body):
    type: Literal["text"]
    text: str
    cache_control: CacheControlParam | None = None
    citations: list[dict[str, Any]] | None = None


class ThinkingBlockParam(Body):
    """An earlier reply's thinking, sent back: accepted, not shown to the model again."""

    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlockParam(Body):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlockParam(Body):
    """A call an earlier assistant reply made."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: FunctionName
    input: dict[str, Any]
    cache_control: CacheControlParam | None = None
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolResultBlockParam(Body):
    """What a call returned: text (a string or text blocks), marked when it failed."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextBlockParam] = ""
    is_error: bool = False
    cache_control: CacheControlParam | None = None
    toolset_name: str | None = None

    def text(self) -> str:
        """The result as the model reads it (a failure says so)."""
        content = self.content
        text = content if isinstance(content, str) else "\n".join(b.text for b in content)
        return f"Error: {text}" if self.is_error else text


ContentBlock = Annotated[
    TextBlockParam
    | ThinkingBlockParam
    | RedactedThinkingBlockParam
    | ToolUseBlockParam
    | ToolResultBlockParam,
    Field(discriminator="type"),
]


_BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")


def _check_blocks(blocks: list[Any], where: str = "content") -> None:
    """Refuse, by name, a block a text model with client tools cannot take (a tool result's
    content included), and one of no known type."""
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if not isinstance(kind, str):
            continue  # the block's own validation says what is wrong
        if kind in UNSUPPORTED_BLOCKS:
            why = UNSUPPORTED_BLOCKS[kind]
            raise ValueError(f"{where}.{j}: {kind} blocks are not supported: {why}")
        if kind not in _BLOCKS:
            raise ValueError(f"{where}.{j}: no content block has type {kind!r}")
        if kind == "tool_result" and isinstance(block.get("content"), list):
            _check_blocks(block["content"], f"{where}.{j}.content")


class MessageParam(Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            _check_blocks(data["content"])
        return data


class ToolParam(Body):
    """A client tool: its name, what it does, and the JSON schema of its `input`."""

    name: FunctionName
    input_schema: dict[str, Any]  # a JSON schema of an object
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControlParam | None = None
    strict: bool | None = None  # calls always fit their schema here
    defer_loading: bool | None = None
    eager_input_streaming: bool | None = None
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise ValueError(f"{kind!r} tools are not supported: {_SERVER_SIDE}")
        return data

    @model_validator(mode="after")
    def _schema(self) -> ToolParam:
        if self.input_schema.get("type") != "object":
            raise ValueError(f"the input_schema of {self.name!r} must have type 'object'")
        check_parameters(self.name, self.input_schema)
        return self

    def tool(self) -> Tool:
        return Tool(self.name, self.description, self.input_schema)


class ToolChoiceAutoParam(Body):
    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAnyParam(Body):
    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceToolParam(Body):
    type: Literal["tool"]
    name: FunctionName
    disable_parallel_tool_use: bool = False


class ToolChoiceNoneParam(Body):
    type: Literal["none"]


ToolChoiceParam = Annotated[
    ToolChoiceAutoParam | ToolChoiceAnyParam | ToolChoiceToolParam | ToolChoiceNoneParam,
    Field(discriminator="type"),
]


class ThinkingEnabledParam(Body):
    """Thinking on. The reply reasons as long as the model does (within `max_tokens`):
    `budget_tokens` is accepted, not enforced."""

    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=1)]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabledParam(Body):
    type: Literal["disabled"]


class ThinkingAdaptiveParam(Body):
    """The model decides (Claude Code's choice): the template's default."""

    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


ThinkingParam = Annotated[
    ThinkingEnabledParam | ThinkingDisabledParam | ThinkingAdaptiveParam,
    Field(discriminator="type"),
]


class JSONOutputFormatParam(Body):
    type: Literal["json_schema"]
    schema_: Annotated[dict[str, Any], Field(alias="schema")]

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, populate_by_name=True)


class OutputConfigParam(Body):
    """`output_config`: a JSON schema the answer follows; `effort` is accepted."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormatParam | None = None


class MetadataParam(Body):
    user_id: str | None = None
