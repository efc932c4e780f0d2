"""What loading a checkpoint can raise, and small helpers shared by the loaders."""

from __future__ import annotations


class LoadError(Exception):
    """A model could not be loaded. The message is one line that names the problem."""


def eos_token_ids(*sources: int | list[int] | None) -> list[int]:
    """All end-of-sequence ids named by any source, deduplicated, in order of first mention."""
    ids: list[int] = []
    for source in sources:
        for i in source if isinstance(source, list | tuple) else [source]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return ids


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else type(e).__name__
    return line if len(line) <= 200 else line[:197] + "..."
