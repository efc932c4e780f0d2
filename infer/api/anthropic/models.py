"""The bodies of Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens``, and what
each becomes: chat messages (:meth:`Conversation.chat_messages`) and the one engine request
(:meth:`MessagesRequest.engine_request`).

A conversation maps onto the chat path: ``system`` becomes a system message; a user
message's ``tool_result`` blocks become tool messages (answering the ``tool_use`` blocks of
an earlier assistant message, which become its tool calls) and its text a user message;
``thinking`` blocks sent back are dropped, as chat drops an earlier reply's reasoning.
Images, documents and server tools are refused: the served model reads text and calls the
client's tools. ``cache_control`` is accepted everywhere and means nothing here: the prefix
cache keeps every prompt's blocks anyway.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PrivateAttr, model_validator

from infer.api.engine_request import EngineRequest, Prompt
from infer.api.fields import Body
from infer.api.messages import (
    MAX_TOOLS,
    CalledFunction,
    ChatMessage,
    FunctionName,
    ToolCall,
    check_parameters,
    check_tools,
    tool_choice,
)
from infer.api.tools import Tool, ToolChoice
from infer.engine.params import MaxTokens, SamplingParams, StopStrings, Temperature, TopK, TopP

# Claude Code opens its system prompt with a billing line whose `cch=` value changes on every
# request (`x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;`).
# Left as sent, it would make every prompt differ from its first tokens on, and the prefix
# cache could never serve Claude Code's long system prompt; so the value is made constant,
# as llama.cpp does. The line means nothing to a local model.
BILLING_HEADER = "x-anthropic-billing-header:"
_CCH = re.compile(r"\bcch=[^;\s]*")

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


def normalized_system_text(text: str) -> str:
    """A system block as the prompt keeps it: Claude Code's billing line made constant."""
    if not text.startswith(BILLING_HEADER):
        return text
    return _CCH.sub("cch=00000", text, count=1)


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


class Conversation(Body):
    """What `/v1/messages` and its `count_tokens` share: the model, the conversation and
    the tools, rendered by the model's chat template."""

    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlockParam] | None = None
    tools: Annotated[list[ToolParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfigParam | None = None
    # Accepted, no effect on a local server (Anthropic's caching, context edits, tiers).
    cache_control: CacheControlParam | None = None
    context_management: dict[str, Any] | None = None
    speed: Literal["standard", "fast"] | None = None

    _chat: list[ChatMessage] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _honourable(self) -> Conversation:
        names = [t.name for t in self.tools or []]
        choice = self.tool_choice
        if isinstance(choice, ToolChoiceAnyParam) and not names:
            raise ValueError("tool_choice 'any' needs tools")
        forced = choice.name if isinstance(choice, ToolChoiceToolParam) else None
        json_format = "output_config.format" if self.json_schema() is not None else None
        offered = names if not isinstance(choice, ToolChoiceNoneParam) else []
        check_tools(offered, None, forced, json_format)
        self._chat = self.chat_messages()
        return self

    def json_schema(self) -> dict[str, Any] | None:
        """The schema `output_config.format` asks the answer to follow; `None`: free text."""
        fmt = self.output_config.format if self.output_config is not None else None
        return fmt.schema_ if fmt is not None else None

    def system_text(self) -> str:
        """The system prompt as one text (blocks joined by a blank line), normalized."""
        if self.system is None or isinstance(self.system, str):
            return normalized_system_text(self.system or "")
        return "\n\n".join(normalized_system_text(block.text) for block in self.system)

    def chat_messages(self) -> list[ChatMessage]:
        """The system prompt and the conversation as chat messages.

        Raises:
            ValueError: A ``tool_result`` answers no earlier ``tool_use``.
        """
        system = self.system_text()
        out = [ChatMessage(role="system", content=system)] if system else []
        called: dict[str, str] = {}  # tool_use id -> the tool's name
        for i, message in enumerate(self.messages):
            blocks = message.content
            if isinstance(blocks, str):
                out.append(ChatMessage(role=message.role, content=blocks))
                continue
            if message.role == "assistant":
                out.append(_assistant(blocks, called))
                continue
            texts: list[str] = []
            for j, block in enumerate(blocks):
                if isinstance(block, ToolResultBlockParam):
                    if block.tool_use_id not in called:
                        raise ValueError(
                            f"messages.{i}.content.{j}: tool_use_id {block.tool_use_id!r} "
                            "answers no tool_use block of an earlier assistant message"
                        )
                    out += _user_text(texts)
                    name = called[block.tool_use_id]
                    tool = ChatMessage(
                        role="tool", content=block.text(), tool_call_id=block.tool_use_id, name=name
                    )
                    out.append(tool)
                elif isinstance(block, TextBlockParam):
                    texts.append(block.text)
            out += _user_text(texts)
        return out

    def prompt(self) -> Prompt:
        """The conversation, rendered with thinking on or off as `thinking` asks (no
        `thinking` is off, as Anthropic's models do; `adaptive` is the template's default)."""
        kwargs = None
        if self.thinking is None or self.thinking.type != "adaptive":
            kwargs = {"enable_thinking": isinstance(self.thinking, ThinkingEnabledParam)}
        return Prompt(messages=self._chat, template_kwargs=kwargs)

    def offered_tools(self) -> ToolChoice | None:
        """The offered tools and how the model may call them; `None`: no tools offered."""
        choice = self.tool_choice
        if not self.tools or isinstance(choice, ToolChoiceNoneParam):
            return None
        forced = choice.name if isinstance(choice, ToolChoiceToolParam) else None
        required = "required" if isinstance(choice, ToolChoiceAnyParam) else None
        parallel = not (choice is not None and choice.disable_parallel_tool_use)
        return tool_choice([t.tool() for t in self.tools], required, forced, parallel)


def _assistant(blocks: Sequence[Any], called: dict[str, str]) -> ChatMessage:
    """An assistant message: its text and its calls (its thinking is dropped)."""
    text = "".join(b.text for b in blocks if isinstance(b, TextBlockParam))
    calls = []
    for b in blocks:
        if isinstance(b, ToolUseBlockParam):
            called[b.id] = b.name
            calls.append(ToolCall(id=b.id, function=CalledFunction(name=b.name, arguments=b.input)))
    content = text or (None if calls else "")
    return ChatMessage(role="assistant", content=content, tool_calls=calls or None)


def _user_text(texts: list[str]) -> list[ChatMessage]:
    """The text blocks read so far as one user message (none if there are none); empties
    ``texts``."""
    if not texts:
        return []
    message = ChatMessage(role="user", content="\n\n".join(texts))
    texts.clear()
    return [message]


class CountTokensRequest(Conversation):
    """`POST /v1/messages/count_tokens`: the prompt's tokens, as `/v1/messages` reads it."""


class MessagesRequest(Conversation):
    """`POST /v1/messages`: one assistant reply to `messages`.

    `max_tokens` bounds the reply; the context the prompt leaves bounds it too (the reply
    then ends with `model_context_window_exceeded`). A last assistant message is history:
    the reply is a new turn after it (no prefill).
    """

    max_tokens: MaxTokens
    stream: bool = False
    stop_sequences: StopStrings | None = None
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    metadata: MetadataParam | None = None
    # Accepted, no effect on a local server (Anthropic's tiers, regions and containers).
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    container: str | dict[str, Any] | None = None
    diagnostics: dict[str, Any] | None = None

    def engine_request(self) -> EngineRequest:
        """One reply, at most `max_tokens` long (or as long as the context leaves room)."""
        params = SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=list(self.stop_sequences or []),
        )
        return EngineRequest(
            [self.prompt()],
            params,
            max_tokens=None,  # the limit below, capped by the room the prompt leaves
            default_max_tokens=self.max_tokens,
            model=self.model,
            tools=self.offered_tools(),
            json_schema=self.json_schema(),
        )
