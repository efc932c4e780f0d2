"""A chat reply read as it streams: reasoning, then the answer's content and tool calls.

The reasoning block is split off first (:mod:`infer.api.reasoning`), so a call the model
sketches while thinking is not taken for one; the answer then goes through the tool-call
parser (:mod:`infer.api.tools`) when the request offers tools.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from infer.api.reasoning import ReasoningParser, Thinking
from infer.api.tools import Call, Delta, ToolCallParser, ToolPlan


@dataclass
class ReplyDelta:
    """What a piece of a reply adds."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[Call, str]] = field(default_factory=list)  # (call, new arguments)
    opened: list[int] = field(default_factory=list)  # calls that began in this piece

    def extend(self, other: ReplyDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        self.opened += other.opened

    def as_openai(self) -> dict[str, Any]:
        """The ``delta`` of a chat chunk. Reasoning goes in both ``reasoning_content`` and
        ``reasoning`` (clients read one or the other); a call's first entry carries its id,
        type and name, later ones more of its ``arguments``."""
        delta: dict[str, Any] = {}
        if self.reasoning:
            delta["reasoning_content"] = delta["reasoning"] = self.reasoning
        if self.content:
            delta["content"] = self.content
        entries: dict[int, dict[str, Any]] = {}
        for call, piece in self.calls:
            entry = entries.setdefault(call.index, {"index": call.index})
            if call.index in self.opened and "id" not in entry:
                entry.update(id=call.id, type="function", function={"name": call.name})
            entry.setdefault("function", {}).setdefault("arguments", "")
            entry["function"]["arguments"] += piece
        if entries:
            delta["tool_calls"] = [entries[i] for i in sorted(entries)]
        return delta


class ReplyParser:
    """One choice's reply: give it each text delta, then :meth:`finish` at its end.

    Args:
        plan: The request's tools, if it offers any.
        thinking: How the reply may reason (:func:`~infer.api.reasoning.thinking`).
        separate: Split the reasoning block off; ``False`` leaves it in the content (where
            no call opens all the same).
    """

    def __init__(
        self, plan: ToolPlan | None, thinking: Thinking | None, separate: bool = True
    ) -> None:
        self.plan = plan
        self._reasoning = ReasoningParser(thinking) if thinking and separate else None
        self._tools = ToolCallParser(plan, None if separate else thinking) if plan else None
        self.reasoning = ""
        self.content = ""

    def feed(self, text: str) -> ReplyDelta:
        if self._reasoning is None:
            return self._answer(text, "")
        split = self._reasoning.feed(text)
        return self._answer(split.content, split.reasoning)

    def finish(self) -> ReplyDelta:
        out = ReplyDelta()
        if self._reasoning is not None:
            split = self._reasoning.finish()
            out.extend(self._answer(split.content, split.reasoning))
        if self._tools is not None:
            out.extend(self._record(ReplyDelta(), self._tools.finish()))
        return out

    @property
    def calls(self) -> list[Call]:
        """The calls read to their end (a call cut off part-way is not one)."""
        return self._tools.complete_calls() if self._tools else []

    def _answer(self, content: str, reasoning: str) -> ReplyDelta:
        out = ReplyDelta(reasoning=reasoning)
        self.reasoning += reasoning
        if self._tools is None:
            out.content = content
            self.content += content
            return out
        return self._record(out, self._tools.feed(content))

    def _record(self, out: ReplyDelta, delta: Delta) -> ReplyDelta:
        out.content += delta.content
        self.content += delta.content
        out.calls += delta.calls
        out.opened += delta.opened
        return out
