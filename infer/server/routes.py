"""The API's routes: OpenAI completions and chat, the native event stream, attention
inspection, tokenizing, and the model list.

Each generation route parses its body (:func:`~infer.server.admission.parse_body`), admits
the request (:func:`~infer.server.admission.admit`), and reads the one
:class:`~infer.server.stream.RequestStream` it gets back, turning each ``(index, output)``
into OpenAI chunks or native events with the pure functions of :mod:`infer.api`. A stream
always ends with exactly one terminal: ``[DONE]`` (after an error chunk if the request
failed part-way) or a native ``done``/``error`` event.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, cast

import trio
from quart import Blueprint, Response, current_app, jsonify, request
from quart_trio import QuartTrio

from infer.api import native, openai
from infer.api.chat import ReplyParser
from infer.api.tools import Mode, Tool, ToolPlan, tool_format
from infer.engine.params import DEFAULT_MAX_TOKENS
from infer.engine.request import ErrorCode, StepOutput, TraceSpec
from infer.server import resume, sse
from infer.server.admission import Prompt, admit, check_model, encode, parse_body
from infer.server.errors import APIError
from infer.server.schemas import (
    MAX_CHOICES,
    MAX_LOGPROBS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FunctionDefinition,
    GenerateRequest,
    InspectRequest,
    NamedToolChoice,
    TokenizeRequest,
)
from infer.server.state import ServerState, get_state
from infer.server.stream import RequestStream
from infer.server.worker import WorkerStoppedError

log = logging.getLogger("infer.server")

blueprint = Blueprint("api", __name__)

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DECIMALS = 6  # attention weights: float32 carries about 7 significant digits


# --- OpenAI -------------------------------------------------------------------------------


@blueprint.get("/v1/models")
async def models() -> Response:
    """The one model this server serves, under each of its served names, with its context
    length."""
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


# --- what a gateway asks of a worker (SGLang Model Gateway's probes) -----------------------


@blueprint.get("/get_model_info")
@blueprint.get("/model_info")
async def model_info() -> Response:
    """The model, in SGLang's shape (the gateway names its workers' model from it)."""
    state = get_state()
    engine, _ = state.require_ready()
    config = engine.model.config
    return jsonify(
        {
            "model_path": state.config.engine.model,
            "tokenizer_path": state.config.engine.model,
            "served_model_name": state.model_name,
            "is_generation": True,
            "supports_vision": False,
            "model_type": config.architecture,
            "architectures": [config.architecture],
            "max_context_length": state.max_model_len,
            "max_req_input_len": state.max_model_len - 1,
            "vocab_size": config.vocab_size,
            "num_hidden_layers": config.num_hidden_layers,
            "num_attention_heads": config.num_attention_heads,
            "eos_token_ids": sorted(engine.eos_token_ids),
            "weight_version": "default",
        }
    )


@blueprint.get("/get_server_info")
@blueprint.get("/server_info")
async def server_info() -> Response:
    """The server's limits and version, in SGLang's shape."""
    from infer import __version__

    state = get_state()
    engine, _ = state.require_ready()
    return jsonify(
        {
            "model_path": state.config.engine.model,
            "tokenizer_path": state.config.engine.model,
            "served_model_name": state.model_name,
            "served_model_names": list(state.model_names),
            "context_length": state.max_model_len,
            "max_running_requests": engine.config.max_batch_size,
            "max_total_num_tokens": engine.blocks.num_blocks * engine.config.block_size,
            "page_size": engine.config.block_size,
            "dtype": engine.config.dtype,
            "max_inspect_tokens": state.config.max_inspect_tokens,
            "max_logprobs": MAX_LOGPROBS,
            "max_choices": MAX_CHOICES,
            "version": __version__,
            "backend": "infer",
        }
    )


@blueprint.post("/v1/completions")
async def completions() -> Response:
    """Text completions of ``prompt`` (one or a list), ``n`` per prompt."""
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
        texts = [p if isinstance(p, str) else await _decode(state, p) for p in body.prompt_list()]
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
    return await _respond(state, stream, head, body.stream, prompts, echo)


@blueprint.post("/v1/chat/completions")
async def chat_completions() -> Response:
    """``n`` assistant replies to ``messages``, through the chat template."""
    arrival = trio.current_time()
    body = await parse_body(ChatCompletionRequest)
    state = get_state()
    plan = _tool_plan(state, body) if body.wants_tools() else None
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
    thinking = admitted.thinking
    separate = body.separate_reasoning
    replies = None
    if plan is not None or (thinking is not None and separate):
        replies = [ReplyParser(plan, thinking, separate) for _ in stream.choices]
    prompts = admitted.prompt_ids * body.n
    return await _respond(state, stream, head, body.stream, prompts, replies=replies)


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


def _tool_plan(state: ServerState, body: ChatCompletionRequest) -> ToolPlan:
    """A chat request's tool plan."""
    choice = body.tool_choice
    return tool_plan(
        state,
        [t.function for t in body.tools or []],
        choice if isinstance(choice, str) else None,
        choice.function.name if isinstance(choice, NamedToolChoice) else None,
        body.parallel_tool_calls,
    )


def _engine_logprobs(wanted: int | None) -> int:
    return max(1, wanted) if wanted is not None else 0


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)


Scorer = Callable[[int, StepOutput], Awaitable[openai.PromptScores]]


async def _respond(
    state: ServerState,
    stream: RequestStream,
    head: openai.Head,
    streamed: bool,
    prompts: list[list[int]],
    echo: list[str] | None = None,
    replies: list[ReplyParser] | None = None,
) -> Response:
    """The streamed or whole answer; ``prompts`` are each choice's prompt ids."""

    async def score(index: int, out: StepOutput) -> openai.PromptScores:
        return await _prompt_scores(state, prompts[index], out, head.echo_scores)

    if streamed:
        return sse.stream_response(
            _chunks(stream, head, echo, state.config.heartbeat_s, score, replies)
        )
    return jsonify(await _collect(stream, head, echo, score, replies))


async def _prompt_scores(
    state: ServerState, ids: list[int], out: StepOutput, offsets: bool
) -> openai.PromptScores:
    """An output's prompt scores with the text of each token they name (in a thread) and,
    when ``offsets``, each prompt token's offset in the prompt's text."""
    engine = state.engine
    assert engine is not None and out.prompt_logprobs is not None  # a scored stream is open
    scores, tokenizer = out.prompt_logprobs, engine.tokenizer

    def run() -> openai.PromptScores:
        named = {*ids, *(t for s in scores for t, _ in s.top)}
        texts = {t: str(tokenizer.decode([t])) for t in named}
        at = [len(tokenizer.decode(ids[:i])) for i in range(len(ids))] if offsets else []
        return openai.PromptScores(ids, scores, texts, at)

    return await trio.to_thread.run_sync(run)


async def _chunks(
    stream: RequestStream,
    head: openai.Head,
    echo: list[str] | None,
    heartbeat_s: float,
    score: Scorer,
    replies: list[ReplyParser] | None = None,
) -> AsyncIterator[bytes]:
    """``data:`` events until every choice has ended (or one failed), then ``[DONE]``.

    An echo with log-probabilities waits for the prompt's scores: it goes out with them,
    in the chunk before the choice's first generated text.
    """
    with stream:
        yield _frames(openai.opening(head, len(stream.choices), None if head.echo_scores else echo))
        while True:
            try:
                item = await stream.next(heartbeat_s)
                if item is None:
                    yield sse.HEARTBEAT
                    continue
                index, out = item
                echoed = echo[index] if echo is not None else None
                chunks = []
                if out.prompt_logprobs is not None:
                    prompt = await score(index, out)
                    chunks.append(openai.prompt_chunk(head, index, prompt, echoed))
                offset = len(echoed) if head.echo_scores and echoed else 0
                reply = replies[index] if replies else None
                frames = _frames(chunks + openai.output_chunks(head, index, out, reply, offset))
            except Exception:  # noqa: BLE001 - the stream must still end with [DONE]
                log.exception("stream %s failed", stream.id)
                stream.fail()
                yield sse.event(openai.error_chunk(ErrorCode.INFERENCE_FAILED)) + sse.DONE
                return
            if failed(out):  # the other choices end with the stream (aborted)
                yield frames + sse.DONE
                return
            if stream.finished:
                if head.usage_field:
                    frames += sse.event(openai.usage_chunk(head, stream.usage()))
                yield frames + sse.DONE
                return
            yield frames


def _frames(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(sse.event(c) for c in chunks)


def failed(out: StepOutput) -> bool:
    """Whether this output ends its choice with an error (a timeout ends it ``length``)."""
    return isinstance(out.outcome, ErrorCode) and openai.finish_reason(out.outcome) is None


async def _collect(
    stream: RequestStream,
    head: openai.Head,
    echo: list[str] | None,
    score: Scorer,
    replies: list[ReplyParser] | None = None,
) -> dict[str, Any]:
    """Run every choice to its end and build the one response body.

    Raises:
        APIError: A choice failed (its code gives the status).
    """
    count = len(stream.choices)
    texts: list[list[str]] = [[] for _ in range(count)]
    choices = [openai.Choice("", None, []) for _ in range(count)]
    outcomes: list[Any] = [None] * count
    with stream:
        while not stream.finished:
            item = await stream.next()
            assert item is not None  # no wait limit was given
            index, out = item
            texts[index].append(out.text_delta)
            if out.logprobs is not None:
                choices[index].outputs.append(out)
            if out.prompt_logprobs is not None:
                choices[index].prompt = await score(index, out)
            if out.outcome is not None:
                if failed(out):
                    raise APIError(cast(ErrorCode, out.outcome), out.message)
                choices[index].finish_reason = openai.finish_reason(out.outcome)
                outcomes[index] = out.outcome
    for index, (choice, text) in enumerate(zip(choices, texts, strict=True)):
        choice.text = "".join(text)
        if replies:
            choice.reply = replies[index]
            choice.reply.feed(choice.text)
            choice.reply.finish()
            if choice.finish_reason is not None and choice.reply.calls:
                choice.finish_reason = openai.finish_reason(outcomes[index], choice.reply)
    return openai.body(head, choices, stream.usage(), echo)


# --- native ---------------------------------------------------------------------------------


@blueprint.post("/v1/generate")
async def generate() -> Response:
    """Start a generation and stream its events (or resume one, given its ``request_id``)."""
    arrival = trio.current_time()
    state = get_state()
    body = await parse_body(GenerateRequest)
    if body.request_id is not None:
        return await _resumable(state, body, arrival)
    stream = await _admit_native(state, body, arrival)
    return sse.stream_response(_events(state, stream, body.metrics_every))


@blueprint.delete("/v1/generate/<request_id>")
async def stop_generate(request_id: str) -> Response:
    """Stop a resumable generation now (its stream ends with a ``stopped`` error event)."""
    get_state().resumable.stop(request_id)
    return jsonify({"request_id": request_id, "stopped": True})


async def _admit_native(
    state: ServerState, body: GenerateRequest, arrival: float, guard: bool = True
) -> RequestStream:
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
    return admitted.stream


async def _resumable(state: ServerState, body: GenerateRequest, arrival: float) -> Response:
    """Read the request ``body.request_id`` names, starting it if it is not known yet."""
    assert body.request_id is not None  # checked by the caller
    key = resume.fingerprint(body)
    after = resume.last_event_id(request.headers.get("Last-Event-ID"))
    log_ = state.resumable.find(body.request_id, key)
    if log_ is None:
        stream = await _admit_native(state, body, arrival, guard=False)
        try:  # another POST with this id may have started it while we tokenized
            log_ = state.resumable.find(body.request_id, key)
        except APIError:
            stream.close()
            raise
        if log_ is None:
            nursery = cast(QuartTrio, current_app).nursery  # outlives this HTTP request
            events = _events(state, stream, body.metrics_every)
            log_ = state.resumable.open(nursery, body.request_id, key, events)
            return sse.stream_response(log_.read(after))
        stream.close()
    state.metrics.stream_resumes += 1
    return sse.stream_response(log_.read(after))


async def _events(
    state: ServerState, stream: RequestStream, metrics_every: int | None
) -> AsyncIterator[bytes]:
    """The stream's events, each with its ``id:`` (its number in the stream, from 0)."""
    with stream:
        yield sse.event(*native.started(stream.id, state.model_name, stream.stats.created), 0)
        seq = 1
        heartbeat_s = state.config.heartbeat_s
        while not stream.finished:
            try:
                item = await stream.next(heartbeat_s)
                if item is None:
                    yield sse.HEARTBEAT
                    continue
                _, out = item
                rate = None
                if native.metrics_due(out, metrics_every):
                    stats = stream.stats
                    rate = native.metrics(
                        stream.choices[0].tokens,
                        stats.arrival,
                        stats.first_token_at,
                        trio.current_time(),
                    )
                events = native.events(out, stream.usage(), rate)
            except Exception:  # noqa: BLE001 - the stream must still end with one terminal
                log.exception("stream %s failed", stream.id)
                stream.fail()
                code = ErrorCode.INFERENCE_FAILED
                yield sse.event(
                    {"code": code.name, "message": code.message, "retryable": code.retryable},
                    "error",
                    seq,
                )
                return
            yield b"".join(sse.event(data, name, seq + i) for i, (data, name) in enumerate(events))
            seq += len(events)


# --- inspection and tokens -------------------------------------------------------------------


@blueprint.post("/v1/inspect/attention")
async def attention() -> Response:
    """``{layer, head, tokens, attn}`` with ``attn[i][j]`` the weight query i gives key j.

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
    """``{tokens, count, max_model_len}`` (and ``token_strs`` when asked): what the
    generation routes would feed the model, with the same prompt-size limit."""
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
        "max_model_len": state.max_model_len,
    }
    if body.return_token_strs:
        answer["token_strs"] = engine.tokenizer.convert_ids_to_tokens(ids)
    return jsonify(answer)


@blueprint.post("/detokenize")
async def detokenize() -> Response:
    """``{prompt}``: the text of ``tokens``."""
    body = await parse_body(DetokenizeRequest)
    state = get_state()
    engine, _ = state.require_ready()
    check_model(state, body.model)
    vocab = engine.model.config.vocab_size
    if any(not 0 <= t < vocab for t in body.tokens):
        raise APIError(ErrorCode.INVALID_VALUE, f"tokens: ids must be in [0, {vocab})")
    return jsonify({"prompt": await _decode(state, body.tokens)})


async def _decode(state: ServerState, ids: list[int]) -> str:
    engine, _ = state.require_ready()
    return str(await trio.to_thread.run_sync(engine.tokenizer.decode, ids))
