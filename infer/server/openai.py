"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

``stream: true`` sends ``data: {chunk}`` events, a last chunk with ``finish_reason``, a
usage chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``. An error
after the stream started (shutdown, out of memory) is an error chunk before ``[DONE]``.
``stream: false`` sends one JSON body. Our ``eos`` finish reason is OpenAI's ``stop``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, TypeVar, cast

import trio
from quart import Blueprint, Response, current_app, jsonify
from quart_trio import QuartTrio

from infer.engine.request import StepOutput
from infer.server import sse
from infer.server.errors import APIError, error_body
from infer.server.fanout import Choices, choice_seed
from infer.server.generation import (
    Generation,
    Outcome,
    Submission,
    outcome,
    parse_body,
    start,
)
from infer.server.openai_format import ChunkFormat
from infer.server.schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from infer.server.state import ServerState, get_state
from infer.server.structured import compile_format

log = logging.getLogger("infer.server")

blueprint = Blueprint("openai", __name__)

Body = TypeVar("Body", bound=SamplingFields)

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 256

# Error codes of a request that failed mid-way, as the status of a non-streamed answer.
ERROR_STATUS = {"CANCELLED": 503, "OVERLOADED": 503, "OUT_OF_MEMORY": 503,
                "INVALID_REQUEST": 422, "INFERENCE_FAILED": 500}


@blueprint.get("/v1/models")
async def models() -> Response:
    """The one model this server serves, with its context length."""
    state = get_state()
    return jsonify({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": 0, "owned_by": "infer",
         "max_model_len": max_model_len(state)}]})


def max_model_len(state: ServerState) -> int:
    """Prompt + completion tokens one request may use."""
    engine = state.engine
    return engine.config.max_seq_len if engine is not None else state.config.engine.max_seq_len


@blueprint.post("/v1/completions")
async def completions() -> Response:
    """Text completions of ``prompt`` (one or a list), ``n`` per prompt."""
    arrival = trio.current_time()
    body = await parse_body(CompletionRequest)
    state = get_state()
    grammar = await compile_format(state, body)
    wanted = body.logprobs
    subs: list[Submission] = []
    for prompt in body.prompt_list():  # n choices per prompt, prompt by prompt
        subs += [Submission(prompt, None, _choice_fields(body, len(subs) + i), body.max_tokens,
                            COMPLETION_MAX_TOKENS, logprobs=_engine_logprobs(wanted),
                            grammar=grammar) for i in range(body.n)]
    choices = await _start_all(state, subs, body.n, arrival)
    echo = [_prompt_text(state, s.prompt) for s in subs] if body.echo else None
    fmt = ChunkFormat("text_completion", "cmpl-", choices, top_logprobs=wanted, echo=echo)
    return await _respond(choices, fmt, body.stream, _include_usage(body))


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    """``n`` assistant replies to ``messages``, through the chat template."""
    arrival = trio.current_time()
    body = await parse_body(ChatCompletionRequest)
    state = get_state()
    _check_tools(state, body)
    grammar = await compile_format(state, body)
    wanted = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    subs = [Submission(None, body.messages, _choice_fields(body, i), max_tokens,
                       CHAT_MAX_TOKENS, logprobs=_engine_logprobs(wanted), grammar=grammar)
            for i in range(body.n)]
    choices = await _start_all(state, subs, body.n, arrival)
    fmt = ChunkFormat("chat.completion", "chatcmpl-", choices, top_logprobs=wanted)
    return await _respond(choices, fmt, body.stream, _include_usage(body))


def _choice_fields(body: Body, index: int) -> Body:
    """The fields of choice ``index``: the request's, with the choice's own seed."""
    seed = choice_seed(body.seed, index)
    return body if seed == body.seed else body.model_copy(update={"seed": seed})


def _engine_logprobs(wanted: int | None) -> int:
    return max(1, wanted) if wanted is not None else 0


def _prompt_text(state: ServerState, prompt: str | list[int] | None) -> str:
    if isinstance(prompt, str) or prompt is None:
        return prompt or ""
    assert state.engine is not None  # the request has started
    return str(state.engine.tokenizer.decode(prompt))


def _check_tools(state: ServerState, body: ChatCompletionRequest) -> None:
    """Refuse ``tools`` (422): no template here is given tools, no tool call is parsed."""
    if not body.wants_tools():
        return
    template = getattr(state.engine.tokenizer, "chat_template", None) if state.engine else None
    why = ("tool calls are not parsed by this server" if template and "tools" in template
           else f"the chat template of {state.model_name} has no tool support")
    raise APIError(422, f"tools: {why}", "tools_unsupported")


async def _start_all(state: ServerState, subs: list[Submission], n: int, arrival: float
                     ) -> Choices:
    """Start every choice; if one is refused, abort those already started."""
    gens: list[Generation] = []
    try:
        for sub in subs:
            gens.append(await start(state, sub, arrival))
    except BaseException:
        for gen in gens:
            gen.handle.abort()
        raise
    app = cast(QuartTrio, current_app)
    return Choices(gens, n, app.nursery)


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


def _reason(end: Outcome) -> str | None:
    return "stop" if end.finish_reason == "eos" else end.finish_reason


async def _respond(choices: Choices, fmt: ChunkFormat, stream: bool, usage: bool
                   ) -> Response:
    if stream:
        return sse.stream_response(_chunks(choices, fmt, usage))
    return jsonify(await _collect(choices, fmt))


async def _chunks(choices: Choices, fmt: ChunkFormat, include_usage: bool
                  ) -> AsyncIterator[bytes]:
    with choices:
        yield _opening(choices, fmt, include_usage)
        heartbeat_s = choices.gens[0].state.config.heartbeat_s
        while True:
            try:
                item = await choices.next(heartbeat_s)
                frames, ended = (sse.HEARTBEAT, False) if item is None else _chunk_frames(
                    choices, fmt, *item, include_usage)
            except Exception:  # noqa: BLE001 - the stream must still end with [DONE]
                log.exception("stream %s failed", choices.request_id)
                choices.fail()
                yield sse.event(error_body("inference failed", "server_error",
                                           "inference_failed")) + sse.DONE
                return
            yield frames
            if ended:
                return


def _opening(choices: Choices, fmt: ChunkFormat, usage: bool) -> bytes:
    """Each chat choice's role chunk, or each echoed prompt, before any token."""
    frames = []
    for index in range(len(choices.gens)):
        if fmt.chat:
            frames.append(sse.event(fmt.chunk(index, {"role": "assistant", "content": ""},
                                              usage=usage)))
        elif fmt.echo is not None:
            frames.append(sse.event(fmt.chunk(index, fmt.echo[index], usage=usage)))
    return b"".join(frames)


def _chunk_frames(choices: Choices, fmt: ChunkFormat, index: int, out: StepOutput,
                  usage: bool) -> tuple[bytes, bool]:
    """The ``data:`` events for one output, and whether the stream has ended.

    It ends after the last choice's last output (usage chunk, ``[DONE]``) or at the first
    choice that fails (an error chunk, ``[DONE]``; the other choices are aborted).
    """
    frames = []
    logprobs = fmt.logprobs(index, [out]) if out.logprob is not None else None
    if out.text_delta or logprobs is not None:
        frames.append(sse.event(fmt.chunk(index, fmt.delta(out.text_delta),
                                          logprobs=logprobs, usage=usage)))
    if not out.finished:
        return b"".join(frames), False
    end = outcome(out)
    if end.code is not None and end.code != "TIMEOUT":
        frames.append(sse.event(error_body(end.message, "server_error", end.code.lower())))
        return b"".join(frames) + sse.DONE, True
    frames.append(sse.event(fmt.chunk(index, fmt.delta(None), finish_reason=_reason(end),
                                      usage=usage)))
    if not choices.finished:
        return b"".join(frames), False
    if usage:
        frames.append(sse.event(fmt.usage_chunk()))
    return b"".join(frames) + sse.DONE, True


async def _collect(choices: Choices, fmt: ChunkFormat) -> dict[str, Any]:
    """Run every choice to its end and build the single response body."""
    count = len(choices.gens)
    texts: list[list[str]] = [[] for _ in range(count)]
    outputs: list[list[StepOutput]] = [[] for _ in range(count)]
    reasons: list[str | None] = [None] * count
    with choices:
        while not choices.finished:
            item = await choices.next()
            if item is None:  # no wait limit was given; kept for type narrowing
                continue
            index, out = item
            texts[index].append(out.text_delta)
            if out.logprob is not None:
                outputs[index].append(out)
            if out.finished:
                reasons[index] = _finish(out)
    logprobs = [fmt.logprobs(i, outputs[i]) if fmt.top_logprobs is not None else None
                for i in range(count)]
    return fmt.final(["".join(t) for t in texts], reasons, logprobs)


def _finish(out: StepOutput) -> str | None:
    """A finished output's finish reason, or the APIError its failure answers with."""
    end = outcome(out)
    if end.code is not None and end.code != "TIMEOUT":
        status = ERROR_STATUS.get(end.code, 500)
        raise APIError(status, end.message, end.code.lower(),
                       {"Retry-After": "1"} if status == 503 else None)
    return _reason(end)
