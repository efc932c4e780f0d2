"""Tool calls and reasoning read out of streamed text, and the grammar that keeps calls valid."""

from __future__ import annotations

import json
import random

import pytest
from transformers import PreTrainedTokenizerBase

from infer.api.chat import ReplyParser
from infer.api.reasoning import thinking, with_reasoning
from infer.api.tools import Openings, Tool, ToolPlan, answer_format, calls_format, tool_format
from infer.engine.grammar import GrammarCompiler, allocate_bitmask

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


def test_a_call_cut_off_part_way_is_not_a_call_and_none_of_it_is_content() -> None:
    for cut in (len('<tool_call>\n{"na'), 50):
        parser = ReplyParser(_plan(), None)
        text = f"{CALL}\n{CALL[:cut]}"
        content, _, calls = _joined(_stream(parser, text, random.Random(cut)))
        assert content == ""  # the cut call's opening never leaks into the content
        assert [c.arguments for c in parser.calls] == ['{"city": "Paris"}']


@pytest.mark.parametrize("mode", ["required", "forced"])
def test_a_reply_that_must_call_is_read_from_its_first_piece(mode: str) -> None:
    parser = ReplyParser(_plan(mode), None)
    deltas = [parser.feed("").as_openai()]  # a first output whose text is still held
    deltas += _stream(parser, f"{CALL}\n{CALL}", random.Random(6))
    content, _, calls = _joined([d for d in deltas if d])
    assert content == "" and [c["name"] for c in calls.values()] == ["get_weather"] * 2


def test_text_without_calls_is_all_content() -> None:
    parser = ReplyParser(_plan(), None)
    text = "The weather is <b>fine</b>, 3 < 4 and {braces} too.\n"
    content, _, calls = _joined(_stream(parser, text, random.Random(0)))
    assert content == text and calls == {}


@pytest.mark.parametrize(
    "text",
    [
        "```python\ndef reverse(s):\n    return s[::-1]\n```",
        "- apples\n- pears\n",
        "# Title\n\nSome text.",
        '"quoted" words',
        '```json\n{"a": 1}\n```',
        "[1, 2, 3]",
    ],
)
def test_replies_that_open_no_call_stream_as_they_come(text: str) -> None:
    parser = ReplyParser(_plan(), None)
    shown = "".join(parser.feed(ch).content for ch in text)
    # held back at most: a possible fence or JSON opening, or trailing whitespace
    assert len(shown) >= len(text.rstrip()) - len("```json\n{")
    assert shown + parser.finish().content == text


@pytest.mark.parametrize(
    "text",
    [
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        '```\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }\n}\n```',
        '{"name": "get_weather", "arguments": {"city": "Paris"}}',
        '  {"name": "get_weather", "parameters": {"city": "Paris"}}  ',
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    ],
)
def test_a_json_call_that_opens_the_reply_is_a_call(text: str) -> None:
    parser = ReplyParser(_plan(), None)
    content, _, calls = _joined(_stream(parser, text, random.Random(1)))
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris"})
    ]


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "unknown", "arguments": {}}',  # not an offered tool
        'Sure: {"name": "get_weather", "arguments": {"city": "Paris"}}',  # not at the start
        '```python\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        '{"a": 1}',
    ],
)
def test_json_that_opens_no_call_stays_content(text: str) -> None:
    assert Openings(_plan()).scan(text) == (len(text), False)
    parser = ReplyParser(_plan(), None)
    content, _, calls = _joined(_stream(parser, text, random.Random(2)))
    assert content == text and calls == {}


@pytest.mark.parametrize(
    "text",
    [
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "calc", "arguments": {"x": 2}}]',
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '{"name": "calc", "arguments": {"x": 2}}\n```',
        '```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '[{"name": "calc", "arguments": {"x": 2}}]\n```',
    ],
)
def test_several_json_calls_in_a_list_or_a_fence_are_several_calls(text: str) -> None:
    parser = ReplyParser(_plan(), None)
    content, _, calls = _joined(_stream(parser, text, random.Random(5)))
    assert content == "" and [c["name"] for c in calls.values()] == ["get_weather", "calc"]


@pytest.mark.parametrize("seed", range(3))
def test_after_a_call_the_reply_is_read_as_before(seed: int) -> None:
    fenced = '```json\n{"name": "calc", "arguments": {"x": 1}}\n```'
    text = f'{fenced}\n\n{CALL}\n{{"temp": 18}} is what it said.\n{fenced}\n'
    parser = ReplyParser(_plan(), None)
    content, _, calls = _joined(_stream(parser, text, random.Random(seed)))
    assert [c["name"] for c in calls.values()] == ["calc", "get_weather"]
    # a JSON call after prose is not at the start of the answer, nor right after a call
    assert content == f'{{"temp": 18}} is what it said.\n{fenced}\n'


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


@pytest.mark.parametrize("seed", range(3))
def test_a_block_left_in_the_content_opens_no_call(seed: int) -> None:
    text = f"<think>I could write {CALL} but first</think>\n\nChecking.\n{CALL}"
    parser = ReplyParser(_plan(), "auto", separate=False)
    content, reasoning, calls = _joined(_stream(parser, text, random.Random(seed)))
    assert reasoning == ""
    assert content == f"<think>I could write {CALL} but first</think>\n\nChecking."
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


def _lazy_run(
    compiler: GrammarCompiler, tokenizer: PreTrainedTokenizerBase, text: str, plan: ToolPlan
) -> tuple[int | None, bool]:
    """Feed ``text``'s tokens through the lazy grammar of ``plan``, as the engine does: the
    first token that a constrained mask would refuse (or ``None``), and whether the grammar
    constrained any token."""
    tag = {"type": "structural_tag", "format": calls_format(plan)}
    grammar = compiler.lazy(tag, Openings(plan).scan, plan.parallel, "test")
    state = grammar.new_state()
    ids = tokenizer.encode(text, add_special_tokens=False)
    bitmask = allocate_bitmask(1, len(tokenizer))
    constrained = False
    for i, token in enumerate(ids):
        state.advance(ids[:i])
        if state.active:
            constrained = True
            bitmask.fill_(-1)
            state.fill(bitmask, 0)
            if not (int(bitmask[0, token // 32]) >> (token % 32)) & 1:
                return i, True
    return None, constrained


@pytest.mark.parametrize(
    "text",
    [
        "It is sunny.",
        "```python\nprint('{\"name\": 1}')\n```",
        "- a\n- b",
        '"quoted"',
        '{"name": "someone else", "arguments": {}}',
        "Let me think about get_weather and <tool_ without calling.",
    ],
)
def test_the_lazy_grammar_masks_nothing_in_a_reply_that_opens_no_call(
    compiler: GrammarCompiler, default_tokenizer: PreTrainedTokenizerBase, text: str
) -> None:
    assert _lazy_run(compiler, default_tokenizer, text, _plan()) == (None, False)


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        (CALL, None),
        (f"Let me look.\n{CALL}\n{CALL}", None),
        (
            '```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Paris"\n  }'
            "\n}\n```",
            None,
        ),
        (
            '[{"name": "calc", "arguments": {"x": 1}}, {"name": "calc", "arguments": {"x": 2}}]',
            None,
        ),
        (
            '```json\n{"name": "calc", "arguments": {"x": 1}}\n'
            '{"name": "calc", "arguments": {"x": 2}}\n```',
            None,
        ),
        (CALL.replace("city", "town"), "town"),  # arguments must fit the schema
        ('{"name": "get_weather", "arguments": {"city": 3}}', "3"),
        (f"{CALL}\nAnd some text after it.", None),  # free again after a call
    ],
)
def test_once_a_call_opens_the_lazy_grammar_keeps_it_valid(
    compiler: GrammarCompiler,
    default_tokenizer: PreTrainedTokenizerBase,
    text: str,
    refused: str | None,
) -> None:
    at, active = _lazy_run(compiler, default_tokenizer, text, _plan())
    assert active
    if refused is None:
        assert at is None
    else:
        assert at is not None
        ids = default_tokenizer.encode(text, add_special_tokens=False)
        assert default_tokenizer.decode(ids[at:]).lstrip().startswith(refused)


def test_without_parallel_calls_the_grammar_stops_after_one(
    compiler: GrammarCompiler, default_tokenizer: PreTrainedTokenizerBase
) -> None:
    for after in (CALL, "And some text after it."):
        text = f"{CALL}\n{after}"
        at, _ = _lazy_run(compiler, default_tokenizer, text, _plan(parallel=False))
        assert at is not None
        ids = default_tokenizer.encode(text, add_special_tokens=False)
        assert default_tokenizer.decode(ids[:at]).rstrip() == CALL


@pytest.mark.parametrize(
    ("mode", "text", "accepted"),
    [
        ("required", "It is sunny.", False),  # a call from the first token
        ("required", CALL, True),
        ("forced", CALL, True),
        ("forced", '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>', False),
    ],
)
def test_a_grammar_that_must_call_calls_from_the_first_token(
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
    # the model decides whether to think, and how it spaces the answer after the block
    assert _accepts(compiler, tag, default_tokenizer, '{"a": 1}')
    assert _accepts(compiler, tag, default_tokenizer, '<think>x</think>\n{"a": 1}')
    assert _accepts(compiler, tag, default_tokenizer, '<think>x</think>{"a": 1}')
