"""Turn generated token ids into text one token at a time, for streaming.

Two things make this harder than decoding each token on its own:

* A character may span several tokens (byte-fallback ``<0xF0>`` tokens, byte-level BPE
  pieces of an emoji or a CJK character), and some tokenizers decode a token differently
  depending on its neighbours (SentencePiece's ``▁`` leading space). Following vLLM, we
  decode a small window of recent tokens twice, with and without the newest ones, and
  show the difference only once it no longer ends in a partial character (U+FFFD).
* Stop strings may arrive split across tokens, so any tail of the text that could be the
  start of a stop string is held back until it is known not to be one.
* A code completion's line stops (:class:`~infer.engine.params.EditorStops`) decide a
  generated line by its indentation or its whole text: from its newline on, the line is held
  back until it is decided.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

from infer.engine.params import EditorStops

# Prompt tokens that seed the window, so the first generated token decodes with the
# spacing it has in context.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Streams the text of one request's generated tokens.

    The concatenation of everything :meth:`add` and :meth:`finish` return equals
    ``tokenizer.decode(generated_ids, skip_special_tokens=...)`` unless a stop string
    matched, in which case the text ends just before the stop string.

    Args:
        tokenizer: A Hugging Face (fast) tokenizer.
        prompt_ids: The prompt's token ids; only the last few are used, as context.
        stop: Strings that end generation; they are never part of the output.
        skip_special_tokens: Drop special tokens (such as EOS) from the text.
        lines: A code completion's line stops (indentation, the suffix's first line).
        skip: Text the output starts with that is not shown (a healed prompt's cut text).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        lines: EditorStops | None = None,
        skip: str = "",
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._lines = lines if lines is not None and lines.by_line else None
        self._skip = len(skip)  # characters still to drop from the start of the output
        self._first_line = True  # no newline has been generated yet
        # The tokens decoded each step: window[:read] is text already shown (context for
        # the tokens after it), window[read:] is not shown yet.
        self._window = self._seed_window(prompt_ids)
        self._read = len(self._window)
        self._pending = ""  # decoded but held back: it may be the start of a stop string
        self._text: list[str] = []
        self._stopped = False
        self._finished = False
        self.matched: str | None = None  # the stop string that ended the text

    @property
    def stopped(self) -> bool:
        """Whether a stop string matched; nothing more is emitted after that."""
        return self._stopped

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text)

    def add(self, token_id: int) -> str:
        """Append a generated token.

        Args:
            token_id: The new token.

        Returns:
            The new text that is safe to show now; may be empty.
        """
        if self._stopped or self._finished:
            return ""
        self._window.append(token_id)
        return self._release(self._decode_new(final=False), final=False)

    def finish(self, drop_partial: bool = False) -> str:
        """End the stream for a reason other than a stop string; call once.

        Args:
            drop_partial: The generation was cut short (length limit, abort), so a
                trailing character whose bytes never all arrived is dropped instead of
                being rendered as U+FFFD.

        Returns:
            The text still held back: a tail that looked like the start of a stop
            string, and any trailing partial character exactly as the full decode
            renders it. If the released text holds a stop string (it was waiting
            behind a partial character), only the text before it is returned and
            :attr:`stopped` becomes true.
        """
        if self._stopped or self._finished:
            return ""
        self._finished = True
        tail = self._release(self._decode_new(final=True), final=True)
        return tail.rstrip("\ufffd") if drop_partial else tail

    def _seed_window(self, prompt_ids: Sequence[int]) -> list[int]:
        """The last prompt tokens, or none if they end in the middle of a character.

        A prompt that ends mid-character would glue its bytes to the first generated
        tokens, and the output would then differ from decoding the generated ids alone.
        """
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            return []
        return context

    def _decode(self, ids: list[int]) -> str:
        # decode() is typed to also return list[str], but only does so for batches.
        return cast(str, self._tokenizer.decode(ids, skip_special_tokens=self._skip_special))

    def _decode_new(self, final: bool) -> str:
        """Text the unshown tokens add to the window, or "" while a character is incomplete."""
        shown = self._decode(self._window[: self._read])
        full = self._decode(self._window)
        if len(full) <= len(shown):
            return ""  # e.g. a skipped special token: nothing new yet
        if full.endswith(REPLACEMENT_CHAR) and not final:
            return ""  # a character is still arriving; wait for its other bytes
        # The newly shown tokens become the next context; older ones are dropped so that
        # per-token work stays O(window), not O(length).
        del self._window[: self._read]
        self._read = len(self._window)
        return full[len(shown) :]

    def _release(self, new_text: str, final: bool) -> str:
        """Add decoded text to the pending tail; emit what cannot be part of a stop."""
        pending = self._pending + new_text
        cut, matched = self._find_stop(pending)
        line_cut, undecided = (None, None)
        if self._lines is not None:
            line_cut, undecided = line_stop(self._lines, pending, final)
            if self._first_line and self._lines.line_rest:
                first_cut, held = self._first_line_rest(self._lines.line_rest, pending, final)
                line_cut = first_cut if first_cut is not None else line_cut
                if held is not None:
                    undecided = held if undecided is None else min(held, undecided)
        if line_cut is not None and (cut is None or line_cut < cut):
            cut, matched = line_cut, None
        if cut is not None:
            self._stopped, self.matched = True, matched
            self._pending = ""
            return self._emit(pending[:cut])
        keep = 0 if final else self._stop_prefix_len(pending)
        if undecided is not None:
            keep = max(keep, len(pending) - undecided)
        self._pending = pending[len(pending) - keep :]
        return self._emit(pending[: len(pending) - keep])

    def _first_line_rest(
        self, rest: str, pending: str, final: bool
    ) -> tuple[int | None, int | None]:
        """Where the completion's first line ends if it ends with ``rest`` (the rest of the
        cursor's line, already there), and from where its tail is held back while it may
        still become that."""
        end = pending.find("\n")
        if end < 0 and not final:
            for n in range(min(len(rest), len(pending)), 0, -1):
                if pending.endswith(rest[:n]):
                    return None, len(pending) - n
            return None, None
        end = len(pending) if end < 0 else end
        self._first_line = False
        return (end - len(rest), None) if pending[:end].endswith(rest) else (None, None)

    def _find_stop(self, text: str) -> tuple[int | None, str | None]:
        """Index of the earliest stop string in ``text`` and that string, or ``None``s."""
        hits = [(i, s) for s, i in ((s, text.find(s)) for s in self._stop) if i >= 0]
        return min(hits, key=lambda hit: hit[0]) if hits else (None, None)

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that begins some stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def _emit(self, text: str) -> str:
        if self._skip:
            dropped = min(self._skip, len(text))
            text, self._skip = text[dropped:], self._skip - dropped
        if text:
            self._text.append(text)
        return text


def line_stop(stops: EditorStops, text: str, final: bool) -> tuple[int | None, int | None]:
    """Where a code completion's line stops end ``text`` (the text not shown yet), and where
    the first line not yet decided starts.

    Only lines that begin with a newline of ``text`` are judged (a decided line was shown,
    and the first generated line is never cut): one indented by fewer than ``stops.indent``
    columns ends the completion at its first visible character, one equal (stripped) to
    ``stops.suffix_line`` once it is complete. An undecided line is held back from its
    newline, so a cut never takes back text that was shown.

    Returns:
        ``(cut, undecided)``: the index the completion ends at (before the line's newline,
        or after it with ``stops.keep_newline``) or ``None``; the index of the newline of the
        first undecided line or ``None``.
    """
    keep = int(stops.keep_newline)
    start = text.find("\n")
    while start >= 0:
        end = text.find("\n", start + 1)
        line = text[start + 1 : end if end >= 0 else len(text)]
        complete = end >= 0 or final
        body = line.lstrip(" \t")
        if stops.indent and body and len(line) - len(body) < stops.indent:
            return start + keep, None
        target = stops.suffix_line
        if target and complete and line.strip() == target:
            return start + keep, None
        if not complete:
            unindented = stops.indent > 0 and not body
            repeating = bool(target) and target.startswith(body.rstrip())
            return None, start if unindented or repeating else None
        start = end
    return None, None
