"""From a validated body to a running request, and the request task's view of it.

Shared by the OpenAI routes and the native event stream: parse and validate the body,
tokenize (in a thread; a chat template renders there too), check sizes and lengths, submit
to the worker, then read outputs through a :class:`Generation` that keeps the metrics and
aborts the request if the task ends before the last output (a client disconnect).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import trio
from pydantic import BaseModel, ValidationError
from quart import request

from infer.engine.engine import Engine, QueueFullError
from infer.engine.grammar import Grammar
from infer.engine.request import StepOutput, TraceSpec
from infer.engine.sampler import SamplingParams
from infer.server.asgi import on_request_end
from infer.server.errors import APIError
from infer.server.limits import check_prompt_size
from infer.server.schemas import ChatMessage, SamplingFields
from infer.server.state import RETRY_AFTER_S, ServerState
from infer.server.worker import RequestHandle, WorkerStoppedError

log = logging.getLogger("infer.server")

Body = TypeVar("Body", bound=BaseModel)

SHUTDOWN_POLL_S = 1.0  # how often a waiting request checks whether the server is closing


async def parse_body(model: type[Body]) -> Body:
    """Read and validate the JSON body of the current request.

    Raises:
        APIError: 400 for malformed JSON or a body that is not an object, 422 for fields
            that fail validation (unknown fields included); 413 comes from the body limit.
    """
    raw = await request.get_data(as_text=False)
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", "invalid_json") from None
    except RecursionError:  # the decoder recurses once per nesting level
        raise APIError(400, "the JSON body is nested too deeply", "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", "invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise APIError(422, validation_message(e), "invalid_value") from None


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


def render_chat(engine: Engine, messages: Sequence[ChatMessage]) -> str:
    """The prompt text of a conversation through the model's chat template.

    Raises:
        APIError: 400 for no messages, 422 when the model has no chat template.
    """
    if not messages:
        raise APIError(400, "messages is empty", "empty_prompt")
    if not getattr(engine.tokenizer, "chat_template", None):
        raise APIError(422, f"{engine.model_name} has no chat template", "no_chat_template")
    turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
             for m in messages]
    try:
        text = engine.tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                                    tokenize=False)
    except Exception as e:  # noqa: BLE001 - the template refuses the conversation
        raise APIError(422, f"messages: the chat template refused them: {e}"[:300],
                       "invalid_messages") from None
    return str(text)


def encode_prompt(engine: Engine, prompt: str | list[int] | None,
                  messages: Sequence[ChatMessage] | None, max_bytes: int) -> list[int]:
    """Token ids of a prompt or a conversation, size-checked (call it in a thread).

    Raises:
        APIError: 400 empty prompt, 413 prompt over ``max_bytes``, 422 invalid token ids.
    """
    if messages is not None:
        text = render_chat(engine, messages)
    elif isinstance(prompt, str):
        text = prompt
    else:
        ids = list(prompt or [])
        if not ids:
            raise APIError(400, "prompt is empty", "empty_prompt")
        try:
            ids = engine.encode(ids)
        except ValueError as e:
            raise APIError(422, str(e), "invalid_value") from None
        check_prompt_size(str(engine.tokenizer.decode(ids)), max_bytes)
        return ids
    if not text:
        raise APIError(400, "prompt is empty", "empty_prompt")
    check_prompt_size(text, max_bytes)
    try:
        return engine.encode(text)
    except ValueError as e:  # a prompt that tokenizes to nothing
        raise APIError(400, str(e), "empty_prompt") from None


@dataclass
class Submission:
    """A generation request, validated and ready for the worker."""

    prompt: str | list[int] | None
    messages: Sequence[ChatMessage] | None
    fields: SamplingFields
    max_tokens: int | None
    default_max_tokens: int
    logprobs: int = 0
    trace: TraceSpec | None = None
    timeout_s: float | None = None
    grammar: Grammar | None = None  # structured output, compiled from response_format


async def start(state: ServerState, sub: Submission, arrival: float,
                guard: bool = True) -> Generation:
    """Validate, tokenize and submit a request.

    Args:
        state: The server.
        sub: What to generate.
        arrival: ``trio.current_time()`` when the request arrived (for time to first token).
        guard: Abort the generation when this HTTP request ends unread (``False`` when
            something else owns it: a resumable stream's producer).

    Returns:
        The running request.

    Raises:
        APIError: The request is refused (400, 413, 422, 503); counted in the metrics.
    """
    try:
        engine, worker = state.require_ready()
        check_model(state, sub.fields.model)
        ids = await trio.to_thread.run_sync(
            encode_prompt, engine, sub.prompt, sub.messages, state.config.max_prompt_bytes)
        params = _sampling_params(engine, sub, len(ids))
        _check_trace(engine, sub.trace)
        state.require_ready()  # a drain or an engine failure may have begun meanwhile
        try:
            handle = worker.submit(ids, params, sub.trace, _timeout(state, sub.timeout_s))
        except QueueFullError as e:
            raise APIError(503, f"the server is busy ({e}); retry shortly", "queue_full",
                           {"Retry-After": RETRY_AFTER_S}) from None
        except WorkerStoppedError:
            state.require_ready()
            raise APIError(503, "the server is shutting down", "shutting_down",
                           {"Retry-After": RETRY_AFTER_S}) from None
    except APIError as e:
        state.metrics.rejected[e.code] += 1
        raise
    gen = Generation(state, handle, len(ids), arrival)
    # Still open when its request ends, the generation was never read: the response failed
    # before its body (or the client left in that instant). Counted as an error.
    if guard:
        on_request_end(cast(MutableMapping[str, Any], request.scope), gen.fail)
    return gen


def check_model(state: ServerState, model: str | None) -> None:
    """Refuse a ``model`` other than the loaded one (422); ``None`` means the loaded one."""
    if model is not None and model not in (state.model_name, state.config.engine.model):
        raise APIError(422, f"model {model!r} is not served here; this server serves "
                       f"{state.model_name!r}", "model_not_found")


def _sampling_params(engine: Engine, sub: Submission, prompt_len: int) -> SamplingParams:
    room = engine.config.max_seq_len - prompt_len
    max_tokens = sub.max_tokens if sub.max_tokens is not None else min(
        sub.default_max_tokens, room)
    try:
        engine.check_length(prompt_len, max(max_tokens, 1))
    except ValueError as e:
        raise APIError(422, str(e), "context_length_exceeded") from None
    f = sub.fields
    vocab = engine.model.config.vocab_size
    if f.logit_bias and max(f.logit_bias) >= vocab:
        raise APIError(422, f"logit_bias: token ids must be below {vocab}", "invalid_value")
    try:
        return SamplingParams(
            max_new_tokens=max_tokens, temperature=f.temperature, top_p=f.top_p,
            top_k=f.top_k, repetition_penalty=f.repetition_penalty, stop=f.stop_list(),
            seed=f.seed, ignore_eos=f.ignore_eos, logprobs=sub.logprobs,
            presence_penalty=f.presence_penalty, frequency_penalty=f.frequency_penalty,
            logit_bias=dict(f.logit_bias or {}), grammar=sub.grammar,
        )
    except ValueError as e:
        raise APIError(422, str(e), "invalid_value") from None


def _check_trace(engine: Engine, trace: TraceSpec | None) -> None:
    layers = engine.model.config.num_hidden_layers
    if trace is not None and trace.layer is not None and trace.layer >= layers:
        raise APIError(422, f"trace.layer must be in [0, {layers - 1}], got {trace.layer}",
                       "invalid_value")


def _timeout(state: ServerState, requested: float | None) -> float | None:
    cap = state.config.max_timeout_s
    if requested is None:
        return cap
    return requested if cap is None else min(requested, cap)


class Generation:
    """A submitted request as its HTTP task reads it.

    It guards the request from the moment of submission: unless the last output was read,
    :meth:`close` aborts the request in the engine. ``with gen:`` closes it when the
    response body ends, and the request's end closes it in any case (a response whose body
    was never iterated, a client that went away first), so no request decodes unread.
    """

    def __init__(self, state: ServerState, handle: RequestHandle, prompt_tokens: int,
                 arrival: float) -> None:
        self.state = state
        self.handle = handle
        self.request_id = handle.request_id
        self.prompt_tokens = prompt_tokens
        self.created = int(time.time())
        self.tokens = 0  # completion tokens delivered so far
        self.new_tokens = 0  # tokens the last output added
        self.finished = False
        self.arrival = arrival
        self.first_token_at: float | None = None
        self._last_token_at = arrival
        self._deadline_at_start = trio.current_effective_deadline()
        self._closed = False
        state.streams.enter()

    def __enter__(self) -> Generation:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: Any) -> None:
        # Cancelled (a disconnect) or GeneratorExit (the body was dropped) is the client's
        # doing; an Exception is ours.
        self.close(client_gone=exc_type is None or not issubclass(exc_type, Exception))

    def fail(self) -> None:
        """The server could not go on with this stream (a bug, logged): abort, count an error."""
        self.close(client_gone=False)

    def close(self, client_gone: bool = True) -> None:
        """Stop guarding; abort the request unless it finished (idempotent).

        Args:
            client_gone: Count an unfinished request as a client disconnect; else as an error.
        """
        if self._closed:
            return
        self._closed = True
        self.state.streams.leave()
        if not self.finished:
            self.handle.abort()
            if client_gone:
                self.state.metrics.client_disconnects += 1
                self.state.metrics.finished["abort"] += 1
            else:
                self.state.metrics.finished["error"] += 1

    async def next(self, wait_s: float | None = None) -> StepOutput | None:
        """The next output, or ``None`` after ``wait_s`` seconds without one (a heartbeat).

        While it waits, it checks every ``SHUTDOWN_POLL_S`` whether the server has begun
        to shut down (see :meth:`_check_shutdown`).

        Raises:
            RuntimeError: Called after the last output.
        """
        if self.finished:
            raise RuntimeError("the generation has already finished")
        give_up = trio.current_time() + wait_s if wait_s is not None else math.inf
        while True:
            self._check_shutdown()
            with trio.move_on_at(min(give_up, trio.current_time() + SHUTDOWN_POLL_S)):
                # The handle's __anext__ is cancel-safe: a timeout loses no output.
                out = await self.handle.__anext__()
                self._record(out)
                return out
            if trio.current_time() >= give_up:
                return None

    def _check_shutdown(self) -> None:
        """Drain if Hypercorn has begun its graceful shutdown.

        Hypercorn run from its own command line gives the app no signal: it begins a shutdown
        by putting a deadline, ``graceful_timeout`` in the future, on the nursery that holds
        every connection, and cancels them there. That finite future deadline is the only
        sign. A client disconnect is not one: it *cancels* the request's scope, which reads
        as a deadline of ``-inf`` (the bug this guards against drained the whole server on
        every disconnect).
        """
        deadline = trio.current_effective_deadline()
        if trio.current_time() < deadline < self._deadline_at_start:
            self.state.begin_drain()

    def _record(self, out: StepOutput) -> None:
        now = trio.current_time()
        metrics = self.state.metrics
        self.new_tokens = (max(0, out.completion_tokens - self.tokens)
                           if out.token_id is not None else 0)
        if self.new_tokens:
            if self.first_token_at is None:
                self.first_token_at = now
                metrics.ttft.observe(now - self.arrival)
            else:
                gap = (now - self._last_token_at) / self.new_tokens
                for _ in range(self.new_tokens):
                    metrics.itl.observe(gap)
            self._last_token_at = now
            self.tokens += self.new_tokens
            metrics.generated_tokens += self.new_tokens
        if out.finished:
            self.finished = True
            metrics.finished[out.finish_reason or "error"] += 1

    def usage(self) -> dict[str, int]:
        """OpenAI-style token counts of what was delivered."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens}


# Worker error codes → the protocol's codes (a slow reader's end is retryable overload).
ERROR_CODES = {
    "OUT_OF_MEMORY": "OUT_OF_MEMORY",
    "INFERENCE_FAILED": "INFERENCE_FAILED",
    "INVALID_REQUEST": "INVALID_REQUEST",
    "OVERLOADED": "OVERLOADED",
    "SLOW_CLIENT": "OVERLOADED",
    "CANCELLED": "CANCELLED",
    "TIMEOUT": "TIMEOUT",
}
SAFE_MESSAGES = {
    "OUT_OF_MEMORY": "out of memory; retry later",
    "INFERENCE_FAILED": "inference failed",
    "TIMEOUT": "the request reached its time limit",
    "CANCELLED": "the request was cancelled (the server is shutting down)",
}
RETRYABLE = frozenset({"OUT_OF_MEMORY", "OVERLOADED", "CANCELLED"})


@dataclass
class Outcome:
    """How a finished output ends a stream: a finish reason, or an error code."""

    finish_reason: str | None  # the engine's: stop, eos or length (a timeout is "length")
    code: str | None = None  # set for an error ending (TIMEOUT included)
    message: str = ""


def outcome(out: StepOutput) -> Outcome:
    """Classify the finished output of a request.

    Args:
        out: An output with ``finished`` set.

    Returns:
        The outcome; worker errors map onto the protocol's codes and internal error text
        is replaced by a fixed message (the detail is logged).
    """
    if out.error_code == "TIMEOUT":
        return Outcome("length", "TIMEOUT", SAFE_MESSAGES["TIMEOUT"])
    if out.finish_reason in ("stop", "eos", "length"):
        return Outcome(out.finish_reason)
    raw = out.error_code or ("CANCELLED" if out.finish_reason == "abort" else "INFERENCE_FAILED")
    code = ERROR_CODES.get(raw, "INFERENCE_FAILED")
    if code == "INFERENCE_FAILED" or code == "OUT_OF_MEMORY":
        log.error("request %s failed: %s (%s)", out.request_id, out.error, raw)
    message = SAFE_MESSAGES.get(code, out.error or code.lower())
    return Outcome(out.finish_reason, code, message)
