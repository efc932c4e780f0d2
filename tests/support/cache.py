"""What the tests derive from a model file and keep between runs: a folder per file under
infer's own cache of files derived from model files (``$INFER_CACHE_DIR``, by default
``~/.cache/infer``, beside the tokenizers infer keeps there), so that every checkout on a
machine shares them; delete ``test-references/`` there to rebuild them.

An entry's name holds a key of the file's content and of the libraries that wrote it
(transformers, gguf), so that a changed file or a new version makes a new entry; writing it
removes the file's older entries. Entries are written atomically: another run of the suite
may write the same one.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
from collections.abc import Callable
from importlib.metadata import version as installed
from pathlib import Path
from typing import TypeVar

from infer.models.derived_files import cache_dir

T = TypeVar("T")


def cache_folder(name: str) -> Path:
    """The folder of the entries called ``name`` (made if need be)."""
    folder = cache_dir() / "test-references" / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


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
    digest = _digest(source.resolve(), st.st_size, st.st_mtime_ns)
    ident = f"{version}:{digest}:{installed('transformers')}:{installed('gguf')}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


@functools.cache
def _digest(path: Path, size: int, mtime_ns: int) -> str:
    """The file's content hash (once per process while it is unchanged): the same file in
    another checkout's environment has the same entries."""
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
