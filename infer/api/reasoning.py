"""Reasoning kept apart from the answer: the ``<think>...</think>`` block a thinking template
(Qwen3, DeepSeek-R1 distills) opens a reply with.

Where the reply starts depends on the rendered prompt (:func:`thinking`): a prompt that ends
in ``<think>`` has opened the block already (the reply starts inside it), one that ends in a
closed, empty block has switched thinking off (no reasoning to split), and otherwise the
model may open a block itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

OPEN, CLOSE = "<think>", "</think>"
Thinking = Literal["open", "auto"]  # the reply starts inside a block, or may open one


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def answer_offset(text: str, mode: Thinking | None) -> int | None:
    """Where the answer begins in a reply's text (after its reasoning block, as
    :class:`ReasoningParser` splits it); ``None`` while the text has not reached it."""
    if mode is None:
        return 0
    block = 0
    if mode == "auto":
        s = text.lstrip()
        if not s.startswith(OPEN):
            return None if OPEN.startswith(s) else 0
        block = len(text) - len(s) + len(OPEN)
    at = text.find(CLOSE, block)
    return None if at < 0 else at + len(CLOSE)


def reasoning_seen(text: str, mode: Thinking | None) -> int:
    """How much of a reply that has not reached its answer is surely reasoning: the block so
    far but for what may begin its closing tag; nothing while it is unknown whether the
    reply opens a block at all."""
    if mode is None or (mode == "auto" and not text.lstrip().startswith(OPEN)):
        return 0
    return len(text) - partial_suffix(text, CLOSE)


def thinking(chat_template: str | None, prompt_tail: str) -> Thinking | None:
    """How a reply to a prompt ending in ``prompt_tail`` may reason; ``None``: not at all."""
    if not chat_template or CLOSE not in chat_template:
        return None
    tail = prompt_tail.rstrip()
    if tail.endswith(CLOSE):
        return None
    return "open" if tail.endswith(OPEN) else "auto"


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    """Splits streamed text into the reasoning block and the answer after it."""

    def __init__(self, mode: Thinking) -> None:
        self._state: Literal["start", "thinking", "after", "answer"] = (
            "thinking" if mode == "open" else "start"
        )
        self._buf = ""

    def feed(self, text: str) -> Split:
        self._buf += text
        out = Split()
        while True:
            if self._state == "start":
                s = self._buf.lstrip()
                if s.startswith(OPEN):
                    self._state, self._buf = "thinking", s[len(OPEN) :]
                    continue
                if OPEN.startswith(s):  # nothing yet, or a partial "<think>"
                    return out
                self._state = "answer"
            if self._state == "thinking":
                at = self._buf.find(CLOSE)
                if at < 0:
                    keep = partial_suffix(self._buf, CLOSE)
                    out.reasoning += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                out.reasoning += self._buf[:at]
                self._state, self._buf = "after", self._buf[at + len(CLOSE) :]
            if self._state == "after":  # the answer starts after the block's blank lines
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                self._state = "answer"
            out.content += self._buf
            self._buf = ""
            return out

    def finish(self) -> Split:
        """What was held back: a block never closed is all reasoning."""
        out = Split()
        if self._state == "thinking":
            out.reasoning = self._buf
        elif self._state in ("start", "answer"):
            out.content = self._buf
        self._buf = ""
        return out


def with_reasoning(answer: dict[str, Any], mode: Thinking | None) -> dict[str, Any]:
    """A structural tag (xgrammar's JSON form): the reasoning block, free, then ``answer``'s
    format, so structured output and tool calls constrain the answer, not the thinking.
    Where the reply may think (``auto``), whether it opens a block is the model's choice."""
    if mode is None:
        return {"type": "structural_tag", "format": answer}
    block = {
        "type": "tag",
        "begin": "" if mode == "open" else OPEN,
        "content": {"type": "any_text"},
        "end": CLOSE,
    }
    # the blank lines after the block: as many as the model writes (a few at most)
    gap = {"type": "regex", "pattern": "[ \\t\\n]{0,16}"}
    think: dict[str, Any] = {"type": "sequence", "elements": [block, gap]}
    if mode == "auto":
        think = {"type": "optional", "content": think}
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": [think, answer]}}
