"""What the tests derive from a model file and keep between runs: a folder per file in
pytest's cache (``.pytest_cache``; ``--cache-clear`` empties it).

An entry's name holds a key of the file as it is now (path, size, modification time) and of
the libraries that wrote it (transformers, gguf), so that a changed file or a new version
makes a new entry; writing it removes the file's older entries. Entries are written
atomically: another run of the suite in the same tree may write the same one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable
from importlib.metadata import version as installed
from pathlib import Path
from typing import TypeVar

import pytest

T = TypeVar("T")


def cache_folder(config: pytest.Config, name: str) -> Path | None:
    """``name`` under pytest's cache folder (``None`` with the cache plugin off)."""
    cache = getattr(config, "cache", None)
    return cache.mkdir(name) if cache is not None else None


def cached(
    folder: Path | None,
    source: Path,
    build: Callable[[], T],
    save: Callable[[T, Path], None],
    load: Callable[[Path], T],
    version: int = 1,
) -> T:
    """``load`` of ``source``'s entry in ``folder``; else ``build()``, saved there by ``save``.

    ``version``: bumped when what ``save`` writes changes. A damaged entry is built again;
    an unwritable folder only costs the next run the build again.
    """
    if folder is None:
        return build()
    entry = folder / f"{source.stem}-{_key(source, version)}"
    if entry.is_dir():
        try:
            return load(entry)
        except Exception:
            shutil.rmtree(entry, ignore_errors=True)
    value = build()
    try:
        _write(entry, lambda tmp: save(value, tmp))
    except OSError:
        pass
    return value


def _key(source: Path, version: int) -> str:
    st = source.stat()
    ident = (
        f"{version}:{source.resolve()}:{st.st_size}:{st.st_mtime_ns}:"
        f"{installed('transformers')}:{installed('gguf')}"
    )
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def _write(entry: Path, save: Callable[[Path], None]) -> None:
    stem = re.escape(entry.name.rsplit("-", 1)[0])
    for old in entry.parent.iterdir():
        written = re.fullmatch(rf"{stem}-[0-9a-f]{{16}}", old.name)
        unfinished = re.fullmatch(rf"\.{stem}-[0-9a-f]{{16}}\.(\d+)", old.name)
        if (written and old.name != entry.name) or (unfinished and not _alive(unfinished[1])):
            shutil.rmtree(old, ignore_errors=True)
    tmp = entry.with_name(f".{entry.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save(tmp)
        os.replace(tmp, entry)
    finally:  # written by another run first, or the save failed
        shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass
    return True
