"""One person typing real code, for the ``fim`` load: the code completions an editor asks.

The person retypes function bodies of Python's own standard library (files nobody tuned
infer's layouts on: those were judged on HumanEval, :mod:`bench.fim_eval`), line by line,
into the file where they were, and asks for a completion at several points of each line:
on the blank line (after the editor's auto-indent), and after some of the words. Each
request is the body llama.vim sends (its ``autoload/llama.vim``): the 256 lines before the
cursor's line as ``input_prefix``, the cursor's line up to the cursor as ``prompt`` (empty
on a blank line), the rest of the line and the 64 lines after it as ``input_suffix``,
``n_indent`` the line's indentation, ``t_max_predict_ms`` its default, and a few chunks of
another file as ``input_extra`` (llama.vim's ring of recently seen code), the same for the
whole session.

What the person typed next on the line is kept with each request, to judge the ghost
text's first line against it.
"""

from __future__ import annotations

import ast
import importlib.util
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Modules whose functions are retyped, and the one whose chunks fill the ring.
MODULES = ("textwrap", "shlex", "fnmatch", "calendar", "difflib", "argparse")
RING_MODULE = "string"
N_PREFIX, N_SUFFIX = 256, 64  # llama.vim's defaults (lines)
N_PREDICT, T_MAX_PREDICT_MS = 128, 1000
RING_CHUNKS, RING_CHUNK_LINES = 4, 32
BODY_LINES = (6, 24)  # the functions retyped: bodies of this many lines
WORD = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


@dataclass(frozen=True)
class Keystroke:
    """One completion asked while typing: where, and what came next."""

    prefix: str  # the lines before the cursor's line (each with its newline)
    middle: str  # the cursor's line up to the cursor ("" on a blank line)
    suffix: str  # the rest of the cursor's line, a newline, the lines after it
    indent: int  # the cursor's line's indentation (0 on a blank line, as llama.vim sends)
    typed_next: str  # what the person typed on the line after the cursor
    where: str  # file:line:column, for reports

    def body(self, extra: list[dict[str, str]], sampling: dict[str, Any]) -> dict[str, Any]:
        """llama.vim's /infill request body (its response fields, and the sampling given)."""
        return {
            "id_slot": 0,
            "input_prefix": self.prefix,
            "input_suffix": self.suffix,
            "input_extra": extra,
            "prompt": self.middle,
            "n_predict": N_PREDICT,
            "stop": [],
            "n_indent": self.indent,
            "stream": False,
            "cache_prompt": True,
            "t_max_prompt_ms": 500,
            "t_max_predict_ms": T_MAX_PREDICT_MS,
            "response_fields": [
                "content",
                "timings/prompt_n",
                "timings/prompt_ms",
                "timings/predicted_n",
                "timings/predicted_ms",
                "truncated",
                "tokens_cached",
            ],
            "model": "",
            **sampling,
        }


def ring(seed: int = 0) -> list[dict[str, str]]:
    """llama.vim's ``input_extra``: chunks of another file, the same all session."""
    path = _module_file(RING_MODULE)
    lines = path.read_text().splitlines(keepends=True)
    rng = random.Random(seed)
    chunks = []
    for _ in range(RING_CHUNKS):
        start = rng.randrange(0, max(1, len(lines) - RING_CHUNK_LINES))
        text = "".join(lines[start : start + RING_CHUNK_LINES])
        chunks.append({"text": text, "filename": path.name})
    return chunks


def session(functions: int, points: int = 3, seed: int = 0) -> list[Keystroke]:
    """The completions asked while retyping ``functions`` function bodies (taken in turn
    from :data:`MODULES`), ``points`` per line (the blank line, then after words)."""
    rng = random.Random(seed)
    chosen: list[tuple[Path, list[str], tuple[int, int]]] = []
    pools = []
    for module in MODULES:
        path = _module_file(module)
        source = path.read_text()
        bodies = [b for b in _bodies(source) if BODY_LINES[0] <= b[1] - b[0] <= BODY_LINES[1]]
        rng.shuffle(bodies)
        pools.append((path, source.splitlines(keepends=True), bodies))
    while len(chosen) < functions and any(bodies for _, _, bodies in pools):
        for path, lines, bodies in pools:
            if bodies and len(chosen) < functions:
                chosen.append((path, lines, bodies.pop()))
    keystrokes: list[Keystroke] = []
    for path, lines, (start, end) in chosen:
        keystrokes += _retype(path.name, lines, start, end, points, rng)
    return keystrokes


def _retype(
    name: str, lines: list[str], start: int, end: int, points: int, rng: random.Random
) -> list[Keystroke]:
    """Lines ``start..end`` typed again, one by one, into the file without them."""
    asked = []
    after = lines[end:]
    for i in range(start, end):
        line = lines[i].removesuffix("\n")
        if not line.strip():
            continue
        before = lines[max(0, i - N_PREFIX) : i]
        prefix = "".join(before)
        rest = "".join(after[:N_SUFFIX])
        indent = len(line) - len(line.lstrip(" \t"))
        ends = _word_ends(line, indent)
        stops = [indent, *sorted(rng.sample(ends, min(points - 1, len(ends))))]
        for column in stops:
            blank = column <= indent
            asked.append(
                Keystroke(
                    prefix=prefix,
                    middle="" if blank else line[:column],
                    suffix="\n" + rest,
                    indent=0 if blank else indent,
                    typed_next=line[indent:] if blank else line[column:],
                    where=f"{name}:{i + 1}:{column}",
                )
            )
    return asked


def _word_ends(line: str, indent: int) -> list[int]:
    """Columns right after a word of ``line`` (not its last character)."""
    return [m.end() for m in WORD.finditer(line, indent) if m.end() < len(line)]


def _bodies(source: str) -> list[tuple[int, int]]:
    """``(first, end)`` line indices of every function body of ``source`` (0-based, the
    body after its docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
            body = node.body
            if ast.get_docstring(node) is not None:
                body = body[1:]
            if body:
                found.append((body[0].lineno - 1, node.end_lineno))
    return found


def _module_file(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"no source for module {name!r}")
    return Path(spec.origin)


def matches(keystroke: Keystroke, content: str) -> bool:
    """Whether the ghost text's first line is what the person typed next on the line (on a
    blank line the completion brings the indentation the editor already wrote)."""
    shown = content.split("\n", 1)[0]
    if not keystroke.middle:
        return shown.strip() == keystroke.typed_next.strip() != ""
    return shown.rstrip() == keystroke.typed_next.rstrip() != ""
