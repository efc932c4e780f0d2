"""An incremental Server-Sent Events parser, as the WHATWG ``EventSource`` spec reads a stream.

Bytes arrive in arbitrary chunks; lines end with CRLF, LF or CR; a blank line dispatches the
event built so far; ``:`` starts a comment (heartbeats); ``data`` lines are joined with
newlines; one space after the colon is dropped; an event with no ``data`` is not dispatched;
the last ``id`` seen stays the id of later events. The benchmark client and the tests read
streams with it.
"""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SSEEvent:
    """One dispatched event: its type (``message`` when unnamed), data and last event id; or,
    from a parser that reports them, a comment line (``comment`` set, the rest empty)."""

    event: str
    data: str
    id: str = ""
    comment: str | None = None

    def json(self) -> Any:
        return json.loads(self.data)


class SSEParser:
    """Feed it bytes with :meth:`feed`; it returns the events each chunk completes.

    Args:
        comments: Also return each comment line as an event, in stream order.
    """

    def __init__(self, comments: bool = False) -> None:
        self._report_comments = comments
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buffer = ""
        self._pending_cr = False  # the last chunk ended with CR: a following LF is not a line
        self._event = ""
        self._data: list[str] = []
        self._last_id = ""
        self.comments = 0  # comment lines seen (heartbeats)

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        """Parse a chunk of the stream; return the events it completed, in order."""
        text = self._decoder.decode(chunk)
        if not text:
            return []
        if self._pending_cr and text.startswith("\n"):
            text = text[1:]
        self._pending_cr = text.endswith("\r")
        self._buffer += text
        events: list[SSEEvent] = []
        lines = self._buffer.replace("\r\n", "\n").replace("\r", "\n").split("\n")
        self._buffer = lines.pop()  # an unterminated line waits for the next chunk
        for line in lines:
            event = self._line(line)
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: str) -> SSEEvent | None:
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            self.comments += 1
            return SSEEvent("", "", comment=line[1:].strip()) if self._report_comments else None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "event":
            self._event = value
        elif name == "data":
            self._data.append(value)
        elif name == "id" and "\0" not in value:
            self._last_id = value
        # "retry" and unknown fields do not matter to a benchmark client.
        return None

    def _dispatch(self) -> SSEEvent | None:
        event, data = self._event or "message", self._data
        self._event, self._data = "", []
        if not data:
            return None
        return SSEEvent(event, "\n".join(data), self._last_id)


def parse(text: str | bytes) -> list[SSEEvent]:
    """Every event and comment of a whole stream (a last event without its blank line too)."""
    raw = text.encode() if isinstance(text, str) else text
    parser = SSEParser(comments=True)
    return parser.feed(raw) + parser.feed(b"\n\n")
