"""Tool calls: how a model's template writes them, where a reply opens one, and reading them
back out of its text.

Three formats, chosen by the chat template (:func:`tool_format`):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, as the Qwen2,
  Qwen2.5, Qwen3 and Hermes templates ask for;
- ``llama``: a bare ``{"name": ..., "parameters": {...}}`` object, Llama 3.1/3.2's format;
- ``generic``: for templates that know nothing of tools: the ``hermes`` tags, described to the
  model in a system message (:func:`generic_system_prompt`).

Under ``tool_choice: auto`` the model decides whether to call. A reply opens a call
(:class:`Openings`) with

- its template's call syntax, anywhere: ``<tool_call>`` (``hermes``, ``generic``) or
  ``{"name"`` (``llama``);
- at the start of the reply or right after a call, a JSON object (bare, in a list, or in a
  ```` ```json ```` fence) whose ``"name"`` is an offered tool: what small models write when
  they mean a call, the way llama.cpp's lazy grammars trigger. A JSON object that names no
  tool stays text.

Nothing before the opening is constrained, so a reply that opens no call is the text the
model would have written anyway. From the opening to the end of the call's wrapper,
:func:`calls_format` keeps the call valid: it names an offered tool and its arguments fit
that tool's schema. After it the reply is free again (``parallel_tool_calls: false``: it
ends). ``required`` and a named tool constrain from the first token
(:func:`answer_format`): the user asked for a call. :class:`ToolCallParser` reads the
streamed text with the same :class:`Openings`: content up to the opening, then each call's
name and its ``arguments`` as growing prefixes of one JSON text.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import regex

from infer.api.reasoning import Thinking, answer_offset, partial_suffix, reasoning_seen

Format = Literal["hermes", "llama", "generic"]
Mode = Literal["auto", "required", "forced"]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA_OPEN = '{"name"'
# Whitespace between a call's parts, bounded so that a constrained call cannot run on in it.
_MAX_WS = 16
_WS = f"[ \\t\\n]{{0,{_MAX_WS}}}"


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


@dataclass(frozen=True)
class ToolPlan:
    """How one request calls tools: the offered tools, the choice and the template's format.

    ``mode`` is ``auto`` (the model decides: text, calls, or text then calls), ``required``
    (at least one call, from the first token) or ``forced`` (a call of ``tools[0]``, the
    named tool).
    """

    tools: tuple[Tool, ...]
    mode: Mode
    parallel: bool
    format: Format


@dataclass(frozen=True)
class ToolChoice:
    """What a request asks of tools: the offered ones and how the model may call them. The
    call format is the served template's (:meth:`plan`)."""

    tools: tuple[Tool, ...]
    mode: Mode
    parallel: bool = True

    def plan(self, chat_template: str | None) -> ToolPlan:
        """The plan for a model with this chat template."""
        return ToolPlan(self.tools, self.mode, self.parallel, tool_format(chat_template))


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


def tool_response_text(content: str) -> str:
    """A tool's result as the ``hermes`` format gives it back (in a user turn)."""
    return f"<tool_response>\n{content}\n</tool_response>"


def template_turns(messages: Sequence[Any], plan: ToolPlan | None = None) -> list[dict[str, Any]]:
    """Chat messages (the server's validated ``ChatMessage``) as the template takes them.

    A template that knows no tools (``generic``) gets them described in the system message,
    earlier calls written out in the assistant's turns, and tool results as user turns.
    """
    generic = plan is not None and plan.format == "generic"
    out: list[dict[str, Any]] = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role, "content": m.text()}
        calls = [(c.id, c.function.name, c.function.arguments_object()) for c in m.tool_calls or []]
        if calls and generic:
            written = [call_text("generic", n, json.dumps(a)) for _, n, a in calls]
            turn["content"] = "\n".join(([turn["content"]] if turn["content"] else []) + written)
        elif calls:
            turn["tool_calls"] = [
                {"id": id_, "type": "function", "function": {"name": name, "arguments": args}}
                for id_, name, args in calls
            ]
        if m.role == "tool" and generic:
            turn = {"role": "user", "content": tool_response_text(turn["content"])}
        elif m.role == "tool":
            turn["tool_call_id"] = m.tool_call_id
            if m.name:
                turn["name"] = m.name
        out.append(turn)
    if generic:
        assert plan is not None
        described = generic_system_prompt(plan.tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# --- where a reply opens a call -------------------------------------------------------------


class Openings:
    """Where a reply opens a call: the one rule the grammar and the parser share.

    :meth:`scan` is given the reply's text so far (reasoning block included, when the reply
    may think), or the text after its last call, and says where a call opens, or how much of
    it can no longer be part of one. Under ``required`` and a named tool the calls begin
    with the answer.
    """

    def __init__(self, plan: ToolPlan, thinking: Thinking | None = None) -> None:
        self.plan = plan
        self.thinking = thinking
        self.tags = (LLAMA_OPEN,) if plan.format == "llama" else (HERMES_OPEN,)
        names = "|".join(regex.escape(json.dumps(t.name)[1:-1]) for t in plan.tools)
        self._start = regex.compile(
            f'(?:```(?:json)?[ \\t]*\\n{_WS})?(?:\\[{_WS})?\\{{{_WS}"name"{_WS}:{_WS}"(?:{names})"'
        )

    def scan(self, text: str, since: int = 0, resumed: bool = False) -> tuple[int, bool]:
        """``(offset, True)``: a call opens at ``offset``. ``(offset, False)``: no call opens
        before ``offset`` (text from there may still open one).

        Args:
            text: The reply so far, or (``resumed``) the text after its last call.
            since: An offset an earlier scan of the same growing text returned without an
                opening: the text before it is not searched again.
            resumed: ``text`` follows a call: the answer has begun, and a JSON call may
                open at its start as at the start of the answer.
        """
        start = 0 if resumed else answer_offset(text, self.thinking)
        if start is None:  # the reply has not reached its answer yet
            return max(since, reasoning_seen(text, self.thinking)), False
        if self.plan.mode != "auto":
            return start, True
        first = len(text) - len(text[start:].lstrip())
        if first == len(text):
            return max(since, start), False
        if since <= first:  # at the start of the answer: a JSON call naming a tool
            found = self._start.match(text, first, partial=True)
            if found is not None:
                return (first, True) if not found.partial else (start, False)
        since = max(since, start)
        at = [i for i in (text.find(tag, since) for tag in self.tags) if i >= 0]
        if at:
            return min(at), True
        held = max(partial_suffix(text, tag) for tag in self.tags)
        return max(since, len(text) - held), False


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


# One call object's opening up to its arguments (which must have begun).
_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)'
)


class ToolCallParser:
    """Splits a choice's streamed text into content and tool calls.

    :meth:`feed` takes each new piece of text and returns what can be shown for sure: text
    that may still turn out to open a call (a partial ``<tool_call>``, the start of a reply
    that may be a JSON call, whitespace) is held until it is known. A call is read from its
    opening (:class:`Openings`) to the end of its wrapper (tags, fence, list); none of that
    shows as content. After it the text is read as before. A call cut off part-way is left
    out (:attr:`calls` marks it incomplete).

    Args:
        plan: The request's tools.
        thinking: Set when the text still holds the reply's reasoning block (it is content
            here, and no call opens inside it).
    """

    def __init__(self, plan: ToolPlan, thinking: Thinking | None = None) -> None:
        self.plan = plan
        self.openings = Openings(plan, thinking)
        self.calls: list[Call] = []
        self._text = ""  # the text since the last call (or the reply's start)
        self._given = 0  # text[:_given] has been given out as content
        self._safe = 0  # no call opens before it
        self._region: str | None = None  # a call's text not read yet, once it opened
        self._closers: list[str] = []  # what is still to close the call's wrapper, in order
        self._in_list = False
        self._state: Literal["wrapper", "head", "args", "object", "after"] = "wrapper"
        self._call: Call | None = None  # the call whose arguments are being read
        self._scan = _JSONScanner()

    def feed(self, text: str) -> Delta:
        delta = Delta()
        self._feed(delta, text)
        return delta

    def finish(self) -> Delta:
        """The end of the text: give out what was held, unless it belongs to a call."""
        delta = Delta()
        rest = self._text[self._given :]
        if self._region is None and (rest.strip() or self._given or not self.calls):
            self._give(delta, rest)
        return delta

    def complete_calls(self) -> list[Call]:
        return [c for c in self.calls if c.complete]

    def _feed(self, delta: Delta, text: str) -> None:
        while True:
            if self._region is not None:
                self._region += text
                rest = self._read_call(delta)
                if rest is None:
                    return
                self._region, text = None, rest  # the call's wrapper closed: text again
                self._text, self._given, self._safe = "", 0, 0
            self._text += text
            text = ""
            resumed = bool(self.calls)
            offset, opened = self.openings.scan(self._text, self._safe, resumed)
            if resumed and self._given == 0:  # the whitespace after a call: not content
                self._given = min(offset, len(self._text) - len(self._text.lstrip()))
            self._give(delta, self._text[self._given : offset].rstrip())
            if not opened:
                self._safe = offset
                return
            self._region = self._text[offset:]
            self._state, self._closers, self._in_list = "wrapper", [], False

    def _give(self, delta: Delta, text: str) -> None:
        delta.content += text
        self._given += len(text)

    def _read_call(self, delta: Delta) -> str | None:
        """Read the call's text as far as it goes; the text after its wrapper once that
        closed, else ``None``."""
        steps = {
            "wrapper": self._read_head,
            "head": self._read_head,
            "args": self._read_arguments,
            "object": self._read_brace,
            "after": self._read_wrapper_end,
        }
        while True:
            step = steps[self._state](delta)
            if step is not True:
                return step if isinstance(step, str) else None

    # Each step of reading a call: True to go on, False to wait for more text, or (the last)
    # the text after the call's wrapper.

    def _read_head(self, delta: Delta) -> bool:
        """The call's name (at ``wrapper``: after what opened it, which says what closes it)."""
        region = self._region
        assert region is not None
        head = _HEAD.search(region) if self._state == "wrapper" else None
        head = head or _HEAD.match(region)
        if head is None:
            return False
        if self._state == "wrapper":  # what opened the call: what must close it
            opening = region[: head.start()]
            self._closers = [HERMES_CLOSE] if HERMES_OPEN in opening else []
            self._closers += ["```"] if "```" in opening else []
            self._in_list = "[" in opening
        self._call = Call(len(self.calls), new_call_id(), json.loads(f'"{head[1]}"'))
        self.calls.append(self._call)
        self._scan = _JSONScanner()
        delta.calls.append((self._call, ""))
        delta.opened.append(self._call.index)
        self._region = region[head.end() :]
        self._state = "args"
        return True

    def _read_arguments(self, delta: Delta) -> bool:
        """The call's arguments, as far as they have come."""
        region, call = self._region, self._call
        assert region is not None and call is not None
        end = self._scan.feed(region)
        piece = region if end is None else region[:end]
        if piece:
            call.arguments += piece
            delta.calls.append((call, piece))
        if end is None:
            self._region = ""
            return False
        self._region = region[end:]
        self._state = "object"
        return True

    def _read_brace(self, delta: Delta) -> bool:
        """The call object's closing brace."""
        closed = self._expect("}")
        if closed is None:
            return False
        assert self._call is not None
        self._call.complete = closed
        self._call = None
        self._state = "after"
        return True

    def _read_wrapper_end(self, delta: Delta) -> bool | str:
        """Another object of the list or the fence, or the wrapper's closing parts."""
        if self._in_list:
            if self._expect(",", keep_going=True):
                self._state = "head"
                return True
            closed = self._expect("]")
            if closed is None:
                return False
            self._in_list = False
        assert self._region is not None
        if self._closers[-1:] == ["```"]:  # a fence may hold several calls
            text = self._region.lstrip()
            if not text:
                return False
            if text[0] in "{[":
                self._region = text[1:] if text[0] == "[" else text
                self._in_list = text[0] == "["
                self._state = "head"
                return True
        while self._closers:
            closed = self._expect(self._closers[0])
            if closed is None:
                return False
            self._closers.pop(0)
        return self._region

    def _expect(self, closer: str, keep_going: bool = False) -> bool | None:
        """Consume whitespace and ``closer``: ``True`` if it was there, ``None`` if the text
        so far may still become it, ``False`` if it is not there (an unconstrained call
        that went astray: its wrapper counts as closed). ``keep_going``: ``False`` rather
        than ``None`` when unsure (a list's comma, else its bracket is tried)."""
        assert self._region is not None
        text = self._region.lstrip()
        if text.startswith(closer):
            self._region = text[len(closer) :]
            return True
        if closer.startswith(text) and not keep_going:
            return None
        return False


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


# --- the grammar that keeps calls valid -----------------------------------------------------


def _call_tag(fmt: Format, tool: Tool) -> dict[str, Any]:
    """One tool's call as xgrammar's structural ``tag``, as the template writes it: fixed
    text around its arguments, which must validate against the tool's parameters."""
    if fmt == "llama":
        begin, end = f'{{"name": "{tool.name}", "parameters": ', "}"
    else:
        begin, end = f'{HERMES_OPEN}\n{{"name": "{tool.name}", "arguments": ', f"}}\n{HERMES_CLOSE}"
    content = {"type": "json_schema", "json_schema": dict(tool.parameters)}
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def answer_format(plan: ToolPlan) -> dict[str, Any]:
    """The structural format (xgrammar's JSON form) of an answer that must call:
    ``required`` (calls from the first token, nothing else) or ``forced`` (one call of the
    named tool), written as the template writes calls. ``parallel_tool_calls: false`` stops
    after the first call."""
    assert plan.mode != "auto", "under auto the model decides: see calls_format"
    fmt: Format = "llama" if plan.format == "llama" else "hermes"
    tags = [_call_tag(fmt, t) for t in plan.tools]
    if plan.mode == "forced":
        return tags[0]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": not plan.parallel,
    }


def _seq(*elements: Any) -> dict[str, Any]:
    parts = [{"type": "regex", "pattern": e} if isinstance(e, str) else e for e in elements]
    return {"type": "sequence", "elements": parts}


def _call_object(tool: Tool) -> dict[str, Any]:
    """``{"name": "<tool>", "arguments": <its arguments>}`` (or ``"parameters"``), spaced
    as the model likes."""
    name = {"type": "const_string", "value": json.dumps(tool.name)}
    arguments = {
        "type": "json_schema",
        "json_schema": dict(tool.parameters),
        "max_whitespace_cnt": _MAX_WS,
    }
    return _seq(
        f'\\{{{_WS}"name"{_WS}:{_WS}',
        name,
        f'{_WS},{_WS}"(arguments|parameters)"{_WS}:{_WS}',
        arguments,
        f"{_WS}\\}}",
    )


def calls_format(plan: ToolPlan) -> dict[str, Any]:
    """The structural format (xgrammar's JSON form) of a call from where the reply opened it
    (:class:`Openings`) to the end of its wrapper and on, in any of the ways a call opens: the
    template's tags, a bare JSON object, a list of them, or several of either in a
    ```` ```json ```` fence (one call without ``parallel_tool_calls``). Each object names an
    offered tool and its arguments fit that tool's schema."""
    objects = [_call_object(t) for t in plan.tools]
    one = objects[0] if len(objects) == 1 else {"type": "or", "elements": objects}
    more: dict[str, Any] = {"type": "star", "content": _seq(f"{_WS},{_WS}", one)}
    listed = _seq(f"\\[{_WS}", one, *([more] if plan.parallel else []), f"{_WS}\\]")
    json_call = {"type": "or", "elements": [one, listed]}
    # in a fence, as many JSON calls as the model writes (one without parallel calls)
    fenced_calls: list[Any] = [json_call]
    if plan.parallel:
        fenced_calls.append({"type": "star", "content": _seq(_WS, json_call)})
    fenced = _seq(f"```(json)?[ \\t]*\\n{_WS}", *fenced_calls, f"{_WS}```")
    forms = [json_call, fenced]
    if plan.format != "llama":  # the template's tags (a llama call is the bare object)
        forms.append(_seq(f"{HERMES_OPEN}{_WS}", one, f"{_WS}{HERMES_CLOSE}"))
    # After the call: free text (the reply goes on free, and a token may reach past the
    # call's end, as ``}\n`` does), or, without parallel calls, whitespace and the end.
    after = {"type": "any_text"} if plan.parallel else {"type": "regex", "pattern": _WS}
    return _seq({"type": "or", "elements": forms}, after)
