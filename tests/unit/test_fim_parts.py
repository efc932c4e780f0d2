"""Fill-in-the-middle pieces without a model: the tokens read from a vocabulary, the prompt
builder's layouts and limits, and a code completion's line stops (through the detokenizer,
token by token, as the engine feeds it)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from infer.api.fim import (
    CUT_EVERY,
    LANDMARK_EVERY,
    Chunk,
    FimRequest,
    Layout,
    Limits,
    build,
    editor_stops,
    landmarks,
)
from infer.engine.detokenizer import IncrementalDetokenizer, line_stop
from infer.engine.params import EditorStops
from infer.models.fim import find_fim_tokens

QWEN_SPECIALS = [
    "<|endoftext|>",
    "<|im_end|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
]


def char_tokenizer(specials: list[str]) -> PreTrainedTokenizerBase:
    """One token per character (printable ASCII and newline), then ``specials``."""
    vocab = {chr(c): i for i, c in enumerate([10, *range(32, 127)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=" "))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


@pytest.fixture(scope="module")
def qwen_like() -> PreTrainedTokenizerBase:
    return char_tokenizer(QWEN_SPECIALS)


def ids(tokenizer: PreTrainedTokenizerBase, *names: str) -> list[int]:
    return [int(tokenizer.convert_tokens_to_ids(n)) for n in names]


def test_fim_tokens_come_from_the_vocabulary(qwen_like: PreTrainedTokenizerBase) -> None:
    fim = find_fim_tokens(qwen_like)
    assert fim is not None
    pre, mid, suf, pad, rep, sep, eot, im_end = ids(
        qwen_like, *QWEN_SPECIALS[2:], QWEN_SPECIALS[0], QWEN_SPECIALS[1]
    )
    assert (fim.prefix, fim.suffix, fim.middle) == (pre, suf, mid)
    assert (fim.pad, fim.repo, fim.sep) == (pad, rep, sep) and fim.repo_level
    # A fill ends on <|endoftext|> and the FIM control tokens; the chat EOS is the model's.
    assert fim.end == {eot, pad, rep, sep} and im_end not in fim.end


def test_gguf_metadata_names_them_first(qwen_like: PreTrainedTokenizerBase) -> None:
    fim = find_fim_tokens(qwen_like, {"tokenizer.ggml.fim_pre_token_id": 7})
    assert fim is not None and fim.prefix == 7


def test_a_vocabulary_without_them_does_not_fill_in_the_middle() -> None:
    assert find_fim_tokens(char_tokenizer(["<|endoftext|>", "<|fim_prefix|>"])) is None
    # StarCoder's spellings work as well as Qwen's
    star = find_fim_tokens(char_tokenizer(["<fim_prefix>", "<fim_middle>", "<fim_suffix>"]))
    assert star is not None and not star.repo_level


def encoder(tokenizer: PreTrainedTokenizerBase):  # type: ignore[no-untyped-def]
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    return encode


def test_layouts(qwen_like: PreTrainedTokenizerBase) -> None:
    encode, fim = encoder(qwen_like), find_fim_tokens(qwen_like)
    assert fim is not None
    request = FimRequest("def f(", "):\n    pass\n", middle="x")
    decode = qwen_like.decode
    psm = build(encode, fim, request, Layout.PSM)
    assert decode(psm.ids) == "<|fim_prefix|>def f(x<|fim_suffix|>):\n    pass\n<|fim_middle|>"
    spm = build(encode, fim, request, Layout.SPM)
    assert decode(spm.ids) == "<|fim_suffix|>):\n    pass\n<|fim_prefix|>def f(x<|fim_middle|>"
    assert (psm.prefix_tokens, psm.suffix_tokens, psm.truncated) == (7, 12, False)
    # Code that spells a special token stays text.
    odd = build(encode, fim, FimRequest("s = '<|fim_middle|>'", ""), Layout.PSM)
    assert odd.ids.count(fim.middle) == 1


CODE = "".join(f"    value_{i} = compute({i}, {i * 7 % 5})\n" for i in range(60))


def test_landmarks_are_chosen_by_content() -> None:
    marks = landmarks(CODE)
    assert 60 // LANDMARK_EVERY // 3 < len(marks) < 60 // LANDMARK_EVERY * 3
    assert all(CODE[m - 1] == "\n" for m in marks)
    # a window of lines that slides on keeps them (each where its line now is)
    shift = CODE.index("\n") + 1
    assert landmarks(CODE[shift:]) == [m - shift for m in marks if m - shift > 0]
    # the line being typed is never one
    assert landmarks("a\nb") == [] and landmarks(CODE + "    val")[-1] <= len(CODE)


def test_anchored_layout_moves_the_last_lines_after_the_middle_token(
    qwen_like: PreTrainedTokenizerBase,
) -> None:
    encode, fim = encoder(qwen_like), find_fim_tokens(qwen_like)
    assert fim is not None
    text = CODE + "    ret"
    anchor = landmarks(text)[-1]
    built = build(encode, fim, FimRequest(text, "\nnext\n"), Layout.ANCHORED)
    assert qwen_like.decode(built.ids) == (
        f"<|fim_prefix|>{text[:anchor]}<|fim_suffix|>\nnext\n<|fim_middle|>{text[anchor:]}"
    )
    # Typing on: each prompt starts with the one before (up to the cursor's last token),
    # but where a line just typed is a landmark: the suffix is read again there.
    previous, moved = built.ids, 0
    for i in range(40):
        typed = text + "".join(f"urn {j}\n    ret" for j in range(i + 1))
        now = build(encode, fim, FimRequest(typed, "\nnext\n"), Layout.ANCHORED).ids
        if now[: len(previous) - 1] != previous[:-1]:
            moved += 1
            assert landmarks(typed)[-1] > landmarks(typed[: typed.rindex("urn")])[-1]
        previous = now
    assert 0 < moved < 40 // 2


def test_limits_cut_the_prefix_at_a_landmark_and_keep_the_suffix_start(
    qwen_like: PreTrainedTokenizerBase,
) -> None:
    encode, fim = encoder(qwen_like), find_fim_tokens(qwen_like)
    assert fim is not None
    limits = Limits(prefix=600, suffix=5)
    built = build(encode, fim, FimRequest(CODE, "0123456789"), Layout.PSM, limits)
    assert built.truncated and built.suffix_tokens == 5 and built.prefix_tokens <= 600
    kept = qwen_like.decode(built.ids).removeprefix("<|fim_prefix|>").split("<|fim_suffix|>")[0]
    assert len(CODE) - len(kept) in landmarks(CODE, CUT_EVERY)
    assert set(landmarks(CODE, CUT_EVERY)) <= set(landmarks(CODE))
    assert qwen_like.decode(built.ids).endswith("<|fim_suffix|>01234<|fim_middle|>")
    # More typed: the kept prefix starts at the same line
    more = CODE + "    x = 1\n"
    longer = build(encode, fim, FimRequest(more, "0123456789"), Layout.PSM, limits)
    assert longer.ids[: built.prefix_tokens] == built.ids[: built.prefix_tokens]
    # a single line longer than the limit is cut inside it
    line = build(encode, fim, FimRequest("x" * 900, ""), Layout.PSM, Limits(prefix=100))
    assert line.prefix_tokens == 100


def test_extra_files_in_the_repo_level_format(qwen_like: PreTrainedTokenizerBase) -> None:
    encode, fim = encoder(qwen_like), find_fim_tokens(qwen_like)
    assert fim is not None
    extra = [Chunk("import os\n", "a.py"), Chunk("x = 1\n", "b.py")]
    built = build(encode, fim, FimRequest("y", "", extra=extra), Layout.PSM)
    assert qwen_like.decode(built.ids) == (
        "<|repo_name|>myproject\n<|file_sep|>a.py\nimport os\n<|file_sep|>b.py\nx = 1\n"
        "<|file_sep|>filename\n<|fim_prefix|>y<|fim_suffix|><|fim_middle|>"
    )
    # Too little room: the most recent whole files are kept.
    few = build(encode, fim, FimRequest("y", "", extra=extra), Layout.PSM, Limits(extra=40))
    assert few.truncated and "a.py" not in qwen_like.decode(few.ids)
    assert "b.py" in qwen_like.decode(few.ids)


def feed(text: str, stops: EditorStops, pieces: int = 1) -> str:
    """What a completion shows when ``text`` arrives a character at a time (or in chunks of
    ``pieces``), cut by ``stops``."""
    tokenizer = char_tokenizer(["<|endoftext|>"])
    detok = IncrementalDetokenizer(tokenizer, [], lines=stops)
    shown = ""
    for i in range(0, len(text), pieces):
        for token in tokenizer.encode(text[i : i + pieces], add_special_tokens=False):
            shown += detok.add(token)
        if detok.stopped:
            return shown
    return shown + detok.finish()


@pytest.mark.parametrize("pieces", [1, 3, 100])
def test_a_line_indented_less_ends_the_completion(pieces: int) -> None:
    body = "x = 1\n    y = 2\n\n  z = 3\nw"
    assert feed(body, EditorStops(indent=4), pieces) == "x = 1\n    y = 2\n"
    assert feed(body, EditorStops(indent=4, keep_newline=True), pieces) == "x = 1\n    y = 2\n\n"
    # the first line is the cursor's: never judged
    assert feed("  a\n    b", EditorStops(indent=4), pieces) == "  a\n    b"


@pytest.mark.parametrize("pieces", [1, 2, 100])
def test_repeating_the_suffix_line_ends_the_completion(pieces: int) -> None:
    stops = EditorStops(suffix_line="return y")
    assert feed("y = 2\n    return y\n", stops, pieces) == "y = 2"
    assert feed("y = 2\n    return y", stops, pieces) == "y = 2"  # at the end, too
    assert feed("y = 2\n    return y2\n", stops, pieces) == "y = 2\n    return y2\n"
    keep = EditorStops(suffix_line="return y", keep_newline=True)
    assert feed("a\n    return y", keep, pieces) == "a\n"


def test_line_stop_holds_back_only_what_is_undecided() -> None:
    stops = EditorStops(indent=4, suffix_line="return y")
    assert line_stop(stops, "abc", False) == (None, None)  # the first line is free
    assert line_stop(stops, "abc\n  ", False) == (None, 3)  # indentation still arriving
    assert line_stop(stops, "abc\n    ret", False) == (None, 3)  # may become the suffix
    assert line_stop(stops, "abc\n    x", False) == (None, None)  # decided: shown
    assert line_stop(stops, "abc\n  x", False) == (3, None)


def test_editor_stops_from_the_suffix() -> None:
    # The cursor at a line's end: the suffix brings the newline; a cut takes it away.
    at_end = editor_stops("\n\n    return y\n", indent=4, time_budget_s=1.0, line_head="  x")
    assert at_end == EditorStops(4, 1.0, "return y", keep_newline=False)
    # The cursor at a line's start: the fill keeps its last newline.
    start = editor_stops("    return y\n")
    assert start.keep_newline and start.suffix_line == "return y"
    # The cursor inside a line: the rest of it is not written twice
    inside = editor_stops("))\n    return y\n", line_head="print(area(")
    assert inside == EditorStops(0, None, "return y", False, "))")
    assert editor_stops("   \n", at_suffix=True).suffix_line == ""
    assert editor_stops("x", at_suffix=False) == EditorStops()


@pytest.mark.parametrize("pieces", [1, 2, 100])
def test_a_first_line_that_ends_with_the_rest_of_the_line_stops_before_it(pieces: int) -> None:
    stops = EditorStops(line_rest="))")
    assert feed("radius))\nprint(1)", stops, pieces) == "radius"
    assert feed("radius))", stops, pieces) == "radius"
    assert feed("radius) + 1\nx", stops, pieces) == "radius) + 1\nx"
    # only the first line
    assert feed("a\nb))\n", stops, pieces) == "a\nb))\n"


def test_healing_cuts_the_prompt_back_to_the_cursors_word(
    qwen_like: PreTrainedTokenizerBase,
) -> None:
    encode, fim = encoder(qwen_like), find_fim_tokens(qwen_like)
    assert fim is not None

    def decode(ids: list[int]) -> str:
        return str(qwen_like.decode(ids))

    text = "x = 1\n    t.ap"
    built = build(encode, fim, FimRequest(text, "\n"), Layout.ANCHORED, decode=decode)
    # (one token a character here: the word and the run of spaces before it are cut back)
    assert built.healing == "    t.ap"
    assert qwen_like.decode(built.ids).endswith("<|fim_middle|>x = 1\n")
    # a line of indentation only is cut back whole; a line start is left alone
    blank = build(encode, fim, FimRequest("x = 1\n    ", "\n"), Layout.ANCHORED, decode=decode)
    assert blank.healing == "    "
    start = build(encode, fim, FimRequest("x = 1\n", "\n"), Layout.ANCHORED, decode=decode)
    assert start.healing == "" and qwen_like.decode(start.ids).endswith("x = 1\n")
    # the plain order ends the prompt with <MID>: nothing to heal
    assert build(encode, fim, FimRequest(text, "\n"), Layout.PSM, decode=decode).healing == ""


def test_a_healing_completion_spells_the_cut_text_first(
    qwen_like: PreTrainedTokenizerBase,
) -> None:
    import torch

    from infer.engine.healing import Vocabulary, advance, heal_logits
    from infer.engine.params import SamplingParams
    from infer.engine.request import Request

    vocab = Vocabulary(qwen_like, len(qwen_like))
    allowed = {qwen_like.decode([i]) for i in vocab.allowed(" ab").tolist()}
    assert allowed == {" "}  # one character a token: the only start of " ab"
    req = Request("r", [1], SamplingParams(healing=" ab"))
    req.heal_left = " ab"
    logits = torch.zeros(1, len(qwen_like))
    healed = heal_logits(logits, [req], vocab)
    assert int(healed.argmax()) == qwen_like.convert_tokens_to_ids(" ")
    assert torch.isinf(healed).sum() == len(qwen_like) - 1 and not torch.isinf(logits).any()
    for piece in (" ", "a"):
        advance(req, piece)
    assert req.heal_left == "b"
    advance(req, "b")
    assert req.heal_left == "" and heal_logits(logits, [req], vocab) is logits
    # the cut text is not shown again
    detok = IncrementalDetokenizer(qwen_like, [], skip=" ab")
    shown = "".join(detok.add(t) for t in qwen_like.encode(" abc d", add_special_tokens=False))
    assert shown + detok.finish() == "c d"
