"""Small C++ kernels, compiled once per machine with ``torch.utils.cpp_extension``.

The build lands in ``~/.cache/infer/kernels/<key>`` (``INFER_KERNEL_DIR`` overrides it),
keyed by the sources, torch's version and the CPU's instruction set, since it is compiled
with ``-march=native``. ``make`` builds it before tests and serving (``python -m
infer.kernels``); the first import builds it otherwise, which takes about a minute.
"""

from __future__ import annotations

import hashlib
import os
import threading
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

SOURCES = (
    "bindings.cpp",
    "paged_attention.cpp",
    "layer_ops.cpp",
    "linear.cpp",
    "quant_linear.cpp",
    "prefill_attention.cpp",
    "sampling.cpp",
    "decode_stack.cpp",
)
HEADERS = ("ops.h", "vec.h")
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-trapping-math", "-fopenmp")
_lock = threading.Lock()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_dir() -> Path:
    """Where this machine's build of the kernels lives."""
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in SOURCES + HEADERS:
        digest.update((here / name).read_bytes())
    digest.update(" ".join((torch.__version__, *CFLAGS, _cpu_flags())).encode())
    root = Path(os.environ.get("INFER_KERNEL_DIR", Path.home() / ".cache" / "infer" / "kernels"))
    return root / digest.hexdigest()[:16]


@cache
def has_bf16() -> bool:
    """Whether this build has the AVX512-BF16 kernels (asked once: the layers ask every step)."""
    return bool(ops().has_bf16_linear())


@cache
def has_quant() -> bool:
    """Whether this build has the AVX512-VNNI quantized linears."""
    return bool(ops().has_quant_linear())


@cache
def ops() -> ModuleType:
    """The compiled kernels (built on first use; later processes load the cached build)."""
    from torch.utils.cpp_extension import load

    here = Path(__file__).parent
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with _lock:
        return load(
            name="infer_kernels",
            sources=[str(here / name) for name in SOURCES],
            extra_cflags=list(CFLAGS),
            build_directory=str(directory),
            verbose=False,
        )
