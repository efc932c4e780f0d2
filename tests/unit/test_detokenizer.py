"""Incremental detokenizer tests with the real default tokenizer (byte-level BPE)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import PreTrainedTokenizerBase

from infer.engine.detokenizer import IncrementalDetokenizer

FFFD = "\ufffd"
PROPERTY_SETTINGS = settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

EMOJI = [
    "😀",
    "🎉",
    "👍🏽",
    "❤️",
    "🇯🇵",
    "🇫🇷",
    "👨‍👩‍👧",
    "🏳️‍🌈",
    "🧑🏾‍💻",
    "✨",
    "🦀",
]
words = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCXYZ0123456789.,!?'-", min_size=1, max_size=8)
spaces = st.sampled_from([" ", "  ", "\n", "\n\n", "\t", " \n "])
cjk = st.text(
    alphabet=st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF), min_size=1, max_size=4
)
accented = st.text(alphabet="àáâãäåçèéêëìíîïñòóôõöùúûüýÿœßÀÉÎÕÜŁłŠšŽžĞğİı", min_size=1, max_size=6)
texts = st.lists(st.one_of(words, spaces, st.sampled_from(EMOJI), cjk, accented), max_size=25).map(
    "".join
)


def decode(tok: PreTrainedTokenizerBase, ids: list[int], skip: bool = True) -> str:
    """``tok.decode`` of one sequence (typed as ``str``: it is never a batch here)."""
    return cast(str, tok.decode(ids, skip_special_tokens=skip))


def stream(det: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    """Feed ``ids`` one by one; return every delta, with ``finish()`` last."""
    return [det.add(i) for i in ids] + [det.finish()]


def assert_streams_like_decode(
    tok: PreTrainedTokenizerBase, prompt: list[int], ids: list[int], skip: bool = True
) -> None:
    """The deltas concatenate to the full decode, and no U+FFFD comes out early."""
    det = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    full = decode(tok, ids, skip)
    emitted = ""
    for n, token in enumerate(ids, start=1):
        delta = det.add(token)
        emitted += delta
        # What is shown is final: a prefix of the decode so far, and so of the full one.
        assert decode(tok, ids[:n], skip).startswith(emitted)
    emitted += det.finish()
    assert emitted == full
    assert det.text == full
    assert not det.stopped


@pytest.fixture(scope="module")
def tok(default_tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    return default_tokenizer


@pytest.fixture(scope="module")
def fragment_ids(tok: PreTrainedTokenizerBase) -> list[int]:
    """Tokens that are, on their own, an incomplete or invalid piece of UTF-8."""
    return [i for i in range(len(tok)) if FFFD in tok.decode([i])]


# --- the streaming property -----------------------------------------------------------


@PROPERTY_SETTINGS
@given(prompt=texts, text=texts)
def test_text_streams_exactly(tok: PreTrainedTokenizerBase, prompt: str, text: str) -> None:
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, tok.encode(prompt))
    deltas = stream(det, ids)
    assert "".join(deltas) == decode(tok, ids) == text
    assert not any(FFFD in d for d in deltas)


@PROPERTY_SETTINGS
@given(data=st.data(), skip=st.booleans())
def test_random_ids_stream_exactly(
    tok: PreTrainedTokenizerBase, fragment_ids: list[int], data: st.DataObject, skip: bool
) -> None:
    token = st.one_of(
        st.integers(0, len(tok) - 1),
        st.sampled_from(fragment_ids),
        st.sampled_from(fragment_ids),
        st.integers(0, 16),  # special tokens
    )
    prompt = data.draw(st.lists(token, max_size=8), label="prompt")
    ids = data.draw(st.lists(token, max_size=40), label="ids")
    assert_streams_like_decode(tok, prompt, ids, skip)


def test_fragments_are_held_until_the_character_completes(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode("a 😀 日本")
    det = IncrementalDetokenizer(tok, [])
    deltas = stream(det, ids)
    assert "" in deltas  # some tokens were only part of a character
    assert not any(FFFD in d for d in deltas)
    assert "".join(deltas) == "a 😀 日本"


def test_dangling_fragment_is_released_by_finish(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode("ok 😀")[:-1]  # drop the emoji's last byte(s)
    det = IncrementalDetokenizer(tok, [])
    deltas = [det.add(i) for i in ids]
    assert "".join(deltas) == "ok"
    assert det.finish() == decode(tok, ids)[len("ok") :]
    assert det.text.endswith(FFFD)


def test_prompt_ending_mid_character(tok: PreTrainedTokenizerBase) -> None:
    """The prompt's dangling bytes do not glue onto the generated ones."""
    ids = tok.encode("ok 😀 and 日本")
    cut = next(n for n in range(1, len(ids)) if decode(tok, ids[:n]).endswith(FFFD))
    prompt, generated = ids[:cut], ids[cut:]
    assert_streams_like_decode(tok, prompt, generated)


def test_special_tokens_skipped_or_kept(tok: PreTrainedTokenizerBase) -> None:
    ids = [*tok.encode("Hi"), tok.eos_token_id]
    assert "".join(stream(IncrementalDetokenizer(tok, []), ids)) == "Hi"
    kept = "".join(stream(IncrementalDetokenizer(tok, [], skip_special_tokens=False), ids))
    assert kept == "Hi" + tok.eos_token


def test_leading_space_of_each_token(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode("Hello world, again")
    assert stream(IncrementalDetokenizer(tok, []), ids)[:2] == ["Hello", " world"]
    det = IncrementalDetokenizer(tok, tok.encode("Hello"))
    assert det.add(tok.encode(" world")[0]) == " world"


def test_window_stays_small(tok: PreTrainedTokenizerBase) -> None:
    """Per-token work is bounded by a small window, not by the length so far."""
    lengths: list[int] = []

    class Spy:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            lengths.append(len(ids))
            return decode(tok, ids, skip_special_tokens)

    ids = tok.encode("the quick brown fox jumps over the lazy dog " * 20)
    det = IncrementalDetokenizer(Spy(), ids[:10])  # type: ignore[arg-type]
    assert "".join(stream(det, ids)) == decode(tok, ids)
    assert max(lengths) <= 6


# --- stop strings ---------------------------------------------------------------------


def test_stop_split_across_tokens(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode("Hello world and more")
    assert tok.convert_ids_to_tokens(ids[:2]) == ["Hello", "Ġworld"]
    det = IncrementalDetokenizer(tok, [], stop=["lo wo"])
    deltas = [det.add(i) for i in ids]
    assert "".join(deltas) == "Hel"
    assert det.stopped and det.text == "Hel"
    assert det.add(ids[0]) == "" and det.finish() == ""


def test_stop_inside_one_token_cuts_it(tok: PreTrainedTokenizerBase) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["orl", "and"])
    out = "".join(stream(det, tok.encode("Hello world and more")))
    assert out == "Hello w" and det.stopped


def test_earliest_stop_wins(tok: PreTrainedTokenizerBase) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["more", " and"])
    assert "".join(stream(det, tok.encode("Hello world and more"))) == "Hello world"
    assert det.matched == " and"  # which one ended the text (Anthropic's stop_sequence)


def test_held_prefix_released_when_not_a_stop(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode("Hello world and more")
    det = IncrementalDetokenizer(tok, [], stop=["world peace"])
    deltas = stream(det, ids)
    assert deltas[:2] == ["Hello", " "]  # "world" held: it may begin "world peace"
    assert deltas[2] == "world and"
    assert "".join(deltas) == "Hello world and more"
    assert not det.stopped and det.matched is None


def test_finish_releases_held_prefix(tok: PreTrainedTokenizerBase) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["world peace"])
    deltas = [det.add(i) for i in tok.encode("Hello world")]
    assert "".join(deltas) == "Hello "
    assert det.finish() == "world"
    assert det.text == "Hello world" and not det.stopped


def test_stop_at_first_token(tok: PreTrainedTokenizerBase) -> None:
    ids = tok.encode("Hello world")
    det = IncrementalDetokenizer(tok, tok.encode("Say hi:"), stop=["Hello"])
    assert det.add(ids[0]) == ""
    assert det.stopped and det.text == ""
    assert det.add(ids[1]) == ""


def test_stop_made_of_multibyte_characters(tok: PreTrainedTokenizerBase) -> None:
    det = IncrementalDetokenizer(tok, [], stop=["😀"])
    out = "".join(stream(det, tok.encode("Hi 😀 there")))
    assert out == "Hi " and det.stopped


@PROPERTY_SETTINGS
@given(before=texts, after=texts, stop=st.sampled_from(["STOP", "\n\n", "😀!", "日本", " é"]))
def test_stop_never_leaks(tok: PreTrainedTokenizerBase, before: str, after: str, stop: str) -> None:
    text = before + stop + after
    ids = tok.encode(text)
    full = decode(tok, ids)
    det = IncrementalDetokenizer(tok, [], stop=[stop])
    out = "".join(stream(det, ids))
    assert det.stopped
    assert out == full[: full.index(stop)]
    assert stop not in out


def test_cut_short_generation_drops_a_partial_character(default_tokenizer) -> None:
    ids = default_tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # the emoji arrives over several byte-level tokens
    detok = IncrementalDetokenizer(default_tokenizer, [], stop=[])
    deltas = [detok.add(i) for i in ids[:-1]]
    assert deltas == [""] * (len(ids) - 1)  # nothing shown while the character arrives
    assert detok.finish(drop_partial=True) == ""
    whole = IncrementalDetokenizer(default_tokenizer, [], stop=[])
    assert "".join(whole.add(i) for i in ids) + whole.finish(drop_partial=True) == "🎉"
