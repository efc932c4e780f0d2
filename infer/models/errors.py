"""What loading a checkpoint can raise."""

from __future__ import annotations


class LoadError(Exception):
    """A model could not be loaded. The message is one line that names the problem."""

    @classmethod
    def caused_by(cls, message: str, cause: BaseException) -> LoadError:
        """``message`` followed by the first line of ``cause`` (at most 200 characters)."""
        text = str(cause).strip().splitlines()
        line = text[0] if text else type(cause).__name__
        line = line if len(line) <= 200 else line[:197] + "..."
        return cls(f"{message} ({line})")


class WrongKindError(LoadError):
    """The model is of another kind than asked for (an encoder where a generator was
    wanted, or the reverse); raised before its weights are read."""
