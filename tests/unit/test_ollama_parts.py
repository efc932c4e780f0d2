"""Ollama's API, its pure parts: bodies into engine requests, the model's card, the writer's
lines in order, and the refusals (:mod:`infer.api.ollama`)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import pytest
from pydantic import ValidationError

from infer.api.errors import APIError, ErrorCode
from infer.api.fim import Chunk, Layout
from infer.api.ollama import bodies
from infer.api.ollama.card import ModelCard, human_number
from infer.api.ollama.models import (
    UNLIMITED,
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaShowRequest,
    fim_request,
    model_names,
    served_name,
)
from infer.api.ollama.writer import OllamaWriter
from infer.api.tools import ToolPlan, tool_format
from infer.api.usage import Counts
from infer.api.writer import Ticket
from infer.catalog import parse_keep_alive
from infer.engine.config import EngineConfig
from infer.engine.request import Failure, FinishReason, StepOutput
from infer.models.config import ModelConfig

QWEN_CONFIG = ModelConfig(
    architecture="Qwen2ForCausalLM",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    qkv_bias=True,
    tie_word_embeddings=True,
)
TOOLS_TEMPLATE = "{% if tools %}<tool_call>{% endif %}{{ messages }}"
CARD = ModelCard(
    names=("coder", "coder-alias"),
    config=QWEN_CONFIG,
    context_length=4096,
    size=123,
    digest="sha256:00",
    file_format="gguf",
    quantization="Q4_K_M",
    loaded_at=0.0,
    chat_template=TOOLS_TEMPLATE,
    fim=("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    stops=("<|im_end|>",),
)
THINKING = dataclasses.replace(CARD, chat_template="{{ messages }}<think></think>", fim=None)


class _Timing:
    arrival = 1.0
    first_token_at: float | None = 1.5


def _ticket(plan: ToolPlan | None = None, thinking: Any = None) -> Ticket:
    return Ticket("req-1", 0, "coder", [[1, 2, 3]], 1, None, _Timing(), plan, thinking)  # type: ignore[arg-type]


def _out(text: str, n: int, outcome: Any = None) -> StepOutput:
    return StepOutput("req-1", n, text, outcome, prompt_tokens=3, completion_tokens=n)


def test_generate_goes_through_the_chat_template_as_a_users_message() -> None:
    body = OllamaGenerateRequest.model_validate(
        {
            "model": "coder",
            "prompt": "hi",
            "system": "be brief",
            "options": {"temperature": 0, "num_predict": 5, "stop": ["x"], "seed": 3},
            "keep_alive": "5m",
            "unknown_field": 1,  # ignored, as Ollama's decoder ignores it
        }
    )
    request = body.engine_request(CARD)
    [prompt] = request.prompts
    assert [(m.role, m.content) for m in prompt.messages or []] == [
        ("system", "be brief"),
        ("user", "hi"),
    ]
    assert request.max_tokens == 5 and request.params.temperature == 0
    assert request.params.stop == ["x"] and request.params.seed == 3 and body.stream


def test_ollamas_defaults_and_unknown_options() -> None:
    body = OllamaGenerateRequest.model_validate(
        {"model": "coder", "prompt": "hi", "options": {"num_gpu": 1, "mirostat": 0, "seed": -1}}
    )
    request = body.engine_request(CARD)
    params = request.params
    assert (params.temperature, params.top_k, params.top_p) == (0.8, 40, 0.9)
    assert params.seed is None  # -1: a random seed
    huge = {"model": "coder", "prompt": "hi", "options": {"top_k": 10**30}}
    assert OllamaGenerateRequest.model_validate(huge).engine_request(CARD).params.top_k < 2**31
    # num_predict -1: until the reply ends or the context is full
    assert request.max_tokens is None and request.default_max_tokens == UNLIMITED


def test_raw_prompts_go_as_they_are_and_a_suffix_fills_the_middle() -> None:
    raw = OllamaGenerateRequest(model="coder", prompt="<|im_start|>x", raw=True, suffix="y")
    assert raw.engine_request(CARD).prompts[0].text == "<|im_start|>x"  # suffix ignored
    fill = OllamaGenerateRequest(model="coder", prompt="def f(", suffix=")\n").engine_request(CARD)
    [prompt] = fill.prompts
    assert prompt.fill is not None and prompt.fill.request.prefix == "def f("
    assert prompt.fill.request.suffix == ")\n" and prompt.fill.layout == Layout.PSM
    assert fill.params.editor is not None  # the suffix's first line ends a fill


def test_continues_repository_files_become_the_fills_other_files() -> None:
    prompt = (
        "<|repo_name|>proj\n<|file_sep|>a.py\ndef helper():\n    pass\n\n"
        "<|file_sep|>b.py\nX = 1\n<|file_sep|>main.py"
        "<|system_separator_istruction_repository_level|>import a\n"
    )
    request = fim_request(prompt, "\n")
    assert request.prefix == "import a\n" and request.suffix == "\n"
    assert request.extra == (Chunk("def helper():\n    pass\n", "a.py"), Chunk("X = 1", "b.py"))
    assert fim_request("plain", "s").extra == ()


def test_refusals_name_what_cannot_be_honoured() -> None:
    cases = [
        ({"raw": True, "system": "s"}, "raw mode does not support"),
        ({"images": ["aGk="]}, "images are not supported"),
        ({"template": "{{ .Prompt }}"}, "template is not supported"),
        ({"context": [1, 2]}, "context is not supported"),
        ({"keep_alive": "10"}, "not a duration"),
        ({"format": {"type": 12}}, "not a JSON schema"),
        ({"options": {"temperature": "hot"}}, "temperature"),
        ({"options": {"stop": [""] * 2}}, "stop"),
        ({"logprobs": True}, "logprobs are not supported"),
    ]
    for fields, message in cases:
        with pytest.raises(ValidationError, match=message):
            OllamaGenerateRequest.model_validate({"model": "coder", "prompt": "p", **fields})
    with pytest.raises(ValidationError, match="model is required"):
        OllamaShowRequest.model_validate({})
    body = OllamaGenerateRequest(model="coder", prompt="p", options={"num_ctx": 8192})  # type: ignore[arg-type]
    with pytest.raises(APIError, match="--max-seq-len") as refused:
        body.engine_request(CARD)
    assert refused.value.code is ErrorCode.CONTEXT_LENGTH_EXCEEDED


def test_think_switches_the_template_of_a_model_that_reasons_and_is_refused_elsewhere() -> None:
    def kwargs(think: Any, card: ModelCard = THINKING) -> Any:
        body = OllamaChatRequest(
            model="m", messages=[{"role": "user", "content": "q"}], think=think
        )  # type: ignore[list-item]
        return body.engine_request(card).prompts[0].template_kwargs

    assert kwargs(None) == {"enable_thinking": True}  # as Ollama: a model that reasons does
    assert kwargs(False) == {"enable_thinking": False}
    assert kwargs("max") == {"enable_thinking": True, "reasoning_effort": "high"}
    assert kwargs(False, CARD) is None
    with pytest.raises(APIError, match="'m' does not support thinking"):
        kwargs(True, CARD)


def test_chat_history_calls_and_results_without_ids() -> None:
    """Continue's second round: the call it ran (arguments an object, no id), then its
    result without tool_name or id."""
    body = OllamaChatRequest.model_validate(
        {
            "model": "coder",
            "messages": [
                {"role": "USER", "content": "weather in Paris and Rome?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"function": {"name": "weather", "arguments": {"city": "Paris"}}},
                        {
                            "function": {
                                "index": 1,
                                "name": "weather",
                                "arguments": {"city": "Rome"},
                            }
                        },
                    ],
                },
                {"role": "tool", "content": "18", "tool_name": "weather"},
                {"role": "tool", "content": "21"},
                {"role": "tool", "content": "stray"},
            ],
            "images": None,
        }
    )
    [prompt] = body.engine_request(CARD).prompts
    turns = list(prompt.messages or [])
    assert turns[0].role == "user"
    calls = turns[1].tool_calls or []
    assert [c.function.arguments for c in calls] == [{"city": "Paris"}, {"city": "Rome"}]
    assert [t.tool_call_id for t in turns[2:]] == [calls[0].id, calls[1].id, "call_4"]
    assert turns[2].name == "weather"


def test_tools_are_offered_to_the_model_and_refused_beside_a_format() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "q"}]
    body = OllamaChatRequest.model_validate({"model": "m", "messages": messages, "tools": [tool]})
    choice = body.engine_request(CARD).tools
    assert choice is not None and choice.mode == "auto" and choice.tools[0].name == "f"
    with pytest.raises(ValidationError, match="format cannot be combined with tool calls"):
        OllamaChatRequest.model_validate(
            {"model": "m", "messages": messages, "tools": [tool], "format": "json"}
        )
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert OllamaChatRequest(model="m", format="json").json_schema() == {"type": "object"}
    assert OllamaChatRequest(model="m", format=schema).json_schema() == schema


def test_keep_alive_names_and_embed_bodies() -> None:
    assert [parse_keep_alive(v) for v in (300, "5m", "1h30m", "-1s", "0", "250ms")] == [
        300,
        300,
        5400,
        math.inf,  # negative: for ever
        0,
        0.25,
    ]
    assert OllamaChatRequest(model="m", keep_alive=0).unloads()
    assert not OllamaChatRequest(model="m", keep_alive="5m").unloads()
    assert "coder" in model_names("coder:latest")
    assert "qwen2.5-coder-0.5b" in model_names("qwen2.5-coder:0.5b")
    assert OllamaEmbedRequest(model="m", input=["a", "b"]).truncate


def test_the_card_tells_continue_to_fill_in_the_middle_and_its_context() -> None:
    template = CARD.template()
    assert ".Suffix" in template and template.startswith("{{- if .Suffix }}<|fim_prefix|>")
    assert TOOLS_TEMPLATE in template
    assert ".Suffix" not in THINKING.template()
    spm = dataclasses.replace(CARD, layout=Layout.SPM).template()
    assert spm.index("{{ .Suffix }}") < spm.index("{{ .Prompt }}")
    # Continue reads each line with this expression, then JSON-parses a stop's value
    lines = [
        re.match(r"^(\S+)\s+((?:\".*\")|\S+)$", line) for line in CARD.parameters().split("\n")
    ]
    values = {m[1]: m[2] for m in lines if m}
    assert values == {"num_ctx": "4096", "stop": '"<|im_end|>"'} and len(lines) == 2
    assert json.loads(values["stop"]) == "<|im_end|>"
    assert CARD.capabilities() == ["completion", "tools", "insert"]
    assert THINKING.capabilities() == ["completion", "thinking"]
    assert tool_format(TOOLS_TEMPLATE) == "hermes"


def test_the_card_counts_parameters_and_lists_the_model() -> None:
    assert CARD.parameter_count() == 494_032_768  # Qwen2.5-0.5B's own count
    assert [human_number(n) for n in (494_032_768, 8_000_000_000, 1_543_714_304, 135_000)] == [
        "494.03M",
        "8B",
        "1.5B",
        "135K",
    ]
    listed = bodies.model_list(CARD)["models"]
    assert [m["name"] for m in listed] == ["coder", "coder-alias"]
    assert listed[0]["details"]["parameter_size"] == "494.03M"
    assert listed[0]["modified_at"] == "1970-01-01T00:00:00.000000Z"
    shown = bodies.show(CARD)
    assert shown["model_info"]["qwen2.context_length"] == 4096
    assert shown["model_info"]["general.architecture"] == "qwen2"
    assert bodies.running(CARD)["models"][0]["context_length"] == 4096


def _lines(writer: OllamaWriter, outs: list[StepOutput], counts: Counts) -> list[Any]:
    events = writer.start()
    for out in outs:
        events += writer.output(0, out)
    events += writer.finish(counts)
    return [e.data for e in events]


def test_the_writer_streams_pieces_then_the_done_line() -> None:
    clock = iter([2.0, 2.0]).__next__
    writer = OllamaWriter(
        _ticket(), "coder:latest", True, chat=False, clock=clock, wall=lambda: 0, load_s=0.25
    )
    outs = [_out("Hel", 1), _out("lo", 2), _out("", 2, FinishReason.EOS)]
    lines = _lines(writer, outs, Counts(3, 2))
    assert [line["response"] for line in lines] == ["Hel", "lo", ""]
    assert [line["done"] for line in lines] == [False, False, True]
    assert all(line["model"] == "coder:latest" for line in lines)
    assert lines[0]["created_at"] == "1970-01-01T00:00:00.000000Z"
    last = lines[-1]
    assert last["done_reason"] == "stop" and last["eval_count"] == 2
    assert last["prompt_eval_count"] == 3 and last["load_duration"] == 250_000_000
    assert last["total_duration"] == 1_000_000_000 and last["eval_duration"] == 500_000_000
    assert last["prompt_eval_duration"] == 250_000_000  # from arrival, less the load


def test_the_writer_keeps_thinking_apart_and_sends_whole_calls() -> None:
    plan = ToolPlan((), "auto", True, "hermes")
    plan = dataclasses.replace(plan, tools=(_tool(),))
    writer = OllamaWriter(_ticket(plan, "open"), "m", True, chat=True, clock=lambda: 2.0)
    text = [
        "hmm",
        "</think>",
        "Sure.",
        '<tool_call>\n{"name": "f", "arg',
        'uments": {"a": 1}}\n',
        "</tool_call>",
    ]
    outs = [_out(t, i + 1) for i, t in enumerate(text)] + [_out("", 5, FinishReason.EOS)]
    lines = _lines(writer, outs, Counts(3, 5))
    messages = [line["message"] for line in lines]
    assert "".join(m.get("thinking", "") for m in messages) == "hmm"
    assert "".join(m["content"] for m in messages) == "Sure."
    [called] = [m["tool_calls"] for m in messages if "tool_calls" in m]
    assert [c["function"] for c in called] == [{"index": 0, "name": "f", "arguments": {"a": 1}}]
    assert lines[-1]["done_reason"] == "stop" and lines[-1]["message"]["content"] == ""

    whole = OllamaWriter(_ticket(plan, "open"), "m", False, chat=True, clock=lambda: 2.0)
    for out in outs:
        assert whole.output(0, out) == []
    body = whole.body(Counts(3, 5))
    assert body["message"]["thinking"] == "hmm" and body["message"]["content"] == "Sure."
    assert [c["function"] for c in body["message"]["tool_calls"]] == [c["function"] for c in called]
    assert body["done"] is True and called[0]["id"].startswith("call_")


def test_a_failure_is_an_error_line_and_a_time_limit_ends_with_length() -> None:
    writer = OllamaWriter(_ticket(), "m", True, chat=False, clock=lambda: 2.0)
    assert writer.is_error(_out("", 1, Failure.OUT_OF_MEMORY))
    assert not writer.is_error(_out("", 1, Failure.TIMEOUT))
    error = APIError(ErrorCode.OUT_OF_MEMORY)
    assert [e.data for e in writer.fail(error, Counts(3, 1))] == [{"error": error.message}]
    assert bodies.done_reason(Failure.TIMEOUT) == "length"
    assert bodies.done_reason(FinishReason.STOP) == "stop"
    assert bodies.error_body(bodies.not_found("x")) == {"error": "model 'x' not found"}
    assert bodies.not_found("x").status == 404
    assert bodies.loaded("m", unload=True, chat=True)["done_reason"] == "unload"


def _tool() -> Any:
    from infer.api.tools import Tool

    return Tool("f", None, {"type": "object", "properties": {"a": {"type": "integer"}}})


def test_a_reply_names_the_model_of_its_card_and_its_keep_alive_in_seconds() -> None:
    body = OllamaGenerateRequest(model="coder:latest", prompt="p", keep_alive="1h30m")
    request = body.engine_request(CARD)
    assert request.model == "coder" and request.keep_alive == 5400  # the served name
    assert OllamaChatRequest(model="m", keep_alive=-1).keep_alive_s() == math.inf
    assert OllamaChatRequest(model="m").engine_request(CARD).keep_alive is None
    assert OllamaEmbedRequest(model="m", keep_alive="250ms").keep_alive_s() == 0.25
    with pytest.raises(ValidationError, match="not a duration"):
        OllamaEmbedRequest.model_validate({"model": "m", "keep_alive": "soon"})
    served = {"coder", "qwen2.5-coder-0.5b"}.__contains__
    assert served_name("coder:latest", served) == "coder"
    assert served_name("qwen2.5-coder:0.5b", served) == "qwen2.5-coder-0.5b"
    assert served_name("llama3", served) is None
    assert OllamaEmbedRequest(model="m", input="a").inputs() == ["a"]
    assert OllamaEmbedRequest(model="m", input="").inputs() == []  # Ollama's: only loads
    assert OllamaEmbeddingsRequest(model="m").inputs() == []


def test_every_model_is_listed_and_the_loaded_ones_say_when_they_expire() -> None:
    engine = EngineConfig(model="qwen2.5-coder-0.5b")
    unloaded = ModelCard.unloaded(("later",), engine, 400_000_000)
    assert unloaded.family == "" and unloaded.parameter_count() == 0
    assert unloaded.quantization == "Q4_K_M" and unloaded.file_format == "gguf"
    embedder = dataclasses.replace(CARD, names=("vectors",), embeds=True, parameter_total=22)
    assert embedder.capabilities() == ["embedding"]
    listed = bodies.model_list(CARD, unloaded, embedder)["models"]
    assert [m["name"] for m in listed] == ["coder", "coder-alias", "later", "vectors"]
    assert listed[2]["details"]["parameter_size"] == "" and listed[2]["size"] == 400_000_000
    assert listed[3]["details"]["parameter_size"] == "22"
    soon = dataclasses.replace(embedder, expires_at=0.0)
    running = bodies.running(CARD, soon)["models"]
    assert [m["expires_at"] for m in running] == [bodies.FOREVER] * 2 + [
        "1970-01-01T00:00:00.000000Z"
    ]
    assert bodies.show(unloaded)["model_info"] == {"general.basename": "later"}


def test_the_other_kind_of_model_is_refused_in_ollamas_words() -> None:
    wrong = APIError(ErrorCode.WRONG_MODEL_KIND, "model 'x' is an embedding model")
    for what, words in (("generate", "an embedding model"), ("embeddings", "generates text")):
        with pytest.raises(APIError) as refused, bodies.refusing("x:latest", what):  # type: ignore[arg-type]
            raise wrong
        assert refused.value.status == 400
        assert refused.value.message.startswith(f"'x:latest' does not support {what}: it is")
        assert words in refused.value.message
    with pytest.raises(APIError) as other, bodies.refusing("x", "chat"):
        raise APIError(ErrorCode.QUEUE_FULL)
    assert other.value.code is ErrorCode.QUEUE_FULL


def test_an_embedding_answer_says_how_long_it_waited_for_its_model() -> None:
    import torch

    answer = bodies.embedded("all-minilm", torch.zeros(2, 3), 7, spent=1.5, load_s=1.25)
    assert answer["embeddings"] == [[0.0] * 3] * 2 and answer["prompt_eval_count"] == 7
    assert answer["total_duration"] == 1_500_000_000
    assert answer["load_duration"] == 1_250_000_000
