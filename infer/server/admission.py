"""From an HTTP request to a running :class:`RequestStream`: the one way in for every route.

:func:`parse_body` validates the JSON body against its pydantic model (the only place input
is checked). :func:`admit` checks each limit once, encodes the prompts (in a thread: a chat
template renders there too), gives each choice its sampling parameters, and submits them to
the worker. Every refusal is an :class:`APIError` with its :class:`ErrorCode`, counted in the
metrics.
"""

from __future__ import annotations

import json
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import trio
from pydantic import BaseModel, ValidationError
from quart import request

from infer.api import tools
from infer.api.reasoning import Thinking, thinking, with_reasoning
from infer.api.tools import ToolPlan
from infer.engine.engine import Engine
from infer.engine.params import SamplingParams
from infer.engine.prompts import encode_prompt
from infer.engine.request import RequestError, TraceSpec
from infer.server.asgi import on_request_end
from infer.server.errors import APIError, ErrorCode
from infer.server.schemas import ChatMessage, SamplingFields
from infer.server.state import ServerState
from infer.server.stream import RequestStream
from infer.server.worker import QueueFullError

if TYPE_CHECKING:
    from infer.engine.grammar import Grammar, GrammarCompiler

Body = TypeVar("Body", bound=BaseModel)

SEED_MOD = 2**64
# The default prompt text limit, per token of the max sequence length (code runs ~4)
PROMPT_BYTES_PER_TOKEN = 16
_SEED_STEP = 0x9E3779B97F4A7C15  # odd: choices of one seed never collide


async def parse_body(model: type[Body]) -> Body:
    """Read and validate the JSON body of the current request.

    Raises:
        APIError: ``INVALID_JSON`` for malformed JSON or a body that is not an object,
            ``INVALID_VALUE`` for fields that fail validation (unknown fields included);
            ``BODY_TOO_LARGE`` comes from the body limit.
    """
    raw = await request.get_data(as_text=False)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(ErrorCode.INVALID_JSON, f"malformed JSON body: {e}") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise APIError(ErrorCode.INVALID_JSON, "the JSON body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(ErrorCode.INVALID_JSON, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise APIError(ErrorCode.INVALID_VALUE, validation_message(e)) from None


def validation_message(error: ValidationError) -> str:
    """A one-line summary of pydantic's errors, named by the client's field names."""
    parts = []
    for err in error.errors()[:3]:
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            parts.append(f"unknown field {loc!r}")
        else:
            msg = err["msg"].removeprefix("Value error, ")
            parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def check_model(state: ServerState, model: str | None) -> None:
    """Refuse a ``model`` other than the loaded one; ``None`` means the loaded one."""
    if model is not None and not state.serves(model):
        names = ", ".join(repr(n) for n in state.model_names)
        raise APIError(
            ErrorCode.MODEL_NOT_FOUND,
            f"model {model!r} is not served here; this server serves {names}",
        )


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: text or token ids, or a conversation (with the tools it
    offers and the template's variables)."""

    text: str | list[int] | None = None
    messages: Sequence[ChatMessage] | None = None
    plan: ToolPlan | None = None
    template_kwargs: dict[str, Any] | None = None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders itself (not for a generic template)."""
        if self.plan is None or self.plan.format == "generic":
            return None
        return [t.as_openai() for t in self.plan.tools]


async def encode(
    state: ServerState,
    engine: Engine,
    prompts: Sequence[Prompt],
    *,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    allow_empty: bool = False,
) -> list[list[int]]:
    """Token ids of each prompt, size-checked (one thread hop for all of them).

    Raises:
        APIError: Empty, too large, ids outside the vocabulary, or a refused conversation.
    """
    tokenizer, vocab = engine.tokenizer, engine.model.config.vocab_size
    max_bytes = prompt_bytes(state, engine)

    def run() -> list[list[int]]:
        return [
            encode_prompt(
                tokenizer,
                vocab,
                p.text,
                tools.template_turns(p.messages, p.plan) if p.messages is not None else None,
                tools=p.template_tools(),
                template_kwargs=p.template_kwargs,
                add_generation_prompt=add_generation_prompt,
                add_special_tokens=add_special_tokens,
                max_bytes=max_bytes,
                allow_empty=allow_empty,
            )
            for p in prompts
        ]

    try:
        return await trio.to_thread.run_sync(run)
    except RequestError as e:
        raise refused(e) from None


async def compile_format(
    state: ServerState,
    engine: Engine,
    fields: SamplingFields,
    plan: ToolPlan | None = None,
    thinking: Thinking | None = None,
) -> Grammar | None:
    """The grammar a request asks for; ``None`` for free text.

    Tool calls under ``auto`` get a lazy grammar: nothing is constrained until the model
    opens a call (:class:`~infer.api.tools.Openings`), then its calls must fit their tools'
    schemas. ``required`` and a named tool constrain from the first token, and
    ``response_format`` gets its JSON schema; either comes after a free reasoning block when
    the reply may think.

    The compiler (building it reads the whole vocabulary) is made by the first structured
    request; compiling runs in a thread.

    Raises:
        APIError: ``INVALID_SCHEMA`` when a schema cannot be compiled.
    """
    schema = fields.json_schema()
    if schema is None and plan is None:
        return None
    from infer.engine.grammar import GrammarError  # xgrammar takes seconds to import

    if state.compiler is None:
        state.compiler = await trio.to_thread.run_sync(_new_compiler, engine)
    compiler = state.compiler
    try:
        if plan is not None and plan.mode == "auto":  # free until the model opens a call
            calls = {"type": "structural_tag", "format": tools.calls_format(plan)}
            openings = tools.Openings(plan, thinking).scan
            lazy = compiler.lazy
            return await trio.to_thread.run_sync(lazy, calls, openings, plan.parallel, "tool calls")
        if plan is not None:
            tag = with_reasoning(tools.answer_format(plan), thinking)
            return await trio.to_thread.run_sync(compiler.structural_tag, tag, "tool calls")
        assert schema is not None
        if thinking is not None:
            tag = with_reasoning({"type": "json_schema", "json_schema": schema}, thinking)
            return await trio.to_thread.run_sync(compiler.structural_tag, tag, "json_schema")
        return await trio.to_thread.run_sync(compiler.json_schema, schema)
    except GrammarError as e:
        where = "tools" if plan is not None else "response_format"
        raise APIError(ErrorCode.INVALID_SCHEMA, f"{where}: {e}") from None


def refused(error: RequestError) -> APIError:
    """The answer to a request the engine cannot take."""
    return APIError(ErrorCode.of(error.reason), str(error))


def _new_compiler(engine: Engine) -> GrammarCompiler:
    from infer.engine.grammar import GrammarCompiler

    vocab = engine.model.config.vocab_size
    return GrammarCompiler(engine.tokenizer, vocab, sorted(engine.eos_token_ids))


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded with ``seed``.

    Choice 0 keeps the request's seed (so ``n=1`` and the first of ``n`` agree); the others
    get distinct seeds derived from it, the same on every call.
    """
    if seed is None or index == 0:
        return seed
    return (seed + index * _SEED_STEP) % SEED_MOD


@dataclass
class Admitted:
    """A request the worker has taken: its stream, each prompt's ids, and whether a chat
    reply starts with (or may open) a reasoning block."""

    stream: RequestStream
    prompt_ids: list[list[int]]
    thinking: Thinking | None = None


async def admit(
    state: ServerState,
    prompts: Sequence[Prompt],
    fields: SamplingFields,
    *,
    arrival: float,
    default_max_tokens: int,
    n: int = 1,
    logprobs: int = 0,
    prompt_logprobs: int | None = None,
    trace: TraceSpec | None = None,
    timeout_s: float | None = None,
    guard: bool = True,
) -> Admitted:
    """Encode, check and submit a request: ``n`` choices per prompt, prompt by prompt.

    Args:
        state: The server.
        prompts: What to complete.
        fields: The validated sampling fields.
        arrival: ``trio.current_time()`` when the request arrived.
        default_max_tokens: The token limit when the client set none (capped by the room
            the context leaves).
        n: Choices per prompt.
        logprobs: Alternatives per token to report.
        prompt_logprobs: Alternatives per prompt token to report; ``None``: the prompt is
            not scored.
        trace: Per-token traces (native streams).
        timeout_s: The client's time limit (capped by ``max_timeout_s``).
        guard: End the stream when this HTTP request ends unread (``False`` when something
            else reads it: a resumable stream's producer).

    Raises:
        APIError: The request is refused (counted in the metrics).
    """
    try:
        engine, worker = state.require_ready()
        check_model(state, fields.model)
        vocab = engine.model.config.vocab_size
        if fields.logit_bias and max(fields.logit_bias) >= vocab:
            raise APIError(ErrorCode.INVALID_VALUE, f"logit_bias: token ids must be below {vocab}")
        ids = await encode(state, engine, prompts)
        thinking = _thinking(engine, prompts, ids)
        grammar = await compile_format(state, engine, fields, prompts[0].plan, thinking)
        choices: list[list[int]] = []
        params: list[SamplingParams] = []
        for prompt in ids:
            limit = fields.limit()
            room = engine.max_seq_len - len(prompt)
            max_tokens = limit if limit is not None else min(default_max_tokens, room)
            need = 0 if limit == 0 else max(max_tokens, 1)  # 0 asked for: the prompt is scored
            try:
                engine.check(len(prompt), need, trace)
            except RequestError as e:
                raise refused(e) from None
            for _ in range(n):
                choices.append(prompt)
                params.append(
                    fields.sampling_params(
                        max_tokens,
                        choice_seed(fields.seed, len(params)),
                        logprobs,
                        grammar,
                        prompt_logprobs,
                    )
                )
        prediction = await _prediction(state, engine, fields)
        state.require_ready()  # a drain or an engine failure may have begun meanwhile
        try:
            stream = worker.submit(
                choices,
                params,
                arrival,
                trace,
                _timeout(state, timeout_s),
                num_prompts=len(ids),
                prediction=prediction,
            )
        except QueueFullError as e:
            raise APIError(
                ErrorCode.QUEUE_FULL, f"the server is busy ({e}); retry shortly"
            ) from None
    except APIError as e:
        state.metrics.rejected[e.code.value] += 1
        raise
    # Still open when its HTTP request ends, the stream was never read: the response failed
    # before its body (or the client left in that instant). Counted as an error.
    if guard:
        on_request_end(cast(MutableMapping[str, Any], request.scope), stream.fail)
    return Admitted(stream, ids, thinking)


def prompt_bytes(state: ServerState, engine: Engine) -> int:
    """The prompt text limit: ``--max-prompt-bytes``, else 16 bytes per token of the max
    sequence length."""
    return state.config.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * engine.max_seq_len


async def _prediction(
    state: ServerState, engine: Engine, fields: SamplingFields
) -> list[int] | None:
    """The token ids of the request's ``prediction`` (size-checked as a prompt is)."""
    if fields.prediction is None:
        return None
    text = fields.prediction.text()
    if len(text.encode()) > (limit := prompt_bytes(state, engine)):
        raise APIError(
            ErrorCode.PROMPT_TOO_LARGE, f"prediction: larger than max_prompt_bytes ({limit})"
        )
    return await trio.to_thread.run_sync(engine.encode_prediction, text)


def _thinking(engine: Engine, prompts: Sequence[Prompt], ids: list[list[int]]) -> Thinking | None:
    """How a reply to this conversation may reason (only a chat prompt's reply can)."""
    if len(prompts) != 1 or prompts[0].messages is None:
        return None
    template = getattr(engine.tokenizer, "chat_template", None)
    return thinking(template, str(engine.tokenizer.decode(ids[0][-8:])))


def _timeout(state: ServerState, requested: float | None) -> float | None:
    cap = state.config.max_timeout_s
    if requested is None:
        return cap
    return requested if cap is None else min(requested, cap)
