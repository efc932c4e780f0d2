"""Turn generated token ids into text one token at a time, for streaming.

Two things make this harder than decoding each token on its own:

* A character may span several tokens (byte-fallback ``<0xF0>`` tokens, byte-level BPE
  pieces of an emoji or a CJK character), and some tokenizers decode a token differently
  depending on its neighbours (SentencePiece's ``▁`` leading space). Following vLLM, we
  decode a small window of recent tokens twice, with and without the newest ones, and
  show the difference only once it no longer ends in a partial character (U+FFFD).
* Stop strings may arrive split across tokens, so any tail of the text that could be the
  start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from transformers import PreTrainedTokenizerBase

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
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        # The tokens decoded each step: window[:read] is text already shown (context for
        # the tokens after it), window[read:] is not shown yet.
        self._window = self._seed_window(prompt_ids)
        self._read = len(self._window)
        self._pending = ""  # decoded but held back: it may be the start of a stop string
        self._text: list[str] = []
        self._stopped = False
        self._finished = False

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
        cut = self._find_stop(pending)
        if cut is not None:
            self._stopped = True
            self._pending = ""
            return self._emit(pending[:cut])
        keep = 0 if final else self._stop_prefix_len(pending)
        self._pending = pending[len(pending) - keep :]
        return self._emit(pending[: len(pending) - keep])

    def _find_stop(self, text: str) -> int | None:
        """Index of the earliest stop string in ``text``, or ``None``."""
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

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
        if text:
            self._text.append(text)
        return text
