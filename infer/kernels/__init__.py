"""Small C++ kernels, compiled once per machine with ``torch.utils.cpp_extension``.

The build lands in ``~/.cache/infer/kernels/<key>`` (``INFER_KERNEL_DIR`` overrides it),
keyed by the sources, torch's and Python's versions and the CPU's instruction set, since it
is compiled with ``-march=native``. ``make`` builds it before tests and serving (``python -m
infer.kernels``); the first use builds it otherwise, which takes about a minute. Once built,
a process imports the library directly, without ``cpp_extension.load`` (which would run
ninja, and rebuild for another copy of the same sources, such as an installed wheel's).

``INFER_KERNEL_ISA`` picks another target than this CPU's own: ``avx2`` (x86-64-v3: AVX2,
FMA, F16C) or ``avxvnni`` (the same with AVX-VNNI), the instruction sets of most laptops, so
that their kernels run and are tested on a newer CPU too.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sysconfig
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
    "encoder_attention.cpp",
    "sampling.cpp",
    "decode_stack.cpp",
)
HEADERS = ("ops.h", "vec.h")
NAME = "infer_kernels"
LIBRARY = f"{NAME}.so"  # what ``cpp_extension.load`` links in the build directory
CFLAGS = ("-O3", "-fno-trapping-math", "-fopenmp")
# The targets a build can have: its -march flags, and the /proc/cpuinfo flags a CPU needs to
# run it.
ISAS = {
    "native": (("-march=native", "-mprefer-vector-width=512"), ()),
    "avx2": (("-march=x86-64-v3",), ("avx2", "fma", "f16c")),
    "avxvnni": (("-march=x86-64-v3", "-mavxvnni"), ("avx2", "fma", "f16c", "avx_vnni")),
}
_lock = threading.Lock()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def isa() -> str:
    """The target this process builds and runs: ``INFER_KERNEL_ISA``, else ``native``."""
    name = os.environ.get("INFER_KERNEL_ISA") or "native"
    if name not in ISAS:
        raise ValueError(f"INFER_KERNEL_ISA={name!r}: choose one of {', '.join(ISAS)}")
    return name


def runnable_isas() -> list[str]:
    """The targets this CPU can run."""
    flags = set(_cpu_flags().split())
    return [name for name, (_, needs) in ISAS.items() if flags.issuperset(needs)]


def _name(target: str) -> str:
    return NAME if target == "native" else f"{NAME}_{target}"


def build_dir(target: str | None = None) -> Path:
    """Where this machine's build of the kernels for ``target`` (default: ``isa()``) lives."""
    target = target or isa()
    digest = hashlib.sha256()
    here = Path(__file__).parent
    for name in SOURCES + HEADERS:
        digest.update((here / name).read_bytes())
    # EXT_SUFFIX names the Python version and ABI the bindings are compiled against.
    abi = str(sysconfig.get_config_var("EXT_SUFFIX"))
    flags = (*CFLAGS, *ISAS[target][0])
    digest.update(" ".join((torch.__version__, abi, *flags, _cpu_flags())).encode())
    root = Path(os.environ.get("INFER_KERNEL_DIR", Path.home() / ".cache" / "infer" / "kernels"))
    return root / digest.hexdigest()[:16]


@cache
def has_bf16() -> bool:
    """Whether this build has the AVX512-BF16 kernels (asked once: the layers ask every step)."""
    return bool(ops().has_bf16_linear())


@cache
def has_quant() -> bool:
    """Whether this build has the quantized linears (any x86-64 CPU with AVX2)."""
    return bool(ops().has_quant_linear())


def ops() -> ModuleType:
    """The compiled kernels for ``isa()`` (built on first use; later processes import the
    cached build)."""
    return ops_for(isa())


@cache
def ops_for(target: str) -> ModuleType:
    """The compiled kernels for one of ``ISAS``: each its own library, so a process can hold
    several (the tests compare them)."""
    if target not in ISAS:
        raise ValueError(f"unknown kernel target {target!r}")
    directory = build_dir(target)
    library = directory / f"{_name(target)}.so"
    with _lock:
        # ``lock`` is load's own baton: while it exists, a process is building (or linking)
        # here, and load waits for it.
        if library.is_file() and not (directory / "lock").exists():
            try:
                return _import(library, _name(target))
            except ImportError:
                library.unlink(missing_ok=True)  # a broken link: build it again
        return _build(directory, target)


def _import(library: Path, name: str) -> ModuleType:
    """Import a built library (torch, already imported, provides the symbols it links)."""
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {library}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(directory: Path, target: str) -> ModuleType:
    from torch.utils.cpp_extension import load

    if shutil.which("ninja") is None:
        # torch runs ``ninja`` from PATH; the ``ninja`` package (a dependency) puts it beside
        # the interpreter, which is on PATH only in an activated venv.
        try:
            import ninja

            os.environ["PATH"] = os.pathsep.join((os.environ.get("PATH", ""), ninja.BIN_DIR))
        except ImportError:
            pass  # load says: "Ninja is required to load C++ extensions"
    here = Path(__file__).parent
    directory.mkdir(parents=True, exist_ok=True)
    return load(
        name=_name(target),
        sources=[str(here / name) for name in SOURCES],
        extra_cflags=[*CFLAGS, *ISAS[target][0]],
        build_directory=str(directory),
        verbose=False,
    )
