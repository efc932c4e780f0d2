"""The protocols' pure parts: a body's conversion into the engine request, each writer's
events in order, and how the edge frames them (SSE with names and ids, NDJSON)."""

from __future__ import annotations

import json
from typing import Any

from infer.api.errors import APIError, ErrorCode, error_body
from infer.api.native.writer import NativeWriter
from infer.api.openai.models import ChatCompletionRequest, CompletionRequest
from infer.api.openai.writer import completion_writer
from infer.api.usage import Counts
from infer.api.writer import DONE, Event, Ticket
from infer.engine.request import Failure, FinishReason, StepOutput, TraceSpec
from infer.server.edge import framing


class _Tokens:
    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return [1] * len(text)


class _Timing:
    arrival = 0.0
    first_token_at: float | None = 0.5


def _ticket(prompts: list[list[int]], choices: int) -> Ticket:
    return Ticket("req-1", 0, "m", prompts, choices, _Tokens(), _Timing())


def _out(token: int, text: str, n: int, outcome: Any = None) -> StepOutput:
    return StepOutput("req-1", token, text, outcome, completion_tokens=n, num_tokens=1)


def test_a_chat_body_becomes_one_engine_request_with_its_tools() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "n": 3,
            "max_completion_tokens": 7,
            "seed": 5,
            "logprobs": True,
            "top_logprobs": 2,
            "stop": "x",
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }
    )
    request = body.engine_request()
    assert (request.n, request.max_tokens, request.model) == (3, 7, "m")
    assert request.params.seed == 5 and request.params.logprobs == 2
    assert request.params.stop == ["x"]
    assert request.tools is not None and request.tools.mode == "forced"
    assert [t.name for t in request.tools.tools] == ["f"]
    [prompt] = request.prompts
    assert prompt.messages is not None and prompt.messages[0].text() == "hi"


def test_a_completion_body_becomes_n_choices_per_prompt_with_its_default_limit() -> None:
    body = CompletionRequest.model_validate({"model": "m", "prompt": ["a", "b"], "n": 2})
    request = body.engine_request()
    assert [p.text for p in request.prompts] == ["a", "b"] and request.n == 2
    assert request.max_tokens is None and request.default_max_tokens == 16
    assert request.trace is None and request.tools is None


def test_the_native_writer_numbers_every_event_and_ends_once() -> None:
    writer = NativeWriter(_ticket([[1, 2]], 1), metrics_every=2, clock=lambda: 1.5)
    events = writer.start()
    events += writer.output(0, _out(7, "a", 1))
    events += writer.output(0, _out(8, "b", 2, FinishReason.LENGTH))
    events += writer.finish(Counts(2, 2))
    assert [(e.name, e.id) for e in events] == [
        ("started", 0),
        ("token", 1),
        ("token", 2),
        ("metrics", 3),
        ("done", 4),
    ]
    assert events[-1].data == {
        "finish_reason": "length",
        "usage": {
            "prompt_tokens": 2,
            "completion_tokens": 2,
            "total_tokens": 4,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }
    assert events[3].data["tokens_per_sec"] == 1.0  # the second token, a second after the first


def test_the_native_writer_fails_with_the_code_name_and_what_was_used() -> None:
    writer = NativeWriter(_ticket([[1]], 1), None, clock=lambda: 0.0)
    [event] = writer.fail(APIError(ErrorCode.of(Failure.TIMEOUT)), Counts(1, 0))
    assert event.name == "error" and event.data["code"] == "TIMEOUT"
    assert writer.failure is not None and writer.failure.code is ErrorCode.TIMEOUT


def test_the_completion_writer_streams_chunks_then_done_or_builds_one_body() -> None:
    streamed = CompletionRequest.model_validate(
        {"model": "m", "prompt": "p", "stream": True, "stream_options": {"include_usage": True}}
    )
    writer = completion_writer(streamed, _ticket([[1]], 1))
    events = writer.output(0, _out(5, "hi", 1, FinishReason.EOS)) + writer.finish(Counts(1, 1))
    assert events[-1] is DONE and events[-2].data["usage"]["total_tokens"] == 2
    assert [e.data["choices"][0]["finish_reason"] for e in events[:2]] == [None, "stop"]
    whole = completion_writer(
        CompletionRequest.model_validate({"model": "m", "prompt": "p", "echo": True}),
        _ticket([[1]], 1),
    )
    assert whole.start_work() is None  # a text prompt echoes as it was sent
    assert whole.output(0, _out(5, "hi", 1, FinishReason.EOS)) == []
    body = whole.body(Counts(1, 1))
    assert (
        body["object"] == "text_completion" and body["choices"][0]["text"] == "phi"
    )  # the echo, then the text


def test_sse_frames_names_ids_and_done_as_before_and_ndjson_one_line_each() -> None:
    events = [Event({"t": "é"}, "token", 3), Event({"x": 1}), DONE]
    sse = framing.SSE.frame(events)
    assert sse == (framing.event({"t": "é"}, "token", 3) + framing.event({"x": 1}) + framing.DONE)
    lines = framing.NDJSON.frame(events[:2]).decode().splitlines()
    assert [json.loads(line) for line in lines] == [{"t": "é"}, {"x": 1}]
    assert framing.NDJSON.heartbeat == b"" and framing.SSE.heartbeat == framing.HEARTBEAT


def test_the_default_error_body_carries_the_code_value_and_type() -> None:
    error = APIError(ErrorCode.MODEL_NOT_FOUND, "no such model")
    assert error_body(error) == {
        "error": {
            "message": "no such model",
            "type": "invalid_request_error",
            "code": "model_not_found",
        }
    }
    assert TraceSpec().top_k == 5  # the native trace's default, as the request model's
