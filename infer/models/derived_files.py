"""Where infer keeps what it derives from model files: ``$INFER_CACHE_DIR`` (``~/.cache/infer``),
and how a derived directory is put there so that no reader ever sees it half written."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

# Written into a derived directory before it is renamed into place: what it was made from.
MARKER_NAME = "infer-conversion.json"


def cache_dir() -> Path:
    """``$INFER_CACHE_DIR``, or ``~/.cache/infer``."""
    return Path(os.environ.get("INFER_CACHE_DIR") or "~/.cache/infer").expanduser()


def file_key(path: Path) -> str:
    """A key for a file as it is now: its resolved path, size and modification time."""
    st = path.stat()
    ident = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def is_current(target: Path, marker: dict[str, object]) -> bool:
    """Whether ``target`` is a finished directory made from what ``marker`` describes."""
    try:
        return json.loads((target / MARKER_NAME).read_text()) == marker
    except (OSError, ValueError):
        return False


def publish_dir(tmp: Path, target: Path, marker: dict[str, object]) -> None:
    """Mark the finished directory ``tmp`` and rename it to ``target``, replacing a stale one.

    Concurrent writers each finish their own ``tmp``; the first rename wins and the others
    find ``target`` current.
    """
    (tmp / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
    try:
        tmp.rename(target)
        return
    except OSError:
        if is_current(target, marker):
            return  # another process finished first
    # A stale directory (older format or source): move it aside first, as rename cannot
    # replace a non-empty directory.
    stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
    target.rename(stale / target.name)
    tmp.rename(target)
    shutil.rmtree(stale, ignore_errors=True)
