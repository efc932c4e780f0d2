"""Tool calls and reasoning read out of streamed text, and the grammar that keeps calls valid."""

from __future__ import annotations

import json
import random

import pytest
from transformers import PreTrainedTokenizerBase

from infer.api.chat import ReplyParser
from infer.api.reasoning import thinking, with_reasoning
from infer.api.tools import Tool, ToolPlan, answer_format, near_miss, tool_format
from infer.engine.grammar import GrammarCompiler

WEATHER = Tool(
    "get_weather",
    "The weather in a city",
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CALC = Tool("calc", None, {"type": "object", "properties": {"x": {"type": "number"}}})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _plan(mode: str = "auto", fmt: str = "hermes", parallel: bool = True) -> ToolPlan:
    return ToolPlan((WEATHER, CALC), mode, parallel, fmt)  # type: ignore[arg-type]


def _stream(parser: ReplyParser, text: str, rng: random.Random) -> list[dict]:
    """Feed ``text`` in random pieces; the OpenAI deltas it gives."""
    deltas, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        deltas.append(parser.feed(text[i : i + n]).as_openai())
        i += n
    deltas.append(parser.finish().as_openai())
    return [d for d in deltas if d]


def _joined(deltas: list[dict]) -> tuple[str, str, dict[int, dict]]:
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning", "") for d in deltas)  # both fields
    calls: dict[int, dict] = {}
    for d in deltas:
        for entry in d.get("tool_calls", []):
            call = calls.setdefault(entry["index"], {"arguments": ""})
            if "id" in entry:
                assert "id" not in call, "a call's id is sent once, in its first entry"
                call.update(id=entry["id"], name=entry["function"]["name"])
            call["arguments"] += entry["function"]["arguments"]
            assert "id" in call, "a call's first entry names it"
    return content, reasoning, calls


@pytest.mark.parametrize("seed", range(5))
def test_streamed_calls_read_the_same_however_the_text_is_cut(seed: int) -> None:
    second = CALL.replace("Paris", "Lyon")
    text = f"Let me check.\n{CALL}\n{second}"
    parser = ReplyParser(_plan(), None)
    content, _, calls = _joined(_stream(parser, text, random.Random(seed)))
    assert content == "Let me check."
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Lyon"}),
    ]
    assert [c.arguments for c in parser.calls] == ['{"city": "Paris"}', '{"city": "Lyon"}']
    assert len({c["id"] for c in calls.values()}) == 2


def test_a_call_cut_off_part_way_is_not_a_call() -> None:
    parser = ReplyParser(_plan(), None)
    parser.feed(CALL[:50])
    parser.finish()
    assert parser.calls == []  # never reported complete


def test_text_without_calls_is_all_content() -> None:
    parser = ReplyParser(_plan(), None)
    text = "The weather is <b>fine</b>, 3 < 4 and {braces} too.\n"
    content, _, calls = _joined(_stream(parser, text, random.Random(0)))
    assert content == text and calls == {}


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '  {"name": "get_weather", "parameters": {"city": "Paris"}}  ',
        '[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]',
    ],
)
def test_a_near_miss_call_is_read_as_the_call_it_meant(text: str) -> None:
    assert near_miss(text, _plan()) == [("get_weather", '{"city": "Paris"}')]
    parser = ReplyParser(_plan(), None)
    content, _, calls = _joined(_stream(parser, text, random.Random(1)))
    assert content == "" and [c["name"] for c in calls.values()] == ["get_weather"]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "get_weather", "arguments": {"town": "Paris"}}',  # does not fit the schema
        '{"name": "unknown", "arguments": {}}',  # not an offered tool
        '{"name": "get_weather", "arguments": {"city": "Paris"}, "x": 1}',
        'Sure: {"name": "get_weather", "arguments": {"city": "Paris"}}',  # prose around it
        '{"a": 1}',
    ],
)
def test_json_that_is_not_a_call_stays_content(text: str) -> None:
    assert near_miss(text, _plan()) is None
    parser = ReplyParser(_plan(), None)
    content, _, calls = _joined(_stream(parser, text, random.Random(2)))
    assert content == text and calls == {}


def test_llama_calls_are_bare_json_with_parameters() -> None:
    text = '{"name": "calc", "parameters": {"x": 2}}'
    parser = ReplyParser(_plan(fmt="llama"), None)
    _, _, calls = _joined(_stream(parser, text, random.Random(3)))
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("calc", '{"x": 2}')]


@pytest.mark.parametrize("seed", range(3))
def test_reasoning_is_split_off_before_calls_are_looked_for(seed: int) -> None:
    text = f"<think>I could write {CALL} but first</think>\n\nChecking.\n{CALL}"
    parser = ReplyParser(_plan(), "auto")
    content, reasoning, calls = _joined(_stream(parser, text, random.Random(seed)))
    assert reasoning == f"I could write {CALL} but first"
    assert content == "Checking."
    assert len(calls) == 1


def test_a_reply_that_starts_inside_the_block_and_never_closes_it_is_reasoning() -> None:
    parser = ReplyParser(None, "open")
    content, reasoning, _ = _joined(_stream(parser, "still thinking", random.Random(4)))
    assert (content, reasoning) == ("", "still thinking")


def test_the_prompt_says_where_the_reply_starts() -> None:
    template = "... <think> ... </think> ..."
    assert thinking(template, "<|im_start|>assistant\n") == "auto"
    assert thinking(template, "<|im_start|>assistant\n<think>\n") == "open"
    assert thinking(template, "assistant\n<think>\n\n</think>\n\n") is None  # switched off
    assert thinking("no thinking here", "<think>\n") is None


def test_the_template_chooses_the_call_format() -> None:
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert tool_format('{% if tools %}{"name": ..., "parameters": ...}{% endif %}') == "llama"
    assert tool_format("{{ messages }}") == "generic"
    assert tool_format(None) == "generic"


@pytest.fixture(scope="module")
def compiler(default_tokenizer: PreTrainedTokenizerBase) -> GrammarCompiler:
    return GrammarCompiler(
        default_tokenizer, len(default_tokenizer), [default_tokenizer.eos_token_id]
    )


def _accepts(
    compiler: GrammarCompiler, tag: dict, tokenizer: PreTrainedTokenizerBase, text: str
) -> bool:
    matcher = compiler.structural_tag(tag, "test").new_state().matcher
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize(
    ("mode", "text", "accepted"),
    [
        ("auto", "It is sunny.", True),
        ("auto", CALL, True),
        ("auto", f"Let me look. {CALL}", True),
        ("auto", CALL.replace("city", "town"), False),  # arguments must fit the schema
        ("auto", '{"name": "get_weather"', False),  # a bare call: only in the tags
        ("auto", "```json\n{", False),
        ("required", "It is sunny.", False),  # a call from the first token
        ("required", CALL, True),
        ("forced", CALL, True),
        ("forced", '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>', False),
    ],
)
def test_the_grammar_lets_text_through_and_keeps_calls_valid(
    compiler: GrammarCompiler,
    default_tokenizer: PreTrainedTokenizerBase,
    mode: str,
    text: str,
    accepted: bool,
) -> None:
    tag = with_reasoning(answer_format(_plan(mode)), None)
    assert _accepts(compiler, tag, default_tokenizer, text) is accepted


def test_the_grammar_leaves_the_reasoning_block_free(
    compiler: GrammarCompiler, default_tokenizer: PreTrainedTokenizerBase
) -> None:
    tag = with_reasoning({"type": "json_schema", "json_schema": {"type": "object"}}, "auto")
    assert _accepts(compiler, tag, default_tokenizer, '<think>anything {[</think>\n\n{"a": 1}')
    assert not _accepts(compiler, tag, default_tokenizer, "<think>x</think>\n\nnot json")
