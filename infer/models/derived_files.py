"""Where infer keeps what it derives from model files: ``$INFER_CACHE_DIR`` (``~/.cache/infer``)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_dir() -> Path:
    """``$INFER_CACHE_DIR``, or ``~/.cache/infer``."""
    return Path(os.environ.get("INFER_CACHE_DIR") or "~/.cache/infer").expanduser()


def file_key(path: Path) -> str:
    """A key for a file as it is now: its resolved path, size and modification time."""
    st = path.stat()
    ident = f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]
