"""Grammars for structured output, compiled and matched by xgrammar.

A :class:`GrammarCompiler` turns a JSON schema (or "any JSON object") into a
:class:`Grammar`: compiled once, immutable, shared by every choice of a request. Each request
gets its own :class:`GrammarState` (its matcher) the first time the engine masks its logits.

xgrammar rather than llguidance: it fills a batch's bitmasks faster, and its C++ mask kernel
takes the constrained rows' indices and needs no compiler at run time (llguidance's is a
``torch.compile`` function).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase


class GrammarError(ValueError):
    """A schema that cannot be compiled into a grammar."""


# Where a reply opens what a lazy grammar constrains: given the reply's text so far (or,
# ``resumed``, its text since the last constrained part closed) and an offset an earlier
# call returned without an opening, ``(offset, True)`` if it opened there, else
# ``(offset, False)``: nothing opens before ``offset``.
Opening = Callable[[str, int, bool], tuple[int, bool]]


class Grammar:
    """A compiled grammar; :meth:`new_state` starts a matcher for one request."""

    def __init__(self, compiled: xgr.CompiledGrammar, description: str) -> None:
        self.compiled = compiled
        self.description = description

    def new_state(self) -> GrammarState:
        return GrammarState(xgr.GrammarMatcher(self.compiled))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.description})"


class LazyGrammar(Grammar):
    """A grammar that constrains nothing until the reply's text opens what it describes.

    Until ``opening`` finds the opening in the reply's text, no token is masked, so the
    reply is what the model would write unconstrained. From the opening on, the grammar
    constrains the reply; the text from the opening to the last token is matched first (the
    token that completed the opening may reach past it). Once the grammar is complete, the
    reply is free again and may open another part (``reopen``: the grammar then ends in free
    text, so that a token may reach past the part's end), or must end.

    Args:
        compiled: The grammar of one part, from its opening to its end.
        opening: Finds the opening (:data:`Opening`).
        reopen: After a part, the reply goes on free; else it ends there.
        vocab: Each token's bytes, as the matcher reads them.
        stops: Stop tokens (they add no text).
    """

    def __init__(
        self,
        compiled: xgr.CompiledGrammar,
        opening: Opening,
        reopen: bool,
        vocab: Sequence[bytes],
        stops: frozenset[int],
        description: str,
    ) -> None:
        super().__init__(compiled, description)
        self.opening = opening
        self.reopen = reopen
        self.vocab = vocab
        self.stops = stops

    def new_state(self) -> GrammarState:
        return LazyGrammarState(self)


class GrammarState:
    """One request's matcher and how many of its output tokens it has consumed."""

    def __init__(self, matcher: xgr.GrammarMatcher | None) -> None:
        self.matcher = matcher
        self.consumed = 0

    @property
    def active(self) -> bool:
        """Whether the grammar constrains the next token."""
        return self.matcher is not None and not self.matcher.is_terminated()

    def advance(self, output_ids: Sequence[int]) -> None:
        """Feed the matcher the output tokens it has not seen yet.

        A token the matcher refuses can only come from outside the mask (``ignore_eos``
        past the end); it is skipped, and the mask stays that of the accepted prefix.
        """
        assert self.matcher is not None
        for token in output_ids[self.consumed :]:
            if not self.matcher.is_terminated():
                self.matcher.accept_token(token)
        self.consumed = len(output_ids)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into ``bitmask[row]`` (only while :attr:`active`:
        once the matcher has accepted a stop token nothing more is constrained)."""
        assert self.matcher is not None
        self.matcher.fill_next_token_bitmask(bitmask, row)


class LazyGrammarState(GrammarState):
    """A :class:`LazyGrammar`'s state: the reply's bytes while it is free, its matcher while
    a part it opened is constrained.

    An opening whose text the grammar refuses (the tokens around it went where the grammar
    cannot follow) leaves the rest of the reply unconstrained: nothing can be taken back.
    """

    def __init__(self, grammar: LazyGrammar) -> None:
        super().__init__(None)
        self.grammar = grammar
        self.refused = False
        self._bytes = bytearray()  # the free text since the reply's start or the last part
        self._since = 0  # no opening before this offset of that text
        self._resumed = False  # a part has closed before it

    def advance(self, output_ids: Sequence[int]) -> None:
        if len(output_ids) == self.consumed:
            return
        for token in output_ids[self.consumed :]:
            matcher = self.matcher
            if matcher is None:
                if token not in self.grammar.stops:
                    self._bytes += self.grammar.vocab[token]
                continue
            if matcher.is_terminated():
                continue
            matcher.accept_token(token)
            if self.grammar.reopen and matcher.is_completed() and not matcher.is_terminated():
                # The part is closed: the reply is free again from the end of its text, which
                # may fall inside this token (``}\n`` after a call).
                matcher.rollback(1)
                rest = _after_completion(matcher, self.grammar.vocab[token])
                self.matcher, self._since, self._resumed = None, 0, True
                self._bytes = bytearray(rest)
        self.consumed = len(output_ids)
        if self.matcher is None and not self.refused:
            self._look()

    def _look(self) -> None:
        """Look for an opening in the free text; start the matcher there."""
        text = self._bytes.decode("utf-8", "surrogateescape")  # partial characters kept
        offset, opened = self.grammar.opening(text, self._since, self._resumed)
        if not opened:
            self._since = offset
            return
        start = len(text[:offset].encode("utf-8", "surrogateescape"))
        matcher = xgr.GrammarMatcher(self.grammar.compiled)
        if matcher.accept_string(bytes(self._bytes[start:])):
            self.matcher = matcher
        else:
            self.refused = True
        self._bytes = bytearray()


def _after_completion(matcher: xgr.GrammarMatcher, token: bytes) -> bytes:
    """The bytes of ``token`` after the point where ``matcher`` (its state before the token)
    completes its grammar."""
    for end in range(1, len(token) + 1):
        probe = matcher.fork()
        if probe.accept_string(token[:end]) and probe.is_completed():
            return token[end:]
    return b""


class GrammarCompiler:
    """Compiles schemas for one tokenizer (thread-safe; results are cached by xgrammar).

    Args:
        tokenizer: The model's tokenizer.
        vocab_size: Width of the model's logits (may exceed the tokenizer's vocabulary).
        stop_token_ids: Tokens that end a request (EOS); allowed once the JSON is complete.
    """

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: Sequence[int]
    ) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        self._lock = threading.Lock()
        self._vocab: list[bytes] = list(info.decoded_vocab)
        self._stops = frozenset(info.stop_token_ids)

    def json_schema(self, schema: dict[str, Any]) -> Grammar:
        """A grammar for JSON documents that validate against ``schema``.

        Raises:
            GrammarError: The schema is invalid or uses what xgrammar does not support.
        """
        try:
            text = json.dumps(schema)
            with self._lock:
                compiled = self._compiler.compile_json_schema(
                    text, any_whitespace=False, strict_mode=True
                )
        except Exception as e:  # noqa: BLE001 - xgrammar raises several types
            message = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            raise GrammarError(f"cannot compile the JSON schema: {message}") from None
        return Grammar(compiled, "json_schema")

    def structural_tag(self, tag: dict[str, Any], description: str) -> Grammar:
        """A grammar for an xgrammar structural tag (its JSON form): text and tagged JSON
        in a given order, e.g. a reasoning block then tool calls that fit their schemas.

        Raises:
            GrammarError: A schema in it is invalid or unsupported.
        """
        return Grammar(self._compile_tag(tag), description)

    def lazy(
        self, tag: dict[str, Any], opening: Opening, reopen: bool, description: str
    ) -> LazyGrammar:
        """A :class:`LazyGrammar`: nothing constrained until ``opening`` finds where the
        reply opens a part that the structural tag ``tag`` describes; then free again after
        it (``reopen``), or the end.

        Raises:
            GrammarError: A schema in it is invalid or unsupported.
        """
        compiled = self._compile_tag(tag)
        return LazyGrammar(compiled, opening, reopen, self._vocab, self._stops, description)

    def _compile_tag(self, tag: dict[str, Any]) -> xgr.CompiledGrammar:
        try:
            with self._lock:
                return self._compiler.compile_structural_tag(json.dumps(tag))
        except Exception as e:  # noqa: BLE001 - xgrammar raises several types
            message = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
            raise GrammarError(f"cannot compile the grammar: {message}") from None


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """A ``[rows, ceil(V / 32)]`` int32 bitmask (one bit per token), all allowed."""
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set the tokens that ``bitmask`` disallows to ``-inf`` in ``logits[rows]``, in place.

    Args:
        logits: ``[N, V]`` float32 logits.
        bitmask: ``[N, ceil(V / 32)]``; the rows in ``rows`` filled by :meth:`GrammarState.fill`.
        rows: The constrained rows (the others are not read or touched).
    """
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
