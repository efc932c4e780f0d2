"""Tool calls: how a model's template writes them, and reading them back out of its text.

Three formats, chosen by the chat template (:func:`tool_format`):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, as the Qwen2,
  Qwen2.5, Qwen3 and Hermes templates ask for;
- ``llama``: a bare ``{"name": ..., "parameters": {...}}`` object, Llama 3.1/3.2's format;
- ``generic``: for templates that know nothing of tools: the ``hermes`` tags, described to the
  model in a system message (:func:`generic_system_prompt`).

Decoding is constrained once the model opens a call (a lazy grammar over these same strings,
``GrammarCompiler.tool_calls``), so a call's arguments are JSON that fits its schema.
:class:`ToolCallParser` reads the text as it streams: content, then each call's name and its
``arguments`` as growing prefixes of one JSON text. A model that plainly meant a call but
wrote it as a fenced JSON block or a bare object (small models often do) is read as a call
too, when the object names an offered tool and its arguments fit that tool's schema
(:func:`near_miss`).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import jsonschema

Format = Literal["hermes", "llama", "generic"]
Mode = Literal["auto", "required", "forced"]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class Tool:
    """One function the client offers."""

    name: str
    description: str | None
    parameters: Mapping[str, Any]

    def as_openai(self) -> dict[str, Any]:
        """``{"type": "function", "function": {...}}``, as templates and xgrammar take it."""
        function: dict[str, Any] = {"name": self.name, "parameters": dict(self.parameters)}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}

    def accepts(self, arguments: Any) -> bool:
        """Whether ``arguments`` validate against this tool's parameter schema."""
        try:
            jsonschema.validate(arguments, dict(self.parameters))
        except jsonschema.ValidationError:
            return False
        return True


@dataclass(frozen=True)
class ToolPlan:
    """How one request calls tools: the offered tools, the choice and the template's format.

    ``mode`` is ``auto`` (text or calls), ``required`` (at least one call, from the first
    token) or ``forced`` (a call of ``tools[0]``, the named tool).
    """

    tools: tuple[Tool, ...]
    mode: Mode
    parallel: bool
    format: Format

    def find(self, name: str) -> Tool | None:
        return next((t for t in self.tools if t.name == name), None)


def tool_format(chat_template: str | None) -> Format:
    """The call format a chat template asks for (``generic`` when it takes no tools)."""
    template = chat_template or ""
    if "tools" not in template:
        return "generic"
    if HERMES_OPEN in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters"' in template or "ipython" in template:
        return "llama"
    return "generic"


def generic_system_prompt(tools: Sequence[Tool]) -> str:
    """The system message that teaches a template without tools the ``hermes`` format."""
    listed = "\n".join(json.dumps(t.as_openai()) for t in tools)
    return (
        "You may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        f"{listed}\n</tools>\n\nFor each function call, return a json object with function "
        "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def call_text(fmt: Format, name: str, arguments: str) -> str:
    """How the model writes a call in ``fmt`` (for a history a template cannot render)."""
    if fmt == "llama":
        return f'{{"name": "{name}", "parameters": {arguments}}}'
    return f'{HERMES_OPEN}\n{{"name": "{name}", "arguments": {arguments}}}\n{HERMES_CLOSE}'


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# --- reading calls out of streamed text -----------------------------------------------------


@dataclass
class Call:
    """A call as far as it has been read."""

    index: int
    id: str
    name: str
    arguments: str = ""
    complete: bool = False


@dataclass
class Delta:
    """What one piece of text adds: content, and calls started or grown."""

    content: str = ""
    calls: list[tuple[Call, str]] = field(default_factory=list)  # (call, its new arguments)
    opened: list[int] = field(default_factory=list)  # indices of the calls this piece began


_NAME = r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'
_HEAD = {  # a call's opening up to its arguments (which must have begun)
    "hermes": re.compile(_NAME + r'"arguments"\s*:\s*(?=\S)'),
    "llama": re.compile(_NAME + r'"parameters"\s*:\s*(?=\S)'),
}
_TAIL = {"hermes": re.compile(r"\s*\}\s*</tool_call>"), "llama": re.compile(r"\s*\}")}


class ToolCallParser:
    """Splits a choice's streamed text into content and tool calls.

    :meth:`feed` takes each new piece of text and returns what can be shown for sure. Text
    that may still turn out to be part of a call is held until :meth:`finish`: a partial
    ``<tool_call>``, whitespace, or (under ``auto``) a reply that so far looks like a bare or
    fenced JSON call.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.fmt: Literal["hermes", "llama"] = "llama" if plan.format == "llama" else "hermes"
        self.calls: list[Call] = []
        self._buf = ""  # text not yet given out
        self._call: Call | None = None  # the call being read
        self._scan = _JSONScanner()
        self._after_args = False  # its arguments ended: reading the call's closing text
        self._content_seen = False  # some content (not only whitespace) has been given out

    def feed(self, text: str) -> Delta:
        self._buf += text
        delta = Delta()
        while self._step(delta):
            pass
        return delta

    def finish(self) -> Delta:
        """The end of the text: give out what was held. A call cut off part-way stays
        incomplete (:meth:`complete_calls` leaves it out)."""
        delta = Delta()
        if self._call is None and self._buf:
            found = None
            if not self._content_seen and not self.calls and self.plan.mode == "auto":
                found = near_miss(self._buf, self.plan)
            for name, args in found or []:
                call = self._open(name)
                call.arguments, call.complete = args, True
                delta.calls.append((call, args))
                delta.opened.append(call.index)
            if found is None and (self._buf.strip() or not self.calls):
                delta.content += self._buf
            self._buf = ""
        return delta

    def complete_calls(self) -> list[Call]:
        return [c for c in self.calls if c.complete]

    def _open(self, name: str) -> Call:
        call = Call(len(self.calls), new_call_id(), name)
        self.calls.append(call)
        return call

    def _step(self, delta: Delta) -> bool:
        """Consume what the buffer allows; ``True`` if there may be more to consume."""
        if self._call is None:
            return self._text(delta)
        if not self._after_args:
            return self._arguments(delta)
        tail = _TAIL[self.fmt].match(self._buf)
        if tail is None:
            return False
        self._buf = self._buf[tail.end() :]
        self._call.complete = True
        self._call, self._after_args = None, False
        return True

    def _text(self, delta: Delta) -> bool:
        if self.fmt == "hermes":
            at = self._buf.find(HERMES_OPEN)
            if at < 0:
                keep = partial_suffix(self._buf, HERMES_OPEN)
                self._give(delta, len(self._buf) - keep, hold=True)
                return False
            self._give(delta, at, hold=False)
            self._buf = self._buf[self._buf.find(HERMES_OPEN) :]  # whitespace before it: dropped
            rest = self._buf[len(HERMES_OPEN) :]
        else:
            stripped = self._buf.lstrip()
            if self._content_seen or (stripped and not stripped.startswith("{")):
                self._give(delta, len(self._buf), hold=False)
                return False
            rest = self._buf
        head = _HEAD[self.fmt].match(rest)
        if head is None:
            if len(rest) > 512:  # no call head after all this text: not a call
                self._give(delta, len(self._buf), hold=False)
            return False
        self._call = self._open(json.loads(f'"{head.group(1)}"'))
        self._scan = _JSONScanner()
        delta.calls.append((self._call, ""))
        delta.opened.append(self._call.index)
        self._buf = rest[head.end() :]
        return True

    def _give(self, delta: Delta, n: int, hold: bool) -> None:
        """Give out the buffer's first ``n`` characters as content, but for trailing
        whitespace (dropped if a call follows), or all of them (``hold``) while they may be
        the start of a reply that is a near-miss call."""
        text = self._buf[:n].rstrip()
        if not text:
            return
        if hold and not self._content_seen and not self.calls and self.plan.mode == "auto":
            if _may_be_json_call(text):
                return
        delta.content += text
        self._content_seen = True
        self._buf = self._buf[len(text) :]

    def _arguments(self, delta: Delta) -> bool:
        assert self._call is not None
        end = self._scan.feed(self._buf)
        piece = self._buf if end is None else self._buf[:end]
        if piece:
            self._call.arguments += piece
            delta.calls.append((self._call, piece))
        self._buf = "" if end is None else self._buf[end:]
        if end is None:
            return False
        self._after_args = True
        return True


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _may_be_json_call(text: str) -> bool:
    """Whether a reply that starts so may turn out to be a JSON call (bare or fenced)."""
    s = text.lstrip()
    if not s:
        return True
    return s.startswith(("{", "[")) or "```".startswith(s[:3]) or s.startswith("```")


class _JSONScanner:
    """Finds where one JSON value ends in text that arrives in pieces."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.started = False
        self.scalar = False

    def feed(self, text: str) -> int | None:
        """The offset just past the value's end within ``text``, or ``None`` if it goes on."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return i + 1
                continue
            if not self.started:
                if ch.isspace():
                    continue
                self.started = True
                if ch not in "{[":
                    if ch == '"':
                        self.in_string = True
                    else:
                        self.scalar = True
                    continue
            if self.scalar:
                if ch in ",}] \n\t\r":
                    return i
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


# --- near misses ----------------------------------------------------------------------------

_FENCE = re.compile(r"^```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?```$", re.DOTALL)


def near_miss(text: str, plan: ToolPlan) -> list[tuple[str, str]] | None:
    """The calls in a reply that is only a JSON call (or a list of them), bare, fenced or in
    ``<tool_call>`` tags, naming offered tools with arguments that fit their schemas:
    ``[(name, arguments JSON)]``; ``None`` if it is anything else."""
    s = text.strip()
    fenced = _FENCE.match(s)
    if fenced:
        s = fenced.group(1).strip()
    try:
        value = json.loads(s)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        tool = plan.find(item["name"])
        keys = set(item) - {"name"}
        if tool is None or keys not in ({"arguments"}, {"parameters"}):
            return None
        arguments = item[keys.pop()]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict) or not tool.accepts(arguments):
            return None
        calls.append((tool.name, json.dumps(arguments, ensure_ascii=False)))
    return calls or None


# --- the grammar that keeps calls valid -----------------------------------------------------


def _call_tag(fmt: Format, tool: Tool) -> dict[str, Any]:
    """One tool's call as xgrammar's structural ``tag``: fixed text around its arguments,
    which must validate against the tool's parameters."""
    if fmt == "llama":
        begin, end = f'{{"name": "{tool.name}", "parameters": ', "}"
    else:
        begin, end = f'{HERMES_OPEN}\n{{"name": "{tool.name}", "arguments": ', f"}}\n{HERMES_CLOSE}"
    content = {"type": "json_schema", "json_schema": dict(tool.parameters)}
    return {"type": "tag", "begin": begin, "content": content, "end": end}


# How a text answer may open when tools are offered (see answer_format).
_TEXT_START = "[A-Za-z0-9\u00c0-\uffff]"


def answer_format(plan: ToolPlan) -> dict[str, Any]:
    """The structural format (xgrammar's JSON form) of an answer under ``plan``.

    ``required``: calls from the first token, nothing else. ``forced``: one call of the named
    tool. ``auto``: either calls from the first token, or prose: text that opens with a
    letter or a digit, not like a call written some other way (``{``, ``[``, ``(``, ``>``,
    a code fence...), and in which the model may still open a call later: a lazy grammar,
    since free text costs nothing to check. Small models often answer an offered tool with a bare or
    fenced JSON object instead of their template's tags; under this grammar such a reply
    becomes the tagged call, with arguments that fit the tool's schema, or plain text.
    ``parallel_tool_calls: false`` stops after the first call.
    """
    fmt: Format = "llama" if plan.format == "llama" else "hermes"
    tags = [_call_tag(fmt, t) for t in plan.tools]
    one = not plan.parallel
    if plan.mode == "forced":
        return tags[0]
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": one,
    }
    if plan.mode == "required":
        return calls
    trigger = '{"name": ' if fmt == "llama" else HERMES_OPEN
    later = {"type": "triggered_tags", "triggers": [trigger], "tags": tags, "stop_after_first": one}
    text = {"type": "sequence", "elements": [{"type": "regex", "pattern": _TEXT_START}, later]}
    return {"type": "or", "elements": [calls, text]}
