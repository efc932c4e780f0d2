"""The one fill-in-the-middle prompt builder: OpenAI's ``suffix``, llama.cpp's ``/infill``
and Ollama's ``suffix`` all come here.

A prompt is built from token ids, piece by piece: the text of each piece (the code before
the cursor, after it, each extra file) is tokenized on its own, as plain text (special-token
spellings inside code stay text), and the model's FIM tokens go between. So a piece's tokens
do not depend on its neighbours, and consecutive keystrokes share every piece the typing did
not touch, token for token: that is what the prefix cache reuses.

Layouts (:class:`Layout`):

- ``psm``: ``<PRE> prefix <SUF> suffix <MID>``, the order Qwen2.5-Coder documents. Typing
  changes the end of the prefix, so the suffix after it is read again at every keystroke.
- ``spm``: ``<SUF> suffix <PRE> prefix <MID>`` (llama.cpp's ``--spm-infill``): only the end
  of the prefix changes, but a model not trained on this order fills worse.
- ``anchored``: ``<PRE> prefix up to an anchor <SUF> suffix <MID> the rest of the prefix``.
  The prefix's last lines are given as the start of the middle (a fill the model began
  itself: its training split files at random points, so a middle that starts a few lines
  before the cursor is one it has seen). The anchor is the start of the last *landmark*
  line before the cursor's line; while a person types, every keystroke only extends the
  prompt's end, and the suffix is read again when a new landmark line is typed.

Landmark lines are chosen by their content (about one line in :data:`LANDMARK_EVERY`: a
hash of the line and the one before it), never by their number, so they stay landmarks
when an editor's window of lines slides (llama.vim sends the 256 lines before the cursor).
A prefix longer than its limit is cut at a landmark line too (one of the sparser ones, about
one line in :data:`CUT_EVERY`), the first whose rest fits: the kept part starts at the same
line while the person types on, until they have typed about that many lines more.

With extra files (llama.cpp's ``input_extra``) and a model with repo-level tokens, the prompt
starts as Qwen2.5-Coder's repo-level format, as llama.cpp writes it:
``<|repo_name|>myproject\\n`` then ``<|file_sep|>{filename}\\n{text}`` per file, then
``<|file_sep|>filename\\n`` before the file being completed.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum

from infer.engine.params import EditorStops
from infer.models.fim import FimTokens

Encode = Callable[[str], list[int]]  # text -> ids, as plain text, no special tokens added
Decode = Callable[[list[int]], str]
HEAL_TOKENS = 8  # token healing backs off at most this many tokens

REPO_NAME = "myproject"  # llama.cpp's: the editor does not say
CURRENT_FILE = "filename"
DEFAULT_FILE = "tmp"  # an extra chunk without a filename (llama.cpp's)
CHUNK_SEPARATOR = "\n\n--- snippet ---\n\n"  # between extra chunks, without repo-level tokens
LANDMARK_EVERY = 8
CUT_EVERY = 4 * LANDMARK_EVERY  # (its landmarks are landmarks of the finer kind too)


class Layout(StrEnum):
    PSM = "psm"
    SPM = "spm"
    ANCHORED = "anchored"


@dataclass(frozen=True)
class Chunk:
    """Another file's text, shown to the model before the file being completed."""

    text: str
    filename: str = DEFAULT_FILE


@dataclass(frozen=True)
class FimRequest:
    """What an editor sends: the code around the cursor, and other files.

    Attributes:
        prefix: The code before the cursor (``input_prefix``).
        suffix: The code after it (``input_suffix``).
        middle: Text the fill starts with, after the prefix (llama.cpp's ``prompt``: the
            cursor's line up to the cursor, in llama.vim's requests).
        extra: Other files, least relevant first (``input_extra``).
    """

    prefix: str
    suffix: str
    middle: str = ""
    extra: Sequence[Chunk] = ()


@dataclass(frozen=True)
class Limits:
    """Most tokens of each piece; ``None``: the piece is never cut (a prompt that does not
    fit is refused by the length check instead)."""

    prefix: int | None = None
    suffix: int | None = None
    extra: int | None = None


@dataclass(frozen=True)
class Fill:
    """A prompt to be built by the FIM builder: the code around the cursor, how much of
    each piece to keep, and the layout the server chose."""

    request: FimRequest
    limits: Limits = Limits()
    layout: Layout = Layout.PSM

    def text_bytes(self) -> int:
        """The size of its text (the prompt size limit counts it)."""
        r = self.request
        pieces = [r.prefix, r.middle, r.suffix, *(c.text + c.filename for c in r.extra)]
        return sum(len(p.encode("utf-8", "surrogatepass")) for p in pieces)


@dataclass(frozen=True)
class FimPrompt:
    """A built prompt: its ids, and how much of each piece it holds."""

    ids: list[int]
    prefix_tokens: int
    suffix_tokens: int
    extra_tokens: int
    truncated: bool  # some piece was cut to its limit
    healing: str = ""  # the cursor's word, cut from the prompt: the completion spells it first


def build(
    encode: Encode,
    tokens: FimTokens,
    request: FimRequest,
    layout: Layout = Layout.SPM,
    limits: Limits = Limits(),
    decode: Decode | None = None,
) -> FimPrompt:
    """The token ids of a fill-in-the-middle prompt.

    Args:
        encode: The model's tokenizer, as plain text.
        tokens: The model's FIM tokens.
        request: The code around the cursor and the extra files.
        layout: The order of prefix and suffix.
        limits: Most tokens kept of each piece: the prefix keeps its end, the suffix its
            start, the extra files the most recent whole files.
        decode: The tokenizer's decoding; given, an anchored prompt that ends inside a
            line is healed (:func:`heal`): the prompt is cut back to where a token
            starts, and the completion must spell the cut text first.
    """
    text = request.prefix + request.middle
    marks = landmarks(text)
    text, cut = _fit(encode, text, landmarks(text, CUT_EVERY), limits.prefix)
    given = ""  # the start of the middle (the anchored layout)
    if layout == Layout.ANCHORED:
        at = max((m - cut for m in marks if m > cut), default=0)
        text, given = text[:at], text[at:]
    prefix, suffix = encode(text) if text else [], encode(request.suffix)
    kept_suffix = len(suffix) if limits.suffix is None else min(len(suffix), limits.suffix)
    truncated = cut > 0 or kept_suffix < len(suffix)
    suffix = suffix[:kept_suffix]
    extra, cut_extra = _extra(encode, tokens, request.extra, limits.extra)
    pre, suf = [tokens.prefix, *prefix], [tokens.suffix, *suffix]
    body = suf + pre if layout == Layout.SPM else pre + suf
    middle = encode(given) if given else []
    healing = ""
    if decode is not None and given and not given.endswith("\n"):
        middle, healing = heal(middle, given, decode)
    return FimPrompt(
        [*extra, *body, tokens.middle, *middle],
        len(prefix) + len(middle),
        len(suffix),
        len(extra),
        truncated or cut_extra,
        healing,
    )


def heal(ids: list[int], text: str, decode: Decode) -> tuple[list[int], str]:
    """``ids`` (the tokens of ``text``) cut back to where the cursor's word starts: the
    last tokens up to one that starts with a space (a run of spaces whole), within the
    cursor's line; and the text they spelled (empty when nothing can be cut).

    The prompt then ends at a boundary its training text had; the completion spells the
    cut text again, as the model splits it (:mod:`infer.engine.healing`)."""
    cut = len(ids)
    while cut > 0 and len(ids) - cut < HEAL_TOKENS:
        piece = decode(ids[cut - 1 : cut])
        if "\n" in piece:
            break
        cut -= 1
        if piece[:1].isspace() and not (piece.isspace() and _blank(decode(ids[cut - 1 : cut]))):
            break  # the word starts here (a run of spaces before it is cut back whole)
    kept = decode(ids[:cut])
    if cut == len(ids) or not text.startswith(kept):
        return ids, ""
    return ids[:cut], text[len(kept) :]


def landmarks(text: str, every: int = LANDMARK_EVERY) -> list[int]:
    """The offsets in ``text`` where its landmark lines start: complete lines (the line the
    text ends in is not one) chosen by a hash of themselves and the line before."""
    marks, start, previous = [], 0, ""
    while (end := text.find("\n", start)) >= 0:
        line = text[start:end]
        if start > 0 and zlib.crc32(f"{previous}\n{line}".encode()) % every == 0:
            marks.append(start)
        previous, start = line, end + 1
    return marks


def _blank(piece: str) -> bool:
    """Whether a token is spaces (not a newline): part of a run the healing cuts whole."""
    return bool(piece) and piece.isspace() and "\n" not in piece


def _fit(encode: Encode, text: str, marks: list[int], limit: int | None) -> tuple[str, int]:
    """``text`` cut to at most ``limit`` tokens at its first landmark line whose rest fits
    (failing that, its first line, or character, whose rest fits), and the offset it was
    cut at."""
    if limit is None or len(encode(text)) <= limit:
        return text, 0
    lines = [i + 1 for i, c in enumerate(text) if c == "\n"]
    for starts in (marks, lines, range(len(text))):
        cut = _first_fitting(encode, text, starts, limit)
        if cut is not None:
            return text[cut:], cut
    return "", len(text)


def _first_fitting(encode: Encode, text: str, starts: Sequence[int], limit: int) -> int | None:
    """The first of ``starts`` (ascending) from which ``text`` has at most ``limit`` tokens
    (a later start never has more: a binary search)."""
    low, high = 0, len(starts)
    while low < high:
        mid = (low + high) // 2
        if len(encode(text[starts[mid] :])) <= limit:
            high = mid
        else:
            low = mid + 1
    return starts[low] if low < len(starts) else None


def _extra(
    encode: Encode, tokens: FimTokens, chunks: Sequence[Chunk], limit: int | None
) -> tuple[list[int], bool]:
    """The ids of the extra files (whole files, the most recent that fit) and whether any
    was left out."""
    if not chunks:
        return [], False
    if tokens.repo_level:
        assert tokens.repo is not None and tokens.sep is not None  # repo_level says so
        head = [tokens.repo, *encode(REPO_NAME + "\n")]
        tail = [tokens.sep, *encode(CURRENT_FILE + "\n")]
        parts = [[tokens.sep, *encode(c.filename + "\n"), *encode(c.text)] for c in chunks]
    else:
        head, tail = [], []
        parts = [encode(CHUNK_SEPARATOR) + encode(c.text) for c in chunks]
    room = None if limit is None else limit - len(head) - len(tail)
    kept: list[list[int]] = []
    for part in reversed(parts):
        if room is not None and len(part) > room:
            break
        kept.insert(0, part)
        room = None if room is None else room - len(part)
    if not kept:
        return [], True
    return [*head, *(t for part in kept for t in part), *tail], len(kept) < len(parts)


def editor_stops(
    suffix: str,
    indent: int = 0,
    time_budget_s: float | None = None,
    at_suffix: bool = True,
    line_head: str = "",
) -> EditorStops:
    """A completion's line and time stops for the code after the cursor ``suffix``.

    Args:
        suffix: The code after the cursor.
        indent: Later lines indented less than this end the completion (0: off).
        time_budget_s: Past this long, the completion ends at the next line's end.
        at_suffix: The fill ends where it reaches code that is already there: a first line
            that ends with the rest of the cursor's line is cut before it, and a later line
            equal to the first non-blank line after the cursor ends the completion before it.
        line_head: The cursor's line up to the cursor.
    """
    lines = suffix.split("\n")
    rest, later = lines[0], lines[1:]
    if not at_suffix:
        return EditorStops(indent, time_budget_s)
    if rest.strip() and not line_head:
        # the cursor at a line's start: that line is the next one; a fill keeps its last
        # newline before it
        return EditorStops(indent, time_budget_s, rest.strip(), True, rest.rstrip())
    following = next((line.strip() for line in later if line.strip()), "")
    return EditorStops(indent, time_budget_s, following, False, rest.rstrip())
