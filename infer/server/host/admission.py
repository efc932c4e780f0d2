"""From an engine request to a running :class:`RequestStream`: the one way in for every route.

A route converts its validated body into an :class:`~infer.api.engine_request.EngineRequest`
(its protocol package does); :func:`admit` checks each limit once, encodes the prompts (in a
thread: a chat template renders there too), settles what depends on the served model (each
choice's token limit, seed and grammar, the tools' call format), and submits the choices to
the worker. Every refusal is an :class:`APIError` with its :class:`ErrorCode`, counted in
the metrics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from infer.api import fim as fim_prompt
from infer.api import tools
from infer.api.engine_request import EngineRequest, Prompt
from infer.api.errors import APIError, ErrorCode
from infer.api.reasoning import Thinking, thinking, with_reasoning
from infer.api.tools import ToolPlan
from infer.api.writer import Ticket
from infer.engine.engine import Engine
from infer.engine.params import SamplingParams
from infer.engine.prompts import encode_prompt
from infer.engine.request import RequestError
from infer.server.host.registry import ModelSlot
from infer.server.host.state import ServerState, counting_refusals
from infer.server.host.stream import RequestStream
from infer.server.host.worker import EngineWorker, QueueFullError, WorkerStoppedError

if TYPE_CHECKING:
    from infer.engine.grammar import Grammar, GrammarCompiler

SEED_MOD = 2**64
# The default prompt text limit, per token of the max sequence length (code runs ~4)
PROMPT_BYTES_PER_TOKEN = 16
_SEED_STEP = 0x9E3779B97F4A7C15  # odd: choices of one seed never collide


@asynccontextmanager
async def generating(
    state: ServerState, model: str | None, keep_alive_s: float | None = None
) -> AsyncIterator[tuple[ModelSlot, Engine, EngineWorker]]:
    """The generative model ``model`` names (``None``: the default), loaded and kept loaded
    for the block, with its engine and worker.

    Raises:
        APIError: Not serving; not served here, cannot load, or an embedding model (400).
    """
    state.require_open()
    async with state.models.use(model, keep_alive_s) as slot:
        engine, worker = slot.generator()
        yield slot, engine, worker


def tool_plan(engine: Engine, choice: tools.ToolChoice | None) -> ToolPlan | None:
    """The tools of a request in the call format of the served model's template."""
    if choice is None:
        return None
    return choice.plan(getattr(engine.tokenizer, "chat_template", None))


async def encode(
    state: ServerState,
    engine: Engine,
    prompts: Sequence[Prompt],
    plan: ToolPlan | None = None,
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
    rendered = None if plan is None or plan.format == "generic" else plan.tools
    template_tools = [t.as_openai() for t in rendered] if rendered is not None else None

    def run() -> list[list[int]]:
        return [
            encode_prompt(
                tokenizer,
                vocab,
                p.text,
                tools.template_turns(p.messages, plan) if p.messages is not None else None,
                tools=template_tools,
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


async def encode_fills(
    state: ServerState, name: str, engine: Engine, prompts: Sequence[Prompt]
) -> tuple[list[list[int]], bool, list[str]]:
    """Token ids of each fill-in-the-middle prompt (one thread hop for all of them),
    whether the builder cut some piece to its limits, and the text each healed prompt
    was cut back by.

    Raises:
        APIError: The model does not fill in the middle, or the code is too large.
    """
    fim = engine.fim
    if fim is None:
        raise APIError(
            ErrorCode.FIM_NOT_SUPPORTED,
            f"model {name!r} has no fill-in-the-middle tokens: it does not fill "
            "in the middle (use a code model trained for it, such as Qwen2.5-Coder)",
        )
    fills = [p.fill for p in prompts if p.fill is not None]
    max_bytes = prompt_bytes(state, engine)
    for f in fills:
        if (size := f.text_bytes()) > max_bytes:
            raise APIError(
                ErrorCode.PROMPT_TOO_LARGE, f"the code is {size} bytes; the limit is {max_bytes}"
            )
    tokenizer = engine.tokenizer

    def text_ids(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids))

    def run() -> list[fim_prompt.FimPrompt]:
        return [
            fim_prompt.build(text_ids, fim, f.request, f.layout, f.limits, decode) for f in fills
        ]

    built = await trio.to_thread.run_sync(run)
    return [b.ids for b in built], any(b.truncated for b in built), [b.healing for b in built]


async def decode(engine: Engine, ids: list[int]) -> str:
    """The text of ``ids`` (in a thread)."""
    return str(await trio.to_thread.run_sync(engine.tokenizer.decode, ids))


async def compile_format(
    slot: ModelSlot,
    engine: Engine,
    schema: dict[str, Any] | None,
    plan: ToolPlan | None = None,
    thinking: Thinking | None = None,
) -> Grammar | None:
    """The grammar a request asks for; ``None`` for free text.

    Tool calls under ``auto`` get a lazy grammar: nothing is constrained until the model
    opens a call (:class:`~infer.api.tools.Openings`), then its calls must fit their tools'
    schemas. ``required`` and a named tool constrain from the first token, and a JSON
    ``schema`` is followed from the first; either comes after a free reasoning block when
    the reply may think.

    The model's compiler (building it reads the whole vocabulary) is made by its first
    structured request; compiling runs in a thread.

    Raises:
        APIError: ``INVALID_SCHEMA`` when a schema cannot be compiled.
    """
    if schema is None and plan is None:
        return None
    from infer.engine.grammar import GrammarError  # xgrammar takes seconds to import

    if slot.compiler is None:
        slot.compiler = await trio.to_thread.run_sync(_new_compiler, engine)
    compiler = slot.compiler
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
    """A request the worker has taken: its stream, and what its writer reads of it."""

    stream: RequestStream
    ticket: Ticket


async def admit(
    state: ServerState,
    request: EngineRequest,
    arrival: float,
    on_end: Callable[[Callable[[], None]], None] | None = None,
) -> Admitted:
    """Encode, check and submit a request: ``n`` choices per prompt, prompt by prompt.

    Args:
        state: The server.
        request: What to generate, as the protocol's package converted it.
        arrival: ``trio.current_time()`` when the request arrived.
        on_end: Registers a callback for the end of the HTTP request, which fails the
            stream if it is still open then (it was never read: the response failed before
            its body, or the client left in that instant); ``None`` when something else
            reads it (a resumable stream's producer).

    Raises:
        APIError: The request is refused (counted in the metrics).
    """
    with counting_refusals(state, request.model):
        async with generating(state, request.model, request.keep_alive) as (slot, engine, worker):
            vocab = engine.model.config.vocab_size
            bias = request.params.logit_bias
            if bias and max(bias) >= vocab:
                raise APIError(
                    ErrorCode.INVALID_VALUE, f"logit_bias: token ids must be below {vocab}"
                )
            plan = tool_plan(engine, request.tools)
            truncated, healing = False, None
            if any(p.fill is not None for p in request.prompts):
                fills = await encode_fills(state, slot.name, engine, request.prompts)
                ids, truncated, healing = fills
            else:
                ids = await encode(state, engine, request.prompts, plan)
            reasoning = _thinking(engine, request.prompts, ids)
            grammar = await compile_format(slot, engine, request.json_schema, plan, reasoning)
            choices, params = _choices(engine, request, ids, grammar, healing)
            prediction = await _prediction(state, engine, request.prediction)
            state.require_open()  # a drain or an engine failure may have begun meanwhile
            stream = _submit(state, worker, request, choices, params, arrival, len(ids), prediction)
    if on_end is not None:
        on_end(stream.fail)
    stats, tokenizer = stream.stats, engine.tokenizer
    ticket = Ticket(stream.id, stats.created, slot.name, ids, len(choices), tokenizer, stats)
    settled = dataclasses.replace(
        ticket, plan=plan, thinking=reasoning, truncated=truncated, context=engine.max_seq_len
    )
    return Admitted(stream, settled)


def _submit(
    state: ServerState,
    worker: EngineWorker,
    request: EngineRequest,
    choices: list[list[int]],
    params: list[SamplingParams],
    arrival: float,
    prompts: int,
    prediction: list[int] | None,
) -> RequestStream:
    """Hand the choices to the model's worker.

    Raises:
        APIError: Its queue is full, or it has stopped.
    """
    timeout = _timeout(state, request.timeout_s)
    try:
        return worker.submit(
            choices, params, arrival, request.trace, timeout, num_prompts=prompts,
            prediction=prediction,
        )  # fmt: skip
    except QueueFullError as e:
        raise APIError(ErrorCode.QUEUE_FULL, f"the server is busy ({e}); retry shortly") from None
    except WorkerStoppedError:
        raise APIError(ErrorCode.SHUTTING_DOWN) from None


def _choices(
    engine: Engine,
    request: EngineRequest,
    ids: list[list[int]],
    grammar: Grammar | None,
    healing: list[str] | None = None,
) -> tuple[list[list[int]], list[SamplingParams]]:
    """Each choice's prompt and sampling parameters (with what its prompt was healed by),
    its token limit checked.

    Raises:
        APIError: A prompt and its limit do not fit (or a trace names no layer).
    """
    choices: list[list[int]] = []
    params: list[SamplingParams] = []
    limit, base = request.max_tokens, request.params
    if engine.fim is not None and any(p.fill is not None for p in request.prompts):
        # a fill ends on the model's FIM end tokens as well as on its EOS
        stops = base.stop_token_ids | engine.fim.end
        base = dataclasses.replace(base, stop_token_ids=stops)
    for i, prompt in enumerate(ids):
        heal = healing[i] if healing else ""
        room = engine.max_seq_len - len(prompt)
        max_tokens = limit if limit is not None else min(request.default_max_tokens, room)
        need = 0 if limit == 0 else max(max_tokens, 1)  # 0 asked for: the prompt is scored
        try:
            engine.check(len(prompt), need, request.trace)
        except RequestError as e:
            raise refused(e) from None
        for _ in range(request.n):
            seed = choice_seed(base.seed, len(params))
            choices.append(prompt)
            params.append(
                dataclasses.replace(
                    base, max_new_tokens=max_tokens, seed=seed, grammar=grammar, healing=heal
                )
            )
    return choices, params


def prompt_bytes(state: ServerState, engine: Engine) -> int:
    """The prompt text limit: ``--max-prompt-bytes``, else 16 bytes per token of the max
    sequence length."""
    return state.config.max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * engine.max_seq_len


async def _prediction(state: ServerState, engine: Engine, text: str | None) -> list[int] | None:
    """The token ids of the request's ``prediction`` (size-checked as a prompt is)."""
    if text is None:
        return None
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
