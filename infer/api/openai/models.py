"""The bodies of OpenAI's ``/v1/completions`` and ``/v1/chat/completions``, and what each
becomes: the engine request (:meth:`CompletionRequest.engine_request`)."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, Literal, cast

from pydantic import Field, StrictInt, StrictStr, model_validator

from infer.api.engine_request import EngineRequest, Prompt
from infer.api.fields import Body, SamplingFields
from infer.api.fim import Fill, FimRequest, Layout, editor_stops
from infer.api.messages import (
    ChatMessage,
    FunctionName,
    Tools,
    check_tool_results,
    check_tools,
    tool_choice,
)
from infer.engine.params import DEFAULT_MAX_TOKENS, Logprobs, MaxNewTokens, MaxTokens

MAX_CHOICES = 16  # n per prompt
MAX_FANOUT = 64  # engine requests per request: prompts times n
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]
Prompts = StrictStr | list[StrictStr] | list[StrictInt] | list[TokenIds]


class StreamOptions(Body):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; chunks are never padded here


class OpenAIFields(SamplingFields):
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

    def include_usage(self) -> bool:
        """Whether a stream ends with a usage chunk (and every chunk has ``usage: null``)."""
        return bool(self.stream_options and self.stream_options.include_usage)


def engine_logprobs(wanted: int | None) -> int:
    """Alternatives per token the engine reports for ``wanted`` (at least the token)."""
    return max(1, wanted) if wanted is not None else 0


class CompletionRequest(OpenAIFields):
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
            if self.echo:
                raise ValueError("echo is not supported with suffix")
            if self.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs is not supported with suffix")
            if any(not isinstance(p, str) for p in self.prompt_list()):
                raise ValueError("suffix needs text prompts (the code before the cursor)")
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

    def engine_request(self, layout: Layout = Layout.PSM) -> EngineRequest:
        """`n` completions of each prompt; with a `suffix`, each prompt is the code before
        the cursor and the completion fills the middle (prompts built in ``layout``)."""
        prompts = [Prompt(p) for p in self.prompt_list()]
        if self.suffix:
            fills = [
                Fill(FimRequest(str(p), self.suffix), layout=layout) for p in self.prompt_list()
            ]
            prompts = [Prompt(fill=f) for f in fills]
        request = self.sampling_request(
            prompts,
            default_max_tokens=COMPLETION_MAX_TOKENS,
            n=self.n,
            logprobs=engine_logprobs(self.logprobs),
            prompt_logprobs=self.scored_prompt(),
        )
        if not self.suffix:
            return request
        head = str(self.prompt_list()[0]).rsplit("\n", 1)[-1]
        stops = editor_stops(self.suffix, line_head=head)
        params = dataclasses.replace(request.params, editor=stops)
        return dataclasses.replace(request, params=params)


class NamedFunction(Body):
    name: FunctionName


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(OpenAIFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_completion_tokens: MaxTokens | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    tools: Tools | None = None
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
    # Router extras (see OpenAIFields): the template always opens a new assistant turn;
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
        json_format = "response_format" if self.json_schema() is not None else None
        check_tools(names, self._choice(), self._forced(), json_format)
        check_tool_results(self.messages)
        return self

    def limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else self.max_completion_tokens

    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per token the answer shows; `None`: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def engine_request(self) -> EngineRequest:
        """`n` replies to the conversation, with its tools."""
        tools = None
        if self.tools and self.tool_choice != "none":
            offered = [t.function.tool() for t in self.tools]
            tools = tool_choice(offered, self._choice(), self._forced(), self.parallel_tool_calls)
        prompt = Prompt(messages=self.messages, template_kwargs=self.chat_template_kwargs)
        return self.sampling_request(
            [prompt],
            default_max_tokens=DEFAULT_MAX_TOKENS,
            n=self.n,
            logprobs=engine_logprobs(self.top_logprobs_wanted()),
            prompt_logprobs=self.prompt_logprobs,
            tools=tools,
        )

    def _choice(self) -> str | None:
        return self.tool_choice if isinstance(self.tool_choice, str) else None

    def _forced(self) -> str | None:
        choice = self.tool_choice
        return choice.function.name if isinstance(choice, NamedToolChoice) else None
