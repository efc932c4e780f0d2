"""The bodies of Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens``, and what
each becomes: chat messages (:meth:`Conversation.chat_messages`) and the one engine request
(:meth:`MessagesRequest.engine_request`).

A conversation maps onto the chat path: ``system`` becomes a system message; a user
message's ``tool_result`` blocks become tool messages (answering the ``tool_use`` blocks of
an earlier assistant message, which become its tool calls) and its text a user message;
``thinking`` blocks sent back are dropped, as chat drops an earlier reply's reasoning.
Images, documents and server tools are refused: the served model reads text and calls the
client's tools (the blocks, tools and choices are :mod:`.params`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from infer.api.anthropic.params import (
    CacheControlParam,
    MessageParam,
    MetadataParam,
    OutputConfigParam,
    TextBlockParam,
    ThinkingEnabledParam,
    ThinkingParam,
    ToolChoiceAnyParam,
    ToolChoiceNoneParam,
    ToolChoiceParam,
    ToolChoiceToolParam,
    ToolParam,
    ToolResultBlockParam,
    ToolUseBlockParam,
)
from infer.api.engine_request import EngineRequest, Prompt
from infer.api.fields import Body
from infer.api.messages import (
    MAX_TOOLS,
    CalledFunction,
    ChatMessage,
    ToolCall,
    check_tools,
    tool_choice,
)
from infer.api.tools import ToolChoice
from infer.engine.params import MaxTokens, SamplingParams, StopStrings, Temperature, TopK, TopP

# Claude Code opens its system prompt with a billing line whose `cch=` value changes on every
# request (`x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;`).
# Left as sent, it would make every prompt differ from its first tokens on, and the prefix
# cache could never serve Claude Code's long system prompt; so the value is made constant,
# as llama.cpp does. The line means nothing to a local model.
BILLING_HEADER = "x-anthropic-billing-header:"
_CCH = re.compile(r"\bcch=[^;\s]*")


def normalized_system_text(text: str) -> str:
    """A system block as the prompt keeps it: Claude Code's billing line made constant."""
    if not text.startswith(BILLING_HEADER):
        return text
    return _CCH.sub("cch=00000", text, count=1)


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
