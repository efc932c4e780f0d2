"""infer's own API (:mod:`infer.api.native`): the native event stream (``/v1/generate``,
resumable), attention inspection, and tokenizing.

With a client ``request_id`` a native stream outlives its connection
(:mod:`infer.server.host.resume`): its events are read into a log that connections read.
"""

from __future__ import annotations

from functools import partial
from typing import cast

import trio
from quart import Blueprint, Response, current_app, jsonify, request
from quart_trio import QuartTrio

from infer.api.errors import APIError, ErrorCode
from infer.api.native.bodies import (
    AttentionResponse,
    DetokenizeResponse,
    StopResponse,
    TokenizeResponse,
)
from infer.api.native.models import (
    DetokenizeRequest,
    GenerateRequest,
    InspectRequest,
    TokenizeRequest,
)
from infer.api.native.writer import NativeWriter
from infer.api.writer import Ticket
from infer.server.edge.exchange import answer, frames, parse_body
from infer.server.edge.framing import stream_response
from infer.server.edge.openapi import documented
from infer.server.host import resume
from infer.server.host.admission import admit, decode, encode, generating, tool_plan
from infer.server.host.state import ServerState, get_state
from infer.server.host.worker import WorkerStoppedError

blueprint = Blueprint("native", __name__)

DECIMALS = 6  # attention weights: float32 carries about 7 significant digits


@blueprint.post("/v1/generate")
@documented("native", GenerateRequest)
async def generate() -> Response:
    """Start a generation and stream its events (or resume one, given its `request_id`)."""
    arrival = trio.current_time()
    state = get_state()
    body = await parse_body(GenerateRequest)
    if body.request_id is not None:
        return await _resumable(state, body, arrival)
    return await answer(body.engine_request(), arrival, partial(_writer, body))


@blueprint.delete("/v1/generate/<request_id>")
@documented("native", response=StopResponse, statuses=(404,))
async def stop_generate(request_id: str) -> Response:
    """Stop a resumable generation now (its stream ends with a `stopped` error event)."""
    get_state().resumable.stop(request_id)
    return jsonify(StopResponse(request_id=request_id, stopped=True))


def _writer(body: GenerateRequest, ticket: Ticket) -> NativeWriter:
    return NativeWriter(ticket, body.metrics_every, trio.current_time)


async def _resumable(state: ServerState, body: GenerateRequest, arrival: float) -> Response:
    """Read the request `body.request_id` names, starting it if it is not known yet."""
    assert body.request_id is not None  # checked by the caller
    key = resume.fingerprint(body)
    after = resume.last_event_id(request.headers.get("Last-Event-ID"))
    log_ = state.resumable.find(body.request_id, key)
    if log_ is None:
        admitted = await admit(state, body.engine_request(), arrival)  # read by the log
        stream, writer = admitted.stream, _writer(body, admitted.ticket)
        try:  # another POST with this id may have started it while we tokenized
            log_ = state.resumable.find(body.request_id, key)
        except APIError:
            stream.close()
            raise
        if log_ is None:
            nursery = cast(QuartTrio, current_app).nursery  # outlives this HTTP request
            events = frames(stream, writer, state.config.heartbeat_s)
            log_ = state.resumable.open(nursery, body.request_id, key, events)
            return stream_response(log_.read(after))
        stream.close()
    state.models.metrics_for(body.model).stream_resumes += 1
    return stream_response(log_.read(after))


# --- inspection and tokens -------------------------------------------------------------------


@blueprint.post("/v1/inspect/attention")
@documented("native", InspectRequest, AttentionResponse)
async def attention() -> Response:
    """`{layer, head, tokens, attn}` with `attn[i][j]` the weight query i gives key j.

    The forward runs on the engine thread, between two steps.
    """
    state = get_state()
    body = await parse_body(InspectRequest)
    async with generating(state, body.model) as (_, engine, worker):
        config = engine.model.config
        for name, value, count in (
            ("layer", body.layer, config.num_hidden_layers),
            ("head", body.head, config.num_attention_heads),
        ):
            if value >= count:
                raise APIError(
                    ErrorCode.INVALID_VALUE, f"{name} must be in [0, {count - 1}], got {value}"
                )
        [ids] = await encode(state, engine, [body.as_prompt()])
        limit = state.config.max_inspect_tokens
        if len(ids) > limit:
            raise APIError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"the prompt is {len(ids)} tokens; attention inspection takes at most {limit}",
            )
        try:
            matrix = await worker.call(lambda e: e.attention_matrix(ids, body.layer, body.head))
        except WorkerStoppedError:
            state.require_open()
            raise APIError(ErrorCode.SHUTTING_DOWN) from None
    rows = [[round(x, DECIMALS) for x in row] for row in matrix.tolist()]
    tokens = [str(engine.tokenizer.decode([i])) for i in ids]
    return jsonify(AttentionResponse(layer=body.layer, head=body.head, tokens=tokens, attn=rows))


@blueprint.post("/tokenize")
@documented("tokens", TokenizeRequest, TokenizeResponse)
async def tokenize() -> Response:
    """The token ids the generation routes would feed the model for this prompt.

    `{tokens, count, max_model_len}`, and `token_strs` when asked; the same prompt-size
    limit as the generation routes.
    """
    body = await parse_body(TokenizeRequest)
    state = get_state()
    async with generating(state, body.model) as (_, engine, _):
        [ids] = await encode(
            state,
            engine,
            [body.as_prompt()],
            tool_plan(engine, body.tool_choice()),
            add_generation_prompt=body.add_generation_prompt,
            add_special_tokens=body.add_special_tokens,
            allow_empty=True,
        )
    answer = TokenizeResponse(tokens=ids, count=len(ids), max_model_len=engine.max_seq_len)
    if body.return_token_strs:
        answer["token_strs"] = cast(list[str], engine.tokenizer.convert_ids_to_tokens(ids))
    return jsonify(answer)


@blueprint.post("/detokenize")
@documented("tokens", DetokenizeRequest, DetokenizeResponse)
async def detokenize() -> Response:
    """`{prompt}`: the text of `tokens`."""
    body = await parse_body(DetokenizeRequest)
    async with generating(get_state(), body.model) as (_, engine, _):
        vocab = engine.model.config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(ErrorCode.INVALID_VALUE, f"tokens: ids must be in [0, {vocab})")
        return jsonify(DetokenizeResponse(prompt=await decode(engine, body.tokens)))
