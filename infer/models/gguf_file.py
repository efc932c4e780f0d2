"""A GGUF file's metadata and tensors, read without building its long arrays.

``gguf.GGUFReader`` builds a numpy view of every element of every metadata array: slow for a
151k-token vocabulary and its merges. We need the scalars and short arrays; long arrays (the
vocabulary, the merges) are skipped by their lengths, and the tokenizer is built from the file
by transformers once and then cached. Tensor data stays a memory map.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_MAGIC = b"GGUF"
# value type -> struct format of a scalar of that type
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?"}
_SCALARS |= {10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY = 1024  # longer metadata arrays are skipped (None)
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying first
    data: np.ndarray  # plain types: their values [..]; others: raw bytes [rows, row bytes]


class GGUFFile:
    """``fields`` (key -> value; long arrays are ``None``) and ``tensors`` of a GGUF file.

    Raises:
        ValueError: The file is not GGUF, or is truncated or malformed.
    """

    def __init__(self, path: Path) -> None:
        self.fields: dict[str, Any] = {}
        with path.open("rb") as f:
            if f.read(4) != _MAGIC:
                raise ValueError("not a GGUF file (bad magic)")
            version, n_tensors, n_kv = struct.unpack("<IQQ", _read(f, 20))
            if version < 2:
                raise ValueError(f"GGUF version {version} is not supported")
            for _ in range(n_kv):
                key = _string(f)
                (vtype,) = struct.unpack("<I", _read(f, 4))
                self.fields[key] = _value(f, vtype)
            infos = []
            for _ in range(n_tensors):
                name = _string(f)
                (n_dims,) = struct.unpack("<I", _read(f, 4))
                dims = struct.unpack(f"<{n_dims}Q", _read(f, 8 * n_dims))
                qtype, offset = struct.unpack("<IQ", _read(f, 12))
                infos.append((name, GGMLQuantizationType(qtype), dims, offset))
            align = int(self.fields.get("general.alignment") or 32)
            start = (f.tell() + align - 1) // align * align
        memory = np.memmap(path, dtype=np.uint8, mode="r")
        self.tensors = [self._tensor(memory, start, *info) for info in infos]

    @staticmethod
    def _tensor(
        memory: np.ndarray,
        start: int,
        name: str,
        qtype: GGMLQuantizationType,
        dims: tuple[int, ...],
        offset: int,
    ) -> GGUFTensor:
        block, size = GGML_QUANT_SIZES[qtype]
        count = int(np.prod(dims))
        nbytes = count // block * size
        begin = start + offset
        if begin + nbytes > memory.shape[0]:
            raise ValueError(f"tensor {name} runs past the end of the file")
        raw = memory[begin : begin + nbytes]
        if qtype in _PLAIN:
            data = raw.view(_PLAIN[qtype]).reshape(tuple(reversed(dims)))
        else:
            rows = count // dims[0]
            data = raw.reshape(rows, nbytes // rows)
        return GGUFTensor(name, qtype, dims, data)


def _read(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError("the file ends inside its header")
    return data


def _string(f: BinaryIO) -> str:
    (n,) = struct.unpack("<Q", _read(f, 8))
    return _read(f, n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        fmt = "<" + _SCALARS[vtype]
        return struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]
    if vtype == _STRING:
        return _string(f)
    if vtype != _ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype}")
    item, count = struct.unpack("<IQ", _read(f, 12))
    if item in _SCALARS:
        fmt = _SCALARS[item]
        size = struct.calcsize(fmt)
        if count > _KEEP_ARRAY:
            f.seek(size * count, 1)
            return None
        return list(struct.unpack(f"<{count}{fmt}", _read(f, size * count)))
    values = [_value(f, item) for _ in range(count)] if count <= _KEEP_ARRAY else None
    if values is None:
        for _ in range(count):
            _skip(f, item)
    return values


def _skip(f: BinaryIO, vtype: int) -> None:
    if vtype == _STRING:
        (n,) = struct.unpack("<Q", _read(f, 8))
        f.seek(n, 1)
    else:
        _value(f, vtype)
