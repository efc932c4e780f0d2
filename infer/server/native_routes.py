"""infer's own API: the native event stream (``/v1/generate``, resumable), attention
inspection, and tokenizing.

A native stream is ``started`` → (``token`` [``trace``])* with ``metrics`` interleaved →
exactly one of ``done`` or ``error`` (:class:`NativeWriter`, through
:func:`~infer.server.respond.respond`); every event carries its number in the stream as its
SSE ``id:``. With a client ``request_id`` the stream outlives its connection
(:mod:`infer.server.resume`).
"""

from __future__ import annotations

from typing import Any, cast

import trio
from quart import Blueprint, Response, current_app, jsonify, request
from quart_trio import QuartTrio

from infer.api import native
from infer.api.native import Event
from infer.engine.params import DEFAULT_MAX_TOKENS
from infer.engine.request import FinishReason, StepOutput, TraceSpec
from infer.server import resume, sse
from infer.server.admission import Prompt, admit, check_model, encode, parse_body
from infer.server.errors import APIError, ErrorCode
from infer.server.openai_routes import decode, tool_plan
from infer.server.respond import Writer, frames, respond
from infer.server.schemas import (
    DetokenizeRequest,
    GenerateRequest,
    InspectRequest,
    TokenizeRequest,
)
from infer.server.state import ServerState, get_state
from infer.server.stream import RequestStream
from infer.server.worker import WorkerStoppedError

blueprint = Blueprint("native", __name__)

DECIMALS = 6  # attention weights: float32 carries about 7 significant digits


@blueprint.post("/v1/generate")
async def generate() -> Response:
    """Start a generation and stream its events (or resume one, given its `request_id`)."""
    arrival = trio.current_time()
    state = get_state()
    body = await parse_body(GenerateRequest)
    if body.request_id is not None:
        return await _resumable(state, body, arrival)
    writer = await _admit(state, body, arrival)
    return await respond(writer, state.config.heartbeat_s)


@blueprint.delete("/v1/generate/<request_id>")
async def stop_generate(request_id: str) -> Response:
    """Stop a resumable generation now (its stream ends with a `stopped` error event)."""
    get_state().resumable.stop(request_id)
    return jsonify({"request_id": request_id, "stopped": True})


async def _admit(
    state: ServerState, body: GenerateRequest, arrival: float, guard: bool = True
) -> NativeWriter:
    trace = TraceSpec(body.trace.top_k, body.trace.layer) if body.trace else None
    admitted = await admit(
        state,
        [Prompt(body.prompt, body.messages)],
        body,
        arrival=arrival,
        default_max_tokens=DEFAULT_MAX_TOKENS,
        trace=trace,
        timeout_s=body.timeout_s,
        guard=guard,
    )
    return NativeWriter(admitted.stream, state.model_name, body.metrics_every)


async def _resumable(state: ServerState, body: GenerateRequest, arrival: float) -> Response:
    """Read the request `body.request_id` names, starting it if it is not known yet."""
    assert body.request_id is not None  # checked by the caller
    key = resume.fingerprint(body)
    after = resume.last_event_id(request.headers.get("Last-Event-ID"))
    log_ = state.resumable.find(body.request_id, key)
    if log_ is None:
        writer = await _admit(state, body, arrival, guard=False)
        try:  # another POST with this id may have started it while we tokenized
            log_ = state.resumable.find(body.request_id, key)
        except APIError:
            writer.stream.close()
            raise
        if log_ is None:
            nursery = cast(QuartTrio, current_app).nursery  # outlives this HTTP request
            events = frames(writer, state.config.heartbeat_s)
            log_ = state.resumable.open(nursery, body.request_id, key, events)
            return sse.stream_response(log_.read(after))
        writer.stream.close()
    state.metrics.stream_resumes += 1
    return sse.stream_response(log_.read(after))


class NativeWriter(Writer):
    """The native events of one request, each with its ``id:`` (its number, from 0).

    Args:
        stream: The request's stream (one choice).
        model: The served model's name.
        metrics_every: Send a ``metrics`` event every this many tokens.
    """

    def __init__(self, stream: RequestStream, model: str, metrics_every: int | None) -> None:
        super().__init__(stream, streamed=True)
        self.model = model
        self.metrics_every = metrics_every
        self.seq = 0
        self.reason: FinishReason | None = None

    def start(self) -> bytes:
        return self._frames([native.started(self.stream.id, self.model, self.stream.stats.created)])

    async def output(self, index: int, out: StepOutput) -> bytes:
        rate = None
        if native.metrics_due(out, self.metrics_every):
            stats = self.stream.stats
            tokens = self.stream.choices[0].tokens
            rate = native.metrics(tokens, stats.arrival, stats.first_token_at, trio.current_time())
        if isinstance(out.outcome, FinishReason):
            self.reason = out.outcome
        return self._frames(native.events(out, rate))

    async def finish(self) -> bytes:
        assert self.reason is not None  # the last output finished the request
        return self._frames([native.done(self.reason, self.stream.usage())])

    def failed(self, error: APIError) -> bytes:
        code = error.code
        event = native.error(code.name, error.message, code.retryable, self.stream.usage())
        return self._frames([event])

    def _frames(self, events: list[Event]) -> bytes:
        data = b"".join(sse.event(e, name, self.seq + i) for i, (e, name) in enumerate(events))
        self.seq += len(events)
        return data


# --- inspection and tokens -------------------------------------------------------------------


@blueprint.post("/v1/inspect/attention")
async def attention() -> Response:
    """`{layer, head, tokens, attn}` with `attn[i][j]` the weight query i gives key j.

    The forward runs on the engine thread, between two steps.
    """
    state = get_state()
    body = await parse_body(InspectRequest)
    engine, worker = state.require_ready()
    check_model(state, body.model)
    config = engine.model.config
    if body.layer >= config.num_hidden_layers:
        raise APIError(
            ErrorCode.INVALID_VALUE,
            f"layer must be in [0, {config.num_hidden_layers - 1}], got {body.layer}",
        )
    if body.head >= config.num_attention_heads:
        raise APIError(
            ErrorCode.INVALID_VALUE,
            f"head must be in [0, {config.num_attention_heads - 1}], got {body.head}",
        )
    [ids] = await encode(state, engine, [Prompt(body.prompt, body.messages)])
    limit = state.config.max_inspect_tokens
    if len(ids) > limit:
        raise APIError(
            ErrorCode.CONTEXT_LENGTH_EXCEEDED,
            f"the prompt is {len(ids)} tokens; attention inspection takes at most {limit}",
        )
    try:
        matrix = await worker.call(lambda e: e.attention_matrix(ids, body.layer, body.head))
    except WorkerStoppedError:
        state.require_ready()
        raise APIError(ErrorCode.SHUTTING_DOWN) from None
    rows = [[round(x, DECIMALS) for x in row] for row in matrix.tolist()]
    tokens = [str(engine.tokenizer.decode([i])) for i in ids]
    return jsonify({"layer": body.layer, "head": body.head, "tokens": tokens, "attn": rows})


@blueprint.post("/tokenize")
async def tokenize() -> Response:
    """The token ids the generation routes would feed the model for this prompt.

    `{tokens, count, max_model_len}`, and `token_strs` when asked; the same prompt-size
    limit as the generation routes.
    """
    body = await parse_body(TokenizeRequest)
    state = get_state()
    engine, _ = state.require_ready()
    check_model(state, body.model)
    plan = None
    if body.tools:
        plan = tool_plan(state, [t.function for t in body.tools], "auto", None, None)
    [ids] = await encode(
        state,
        engine,
        [Prompt(body.prompt, body.messages, plan)],
        add_generation_prompt=body.add_generation_prompt,
        add_special_tokens=body.add_special_tokens,
        allow_empty=True,
    )
    answer: dict[str, Any] = {
        "tokens": ids,
        "count": len(ids),
        "max_model_len": engine.max_seq_len,
    }
    if body.return_token_strs:
        answer["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
    return jsonify(answer)


@blueprint.post("/detokenize")
async def detokenize() -> Response:
    """`{prompt}`: the text of `tokens`."""
    body = await parse_body(DetokenizeRequest)
    state = get_state()
    engine, _ = state.require_ready()
    check_model(state, body.model)
    vocab = engine.model.config.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(ErrorCode.INVALID_VALUE, f"tokens: ids must be in [0, {vocab})")
    return jsonify({"prompt": await decode(state, body.tokens)})
