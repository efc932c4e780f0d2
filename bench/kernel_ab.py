"""Two or more builds of the kernels in one process, timed in turn on the same calls.

    python bench/kernel_ab.py old=PATH/infer_kernels.so new=OTHER/infer_kernels.so
    python bench/kernel_ab.py --rows 16,64,256 old=... new=...
    python bench/kernel_ab.py --step 64 old=... new=...   # whole decode steps of the 1.5B

Build a variant with ``INFER_KERNEL_DIR=/tmp/variant python -m infer.kernels`` (add
``INFER_KERNEL_ISA=avx2`` for the AVX2 one) and compare it with the build it changes, on
``bench/quant_kernel.py``'s cases (gate/up as the gated call the model makes), or with
``--step N`` on whole decode steps of Qwen2.5-Coder-1.5B at batch N, the builds taking turns
step by step (every kernel the model calls comes from the build whose turn it is). On a VM
whose speed moves from minute to minute, only builds timed side by side like this can be
compared. Each build is loaded under a name of its own: under one name Python hands back the
module loaded first, and every build would be the first one. A library keeps its file name
(its init function is named after it), so copy an old build into a folder of its own rather
than renaming it. A build whose outputs differ from the first one's is marked.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import torch
from quant_kernel import CASES, random_weight

from infer import kernels
from infer.models.quant import pack


def load(tag: str, path: Path) -> ModuleType:
    """The extension at ``path`` (``infer_kernels*.so``) as the module ``tag.<its name>``."""
    spec = importlib.util.spec_from_file_location(f"{tag}.{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def calls(builds: dict[str, ModuleType], rows_list: list[int]) -> None:
    """Each case at each row count: median ms per build."""
    torch.manual_seed(0)
    for name, n, k, bits, group, per, q6k in CASES:
        packed = pack(random_weight(n, k, bits, group, per, q6k))
        for rows in rows_list:
            x = torch.randn(rows, k).bfloat16()
            call = partial(_call, x=x, packed=packed, gated=name.startswith("gate"))
            _report(f"{name:>14} {rows:>3} rows", builds, call, max(6, 240 // rows))


def _call(m: ModuleType, x: torch.Tensor, packed: torch.Tensor, gated: bool) -> torch.Tensor:
    if gated:
        return m.quant_gated_linear(x, packed, None, False)
    return m.quant_linear(x, packed, None, True)


def steps(builds: dict[str, ModuleType], batch: int, count: int, context: int) -> None:
    """Decode steps of the 1.5B at ``batch`` sequences of ``context`` tokens, the builds in
    turn."""
    from offline import step_engine

    from infer.models.loader import load_model

    loaded = load_model("qwen2.5-coder-1.5b", torch.bfloat16)
    engine = step_engine(loaded, batch, context, count + 1)
    tags = list(builds)
    times: dict[str, list[float]] = {t: [] for t in tags}
    original = kernels.ops
    try:
        with torch.inference_mode():
            engine.step()  # the prompts' prefill
            while engine.has_work():
                tag = tags[sum(map(len, times.values())) % len(tags)]
                kernels.ops = partial(_same, builds[tag])  # type: ignore[assignment]
                start = time.perf_counter()
                engine.step()
                times[tag].append(time.perf_counter() - start)
    finally:
        kernels.ops = original  # type: ignore[method-assign]
    cells = [f"{t} {statistics.median(v) * 1000:.1f} ms" for t, v in times.items()]
    print(f"decode step, batch {batch}: " + ", ".join(cells))


def _same(module: ModuleType) -> ModuleType:
    return module


def _report(
    label: str,
    builds: dict[str, ModuleType],
    call: Callable[[ModuleType], torch.Tensor],
    repeats: int,
) -> None:
    outs = {t: call(m) for t, m in builds.items()}
    first = next(iter(outs.values()))
    times: dict[str, list[float]] = {t: [] for t in builds}
    for _ in range(repeats):
        for t, m in builds.items():
            start = time.perf_counter()
            call(m)
            times[t].append(time.perf_counter() - start)
    cells = [
        f"{t} {statistics.median(v) * 1000:.3f} ms"
        + ("" if torch.equal(outs[t], first) else " (other outputs)")
        for t, v in times.items()
    ]
    print(f"{label}: " + ", ".join(cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("builds", nargs="+", metavar="TAG=PATH", help="a build of the kernels")
    p.add_argument("--rows", default="1,16,64", help="comma-separated row counts of the calls")
    p.add_argument("--step", type=int, default=0, help="time decode steps at this batch instead")
    p.add_argument("--steps", type=int, default=40, help="--step: decode steps in all")
    p.add_argument("--context", type=int, default=256, help="--step: each sequence's prompt")
    args = p.parse_args()
    builds = {tag: load(tag, Path(path)) for tag, path in (a.split("=", 1) for a in args.builds)}
    if len({id(m) for m in builds.values()}) != len(builds):
        raise SystemExit("two tags loaded the same module")
    if args.step:
        steps(builds, args.step, args.steps, args.context)
    else:
        calls(builds, [int(r) for r in args.rows.split(",")])


if __name__ == "__main__":
    main()
