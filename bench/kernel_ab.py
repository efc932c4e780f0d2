"""Two or more builds of the kernels in one process, timed in turn on the same calls.

    python bench/kernel_ab.py old=PATH/infer_kernels.so new=OTHER/infer_kernels.so

Build a variant with ``INFER_KERNEL_DIR=/tmp/variant python -m infer.kernels`` (add
``INFER_KERNEL_ISA=avx2`` for the AVX2 one) and compare it with the build it changes, on
``bench/quant_kernel.py``'s cases at 1, 16 and 64 rows. On a VM whose speed moves from minute
to minute, only builds timed side by side like this can be compared. Each build is loaded
under a name of its own: under one name Python hands back the module loaded first, and every
build would be the first one. A library keeps its file name (its init function is named
after it), so copy an old build into a folder of its own rather than renaming it. A build
whose outputs differ from the first one's is marked.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType

import torch
from quant_kernel import CASES, random_weight

import infer  # noqa: F401  (sets OMP_WAIT_POLICY before torch threads start)
from infer.models.quant import pack


def load(tag: str, path: Path) -> ModuleType:
    """The extension at ``path`` (``infer_kernels*.so``) as the module ``tag.<its name>``."""
    spec = importlib.util.spec_from_file_location(f"{tag}.{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    builds = {tag: load(tag, Path(path)) for tag, path in (a.split("=", 1) for a in sys.argv[1:])}
    if len({id(m) for m in builds.values()}) != len(builds):
        raise SystemExit("two tags loaded the same module")
    torch.manual_seed(0)
    for name, n, k, bits, group, per, q6k in CASES:
        packed = pack(random_weight(n, k, bits, group, per, q6k))
        for rows in (1, 16, 64):
            x = torch.randn(rows, k).bfloat16()
            outs = {t: m.quant_linear(x, packed, None, True) for t, m in builds.items()}
            first = next(iter(outs.values()))
            times: dict[str, list[float]] = {t: [] for t in builds}
            for _ in range(max(6, 120 // rows)):
                for t, m in builds.items():
                    start = time.perf_counter()
                    m.quant_linear(x, packed, None, True)
                    times[t].append(time.perf_counter() - start)
            cells = [
                f"{t} {statistics.median(v) * 1000:.3f} ms"
                + ("" if torch.equal(outs[t], first) else " (other outputs)")
                for t, v in times.items()
            ]
            print(f"{name:>14} {rows:>2} rows: " + ", ".join(cells))


if __name__ == "__main__":
    main()
