"""OpenAI's API: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/responses``.

Each generation route parses its body (:func:`~infer.server.admission.parse_body`), admits
the request (:func:`~infer.server.admission.admit`) and answers through
:func:`~infer.server.respond.respond` with its writer: :class:`CompletionWriter` (chunks
then ``[DONE]``, or one body) or :class:`ResponsesWriter` (the Responses events, or the
response object). A chat request's tools and reasoning are read back out of the reply by
:class:`~infer.api.chat.ReplyParser`.

``/v1/responses`` runs over the chat path: its input items become chat messages, after the
conversation of the response ``previous_response_id`` names and after ``instructions`` as a
system message. A response that did not fail is stored (unless ``store`` is false) so that
a later request can continue it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import trio
from quart import Blueprint, Response, jsonify

from infer.api import openai, responses
from infer.api.chat import ReplyParser
from infer.api.responses import ResponseBuilder, Status
from infer.api.tools import Mode, Tool, ToolPlan, tool_format
from infer.engine.params import DEFAULT_MAX_TOKENS
from infer.engine.request import Failure, FinishReason, Outcome, StepOutput
from infer.server import sse
from infer.server.admission import Prompt, admit, parse_body
from infer.server.errors import APIError, ErrorCode
from infer.server.respond import Writer, respond
from infer.server.schemas import (
    CalledFunction,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    FunctionDefinition,
    NamedFunctionChoice,
    NamedToolChoice,
    ResponsesRequest,
    ToolCall,
    check_tool_results,
)
from infer.server.state import ServerState, get_state
from infer.server.stream import RequestStream

blueprint = Blueprint("openai", __name__)

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@blueprint.get("/v1/models")
async def models() -> Response:
    """The served model, under each of its names, with its context length."""
    state = get_state()
    cards = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "infer",
            "max_model_len": state.max_model_len,
        }
        for name in state.model_names
    ]
    return jsonify({"object": "list", "data": cards})


@blueprint.post("/v1/completions")
async def completions() -> Response:
    """Text completions of `prompt` (one or a list), `n` per prompt."""
    arrival = trio.current_time()
    body = await parse_body(CompletionRequest)
    state = get_state()
    wanted = body.logprobs
    admitted = await admit(
        state,
        [Prompt(p) for p in body.prompt_list()],
        body,
        arrival=arrival,
        default_max_tokens=COMPLETION_MAX_TOKENS,
        n=body.n,
        logprobs=_engine_logprobs(wanted),
        prompt_logprobs=body.scored_prompt(),
    )
    stream = admitted.stream
    echo = None
    if body.echo:
        texts = [p if isinstance(p, str) else await decode(state, p) for p in body.prompt_list()]
        echo = [text for text in texts for _ in range(body.n)]
    head = openai.Head(
        "cmpl-" + stream.id,
        stream.stats.created,
        state.model_name,
        chat=False,
        top_logprobs=wanted,
        usage_field=_include_usage(body),
        echo_scores=body.echo_logprobs() is not None,
        prompt_logprobs=body.prompt_logprobs,
    )
    prompts = [ids for ids in admitted.prompt_ids for _ in range(body.n)]
    writer = CompletionWriter(state, stream, body.stream, head, prompts, echo)
    return await respond(writer, state.config.heartbeat_s)


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    """`n` assistant replies to `messages`, through the model's chat template."""
    arrival = trio.current_time()
    body = await parse_body(ChatCompletionRequest)
    state = get_state()
    plan = None
    if body.wants_tools():
        choice = body.tool_choice
        plan = tool_plan(
            state,
            [t.function for t in body.tools or []],
            choice if isinstance(choice, str) else None,
            choice.function.name if isinstance(choice, NamedToolChoice) else None,
            body.parallel_tool_calls,
        )
    wanted = (body.top_logprobs or 0) if body.logprobs else None
    admitted = await admit(
        state,
        [Prompt(messages=body.messages, plan=plan, template_kwargs=body.chat_template_kwargs)],
        body,
        arrival=arrival,
        default_max_tokens=DEFAULT_MAX_TOKENS,
        n=body.n,
        logprobs=_engine_logprobs(wanted),
        prompt_logprobs=body.prompt_logprobs,
    )
    stream = admitted.stream
    head = openai.Head(
        "chatcmpl-" + stream.id,
        stream.stats.created,
        state.model_name,
        chat=True,
        top_logprobs=wanted,
        usage_field=_include_usage(body),
        prompt_logprobs=body.prompt_logprobs,
    )
    thinking, separate = admitted.thinking, body.separate_reasoning
    replies = None
    if plan is not None or (thinking is not None and separate):
        replies = [ReplyParser(plan, thinking, separate) for _ in stream.choices]
    prompts = admitted.prompt_ids * body.n
    writer = CompletionWriter(state, stream, body.stream, head, prompts, replies=replies)
    return await respond(writer, state.config.heartbeat_s)


def tool_plan(
    state: ServerState,
    functions: Sequence[FunctionDefinition],
    choice: str | None,
    forced: str | None,
    parallel: bool | None,
) -> ToolPlan:
    """The offered functions, the choice (``auto``, ``required``, or the ``forced`` tool's
    name) and the call format of the served model's template."""
    offered = tuple(
        Tool(f.name, f.description, f.parameters or {"type": "object", "properties": {}})
        for f in functions
    )
    mode: Mode = "required" if choice == "required" else "auto"
    if forced is not None:
        mode = "forced"
        offered = tuple(t for t in offered if t.name == forced)
    template = getattr(state.engine.tokenizer, "chat_template", None) if state.engine else None
    return ToolPlan(offered, mode, parallel is not False, tool_format(template))


def _engine_logprobs(wanted: int | None) -> int:
    return max(1, wanted) if wanted is not None else 0


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def decode(state: ServerState, ids: list[int]) -> str:
    """The text of ``ids`` (in a thread)."""
    engine, _ = state.require_ready()
    return str(await trio.to_thread.run_sync(engine.tokenizer.decode, ids))


class _OpenAIWriter(Writer):
    """A writer of OpenAI's shapes: a timeout ends a choice with `length`, not an error."""

    def is_error(self, out: StepOutput) -> bool:
        return out.outcome is not None and openai.finish_reason(out.outcome) is None


class CompletionWriter(_OpenAIWriter):
    """Completions and chat completions: a chunk per output then ``[DONE]``, or one body.

    Args:
        state: The server (its tokenizer names scored prompt tokens).
        stream: The request's stream.
        streamed: Whether the client reads chunks.
        head: What every chunk and the body share.
        prompts: Each choice's prompt ids.
        echo: Each choice's echoed prompt text (completions with ``echo``).
        replies: Each chat choice's reply parser (tools, separate reasoning).
    """

    def __init__(
        self,
        state: ServerState,
        stream: RequestStream,
        streamed: bool,
        head: openai.Head,
        prompts: list[list[int]],
        echo: list[str] | None = None,
        replies: list[ReplyParser] | None = None,
    ) -> None:
        super().__init__(stream, streamed)
        self.state = state
        self.head = head
        self.prompts = prompts
        self.echo = echo
        self.replies = replies
        count = len(stream.choices)
        self.texts: list[list[str]] = [[] for _ in range(count)]
        self.choices = [openai.Choice("", None, []) for _ in range(count)]
        self.outcomes: list[Outcome | None] = [None] * count

    def start(self) -> bytes:
        if not self.streamed:
            return b""
        echo = None if self.head.echo_scores else self.echo
        return _frames(openai.opening(self.head, len(self.stream.choices), echo))

    async def output(self, index: int, out: StepOutput) -> bytes:
        head = self.head
        prompt = await self._scores(index, out) if out.prompt_logprobs is not None else None
        if not self.streamed:
            self.texts[index].append(out.text_delta)
            choice = self.choices[index]
            if out.logprobs is not None:
                choice.outputs.append(out)
            if prompt is not None:
                choice.prompt = prompt
            self.outcomes[index] = out.outcome
            return b""
        echoed = self.echo[index] if self.echo is not None else None
        chunks = [openai.prompt_chunk(head, index, prompt, echoed)] if prompt else []
        offset = len(echoed) if head.echo_scores and echoed else 0
        reply = self.replies[index] if self.replies else None
        return _frames(chunks + openai.output_chunks(head, index, out, reply, offset))

    async def finish(self) -> bytes:
        if not self.streamed:
            return b""
        usage = openai.usage_chunk(self.head, self.stream.usage())
        return (sse.event(usage) if self.head.usage_field else b"") + sse.DONE

    def failed(self, error: APIError) -> bytes:
        return sse.event(openai.error_chunk(error.code.value, error.message)) + sse.DONE

    def body(self) -> dict[str, Any]:
        for index, (choice, outcome) in enumerate(zip(self.choices, self.outcomes, strict=True)):
            assert outcome is not None  # every choice has ended
            choice.text = "".join(self.texts[index])
            if self.replies:
                choice.reply = self.replies[index]
                choice.reply.feed(choice.text)
                choice.reply.finish()
            choice.finish_reason = openai.finish_reason(outcome, choice.reply)
        return openai.body(self.head, self.choices, self.stream.usage(), self.echo)

    async def _scores(self, index: int, out: StepOutput) -> openai.PromptScores:
        """An output's prompt scores with the text of each token they name and, for an
        echo with log-probabilities, each prompt token's offset (in a thread)."""
        engine = self.state.engine
        assert engine is not None  # a stream is open
        ids, tokenizer, offsets = self.prompts[index], engine.tokenizer, self.head.echo_scores
        scores = out.prompt_logprobs
        assert scores is not None  # asked only of an output that carries them

        def run() -> openai.PromptScores:
            named = {*ids, *(t for s in scores for t, _ in s.top)}
            texts = {t: str(tokenizer.decode([t])) for t in named}
            at = [len(tokenizer.decode(ids[:i])) for i in range(len(ids))] if offsets else []
            return openai.PromptScores(ids, scores, texts, at)

        return await trio.to_thread.run_sync(run)


def _frames(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(sse.event(c) for c in chunks)


# --- the Responses API ---------------------------------------------------------------------


@blueprint.post("/v1/responses")
async def create_response() -> Response:
    """One assistant reply to `input`, as a Responses object or its event stream."""
    arrival = trio.current_time()
    body = await parse_body(ResponsesRequest)
    state = get_state()
    history: tuple[ChatMessage, ...] = ()
    try:
        if body.previous_response_id is not None:
            found = state.responses.get(body.previous_response_id)
            if found is None:
                raise APIError(
                    ErrorCode.RESPONSE_NOT_FOUND,
                    f"previous_response_id {body.previous_response_id!r} names no stored "
                    "response (unknown, expired, or stored with store: false)",
                )
            history = found
        conversation = body.messages(history)
        try:
            check_tool_results(conversation)
        except ValueError as e:
            raise APIError(ErrorCode.INVALID_VALUE, f"input: {e}") from None
    except APIError as e:
        state.metrics.rejected[e.code.value] += 1
        raise
    system = [ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    plan = None
    if body.wants_tools():
        choice = body.tool_choice if isinstance(body.tool_choice, str) else None
        functions = body.function_definitions()
        plan = tool_plan(state, functions, choice, body.forced_tool(), body.parallel_tool_calls)
    admitted = await admit(
        state,
        [Prompt(messages=[*system, *conversation], plan=plan)],
        body.sampling_fields(),
        arrival=arrival,
        default_max_tokens=DEFAULT_MAX_TOKENS,
    )
    stream = admitted.stream
    head = responses.Head(
        "resp_" + stream.id.removeprefix("req-"),
        stream.stats.created,
        state.model_name,
        echo(body),
    )

    def keep(reply: ReplyParser) -> None:
        if body.store:
            state.responses.put(head.id, [*conversation, assistant_message(reply)])

    reply = ReplyParser(plan, admitted.thinking)
    writer = ResponsesWriter(state, stream, body.stream, ResponseBuilder(head), reply, keep)
    return await respond(writer, state.config.heartbeat_s)


def echo(body: ResponsesRequest) -> dict[str, Any]:
    """The request fields a response object repeats, in its shape."""
    choice: Any = body.tool_choice or "auto"
    if isinstance(choice, NamedFunctionChoice):
        choice = {"type": "function", "name": choice.name}
    fmt = body.text.format if body.text is not None else None
    text: dict[str, Any] = {
        "format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}
    }
    if body.text is not None and body.text.verbosity is not None:
        text["verbosity"] = body.text.verbosity
    reasoning = body.reasoning
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {
            "effort": reasoning.effort if reasoning else None,
            "summary": reasoning.summary if reasoning else None,
        },
        "store": body.store,
        "temperature": body.temperature,
        "text": text,
        "tool_choice": choice,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "top_p": body.top_p,
        "truncation": "disabled",
        "user": body.user,
        "background": False,
    }


def assistant_message(reply: ReplyParser) -> ChatMessage:
    """The reply as the chat history's assistant message: its text and complete calls (its
    reasoning is not sent back, as on the chat route)."""
    calls = [
        ToolCall(id=c.id, function=CalledFunction(name=c.name, arguments=c.arguments))
        for c in reply.calls
    ]
    content = reply.content or (None if calls else "")
    return ChatMessage(role="assistant", content=content, tool_calls=calls or None)


class ResponsesWriter(_OpenAIWriter):
    """The Responses events of one reply, or the whole response object.

    Args:
        state: The server (its tokenizer counts reasoning tokens).
        stream: The request's stream (one choice).
        streamed: Whether the client reads events.
        builder: Builds the response's items and events.
        reply: Reads the reply's reasoning, text and tool calls.
        keep: Stores the conversation once the response has ended without failing.
    """

    def __init__(
        self,
        state: ServerState,
        stream: RequestStream,
        streamed: bool,
        builder: ResponseBuilder,
        reply: ReplyParser,
        keep: Callable[[ReplyParser], None],
    ) -> None:
        super().__init__(stream, streamed)
        self.state = state
        self.builder = builder
        self.reply = reply
        self.keep = keep
        self.outcome: Outcome | None = None
        self.response: dict[str, Any] = {}

    def start(self) -> bytes:
        return self._frames(self.builder.start())

    async def output(self, index: int, out: StepOutput) -> bytes:
        delta = self.reply.feed(out.text_delta)
        if out.outcome is not None:
            self.outcome = out.outcome
            delta.extend(self.reply.finish())
        return self._frames(self.builder.feed(delta))

    async def finish(self) -> bytes:
        incomplete = self.outcome in (FinishReason.LENGTH, Failure.TIMEOUT)
        status: Status = "incomplete" if incomplete else "completed"
        events = self.builder.finish(self.reply, status, await self._usage())
        self.keep(self.reply)
        self.response = events[-1]["response"]
        return self._frames(events)

    def failed(self, error: APIError) -> bytes:
        failure = responses.error(error.message)
        return self._frames(self.builder.finish(self.reply, "failed", None, failure))

    def body(self) -> dict[str, Any]:
        return self.response

    def _frames(self, events: list[dict[str, Any]]) -> bytes:
        if not self.streamed:
            return b""
        return b"".join(sse.event(e, e["type"]) for e in events)

    async def _usage(self) -> dict[str, Any]:
        """The response's usage; its reasoning tokens counted by encoding the reasoning."""
        counts = self.stream.usage()
        reasoning_tokens = 0
        engine = self.state.engine
        if self.reply.reasoning and engine is not None:
            tokenizer, text = engine.tokenizer, self.reply.reasoning
            ids = await trio.to_thread.run_sync(
                lambda: tokenizer.encode(text, add_special_tokens=False)
            )
            reasoning_tokens = min(len(ids), counts["completion_tokens"])
        return responses.usage(counts, reasoning_tokens)
