"""OpenAI-compatible routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``.

``stream: true`` sends ``data: {chunk}`` events, a last chunk with ``finish_reason``, a
usage chunk when ``stream_options.include_usage`` is set, then ``data: [DONE]``. An error
after the stream started (shutdown, out of memory) is an error chunk before ``[DONE]``.
``stream: false`` sends one JSON body. Our ``eos`` finish reason is OpenAI's ``stop``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import trio
from quart import Blueprint, Response, jsonify

from infer.engine.request import StepOutput
from infer.server import sse
from infer.server.errors import APIError, error_body
from infer.server.generation import Generation, Submission, outcome, parse_body, start
from infer.server.openai_format import ChunkFormat
from infer.server.schemas import ChatCompletionRequest, CompletionRequest
from infer.server.state import get_state

log = logging.getLogger("infer.server")

blueprint = Blueprint("openai", __name__)

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_MAX_TOKENS = 256

# Error codes of a request that failed mid-way, as the status of a non-streamed answer.
ERROR_STATUS = {"CANCELLED": 503, "OVERLOADED": 503, "OUT_OF_MEMORY": 503,
                "INVALID_REQUEST": 422, "INFERENCE_FAILED": 500}


@blueprint.get("/v1/models")
async def models() -> Response:
    """The one model this server serves."""
    state = get_state()
    return jsonify({"object": "list", "data": [
        {"id": state.model_name, "object": "model", "created": 0, "owned_by": "infer"}]})


@blueprint.post("/v1/completions")
async def completions() -> Response:
    """A text completion of ``prompt``."""
    arrival = trio.current_time()
    body = await parse_body(CompletionRequest)
    wanted = body.logprobs
    sub = Submission(body.prompt, None, body, body.max_tokens, COMPLETION_MAX_TOKENS,
                     logprobs=max(1, wanted) if wanted is not None else 0)
    gen = await start(get_state(), sub, arrival)
    fmt = ChunkFormat("text_completion", "cmpl-", gen, top_logprobs=wanted)
    return await _respond(gen, fmt, body.stream, _include_usage(body))


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    """The assistant's reply to ``messages``, through the chat template."""
    arrival = trio.current_time()
    body = await parse_body(ChatCompletionRequest)
    wanted = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_tokens if body.max_tokens is not None else body.max_completion_tokens
    sub = Submission(None, body.messages, body, max_tokens, CHAT_MAX_TOKENS,
                     logprobs=max(1, wanted) if wanted is not None else 0)
    gen = await start(get_state(), sub, arrival)
    fmt = ChunkFormat("chat.completion", "chatcmpl-", gen, top_logprobs=wanted)
    return await _respond(gen, fmt, body.stream, _include_usage(body))


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


async def _respond(gen: Generation, fmt: ChunkFormat, stream: bool, usage: bool) -> Response:
    if stream:
        return sse.stream_response(_chunks(gen, fmt, usage))
    return jsonify(await _collect(gen, fmt))


async def _chunks(gen: Generation, fmt: ChunkFormat, include_usage: bool
                  ) -> AsyncIterator[bytes]:
    with gen:
        if fmt.chat:
            yield sse.event(fmt.chunk({"role": "assistant", "content": ""}, usage=include_usage))
        heartbeat_s = gen.state.config.heartbeat_s
        while True:
            try:
                out = await gen.next(heartbeat_s)
                frames = sse.HEARTBEAT if out is None else _chunk_frames(
                    gen, fmt, out, include_usage)
            except Exception:  # noqa: BLE001 - the stream must still end with [DONE]
                log.exception("stream %s failed", gen.request_id)
                yield sse.event(error_body("inference failed", "server_error",
                                           "inference_failed")) + sse.DONE
                return
            yield frames
            if gen.finished:
                return


def _chunk_frames(gen: Generation, fmt: ChunkFormat, out: StepOutput, usage: bool) -> bytes:
    """The ``data:`` events for one output; after the last one, ``[DONE]``."""
    frames = []
    logprobs = fmt.logprobs([out]) if out.logprob is not None else None
    if out.text_delta or logprobs is not None:
        frames.append(sse.event(fmt.chunk(fmt.delta(out.text_delta), logprobs=logprobs,
                                          usage=usage)))
    if not out.finished:
        return b"".join(frames)
    end = outcome(out)
    if end.code is not None and end.code != "TIMEOUT":
        frames.append(sse.event(error_body(end.message, "server_error", end.code.lower())))
    else:
        reason = "stop" if end.finish_reason == "eos" else end.finish_reason
        frames.append(sse.event(fmt.chunk(fmt.delta(None), finish_reason=reason, usage=usage)))
        if usage:
            frames.append(sse.event(fmt.usage_chunk()))
    frames.append(sse.DONE)
    return b"".join(frames)


async def _collect(gen: Generation, fmt: ChunkFormat) -> dict[str, Any]:
    """Run the request to its end and build the single response body."""
    text: list[str] = []
    outputs: list[StepOutput] = []
    with gen:
        while True:
            out = await gen.next()
            if out is None:  # no wait limit was given; kept for type narrowing
                continue
            text.append(out.text_delta)
            if out.logprob is not None:
                outputs.append(out)
            if gen.finished:
                break
    end = outcome(out)
    if end.code is not None and end.code != "TIMEOUT":
        status = ERROR_STATUS.get(end.code, 500)
        raise APIError(status, end.message, end.code.lower(),
                       {"Retry-After": "1"} if status == 503 else None)
    reason = "stop" if end.finish_reason == "eos" else end.finish_reason
    logprobs = fmt.logprobs(outputs) if fmt.top_logprobs is not None else None
    return fmt.final("".join(text), reason, logprobs)

