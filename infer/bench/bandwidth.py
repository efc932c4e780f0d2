"""How close one stream's decode comes to the memory bandwidth: the probe and the byte count.

A batch-1 decode step reads every weight once, so on a CPU it is bound by memory reads. The
probe (``bench/membw.cpp`` of the checkout, compiled here with g++ and OpenMP) reads a buffer
four times the last-level cache (at least 1 GiB) with the servers' thread count, with plain
loads and with software prefetching, and reports its best pass in GB/s. The bytes a step
reads are counted from the GGUF file the systems load, so infer and llama.cpp get the same
count; W1's bytes per token ÷ its ITL p50 is then a share of the probe.

A machine's memory can change speed for minutes at a time (a VM beside other tenants: this
project's Zen 5 VM reads 50 GB/s in some minutes and 75 in others), so a probe taken at the
start of a run says little about a W1 measured ten minutes later. The probe therefore also
runs just before and just after each W1 run it is compared with; the share is taken over the
mean of those two, and a run whose two readings differ by more than :data:`STEADY_SPREAD` is
marked: the memory changed speed while it ran.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from infer.models.gguf_file import GGUFFile

PROBE_SOURCE = Path(__file__).resolve().parents[2] / "bench" / "membw.cpp"
PROBE_PASSES = 5
MIN_PROBE_BYTES = 1 << 30
LLC_MULTIPLE = 4  # the buffer is this many times the last-level cache (at least 1 GiB)
STEADY_SPREAD = 0.10  # a W1 run's probes, before and after, may differ by this share
EMBEDDING = "token_embd.weight"
HEAD = "output.weight"


class ProbeError(Exception):
    """The probe could not run here (the message says why)."""


def decode_bytes(gguf: Path) -> int:
    """The bytes of ``gguf``'s tensors one decode step reads: every tensor (the layers, the
    final norm, the output head) but the token embedding table, of which one row is read;
    the whole table when it is tied and is the head too (no ``output.weight``)."""
    tensors = {t.name: t for t in GGUFFile(gguf).tensors}
    total = sum(t.data.nbytes for name, t in tensors.items() if name != EMBEDDING)
    embedding = tensors.get(EMBEDDING)
    if embedding is not None:
        data = embedding.data
        total += data.nbytes if HEAD not in tensors else data.nbytes // len(data)
    return total


def llc_bytes() -> int | None:
    """The size of cpu0's last-level data cache (sysfs), ``None`` where it is not told."""
    best: tuple[int, int] | None = None
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            size = _size((index / "size").read_text().strip())
        except (OSError, ValueError):
            continue
        if best is None or level > best[0]:
            best = (level, size)
    return best[1] if best else None


def _size(text: str) -> int:
    """``307200K`` → bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1:] in units else int(text)


def probe_bytes() -> int:
    """The probe's buffer: :data:`LLC_MULTIPLE` times the last-level cache, at least 1 GiB."""
    return max(MIN_PROBE_BYTES, LLC_MULTIPLE * (llc_bytes() or 0))


def cpu_model() -> str | None:
    """``Model name`` as lscpu says it (``None`` without lscpu)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.stdout.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Model name":
            return value.strip()
    return None


class Probe:
    """The probe, compiled once (on the first :meth:`run`) and run as often as asked, on
    ``threads`` threads over ``nbytes`` (whole MiB), ``passes`` passes of each kind.

    A context manager: leaving it removes the binary."""

    def __init__(self, threads: int, nbytes: int, passes: int = PROBE_PASSES) -> None:
        self.threads, self.mib, self.passes = threads, max(1, nbytes >> 20), passes
        self._dir: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None

    def run(self) -> dict[str, Any]:
        """One reading.

        Returns:
            ``gb_s`` (the best pass), ``plain_gb_s`` and ``prefetch_gb_s`` (the best of each
            kind), ``bytes``, ``threads``, ``passes`` (of each kind).

        Raises:
            ProbeError: No source (an install outside the checkout), no compiler, or it failed.
        """
        binary = self._binary()
        try:
            out = subprocess.run(
                [str(binary), str(self.mib), str(self.threads), str(self.passes)],
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            )
        except subprocess.CalledProcessError as e:
            raise ProbeError(f"membw failed: {e.stderr.strip()[-300:]}") from e
        except (OSError, subprocess.SubprocessError) as e:
            raise ProbeError(str(e)) from e
        result = json.loads(out.stdout)
        result.pop("check", None)
        return dict(result)

    def _binary(self) -> Path:
        if self._dir is not None:
            return Path(self._dir.name) / "membw"
        if not PROBE_SOURCE.is_file():
            raise ProbeError(f"no {PROBE_SOURCE} (the probe runs from a source checkout)")
        folder = tempfile.TemporaryDirectory(prefix="infer-membw-")
        binary = Path(folder.name) / "membw"
        compile_ = ["g++", "-O3", "-march=native", "-fopenmp", str(PROBE_SOURCE), "-o", str(binary)]
        try:
            subprocess.run(compile_, capture_output=True, text=True, timeout=120, check=True)
        except subprocess.CalledProcessError as e:
            folder.cleanup()
            raise ProbeError(f"g++ failed: {e.stderr.strip()[-300:]}") from e
        except (OSError, subprocess.SubprocessError) as e:
            folder.cleanup()
            raise ProbeError(str(e)) from e
        self._dir = folder
        return binary


def share(bytes_per_token: int, itl_p50_ms: float | None, probe_gb_s: float) -> dict[str, float]:
    """What a step reading ``bytes_per_token`` every ``itl_p50_ms`` moves: ``gb_s`` and
    ``of_probe`` (that over the probe's GB/s); empty without an ITL."""
    if not itl_p50_ms:
        return {}
    gb_s = bytes_per_token / (itl_p50_ms / 1000.0) / 1e9
    return {"gb_s": round(gb_s, 2), "of_probe": round(gb_s / probe_gb_s, 4)}


def measure(gguf: Path | None, probe: Probe) -> dict[str, Any]:
    """The report's ``meta.bandwidth``: the CPU (lscpu), its last-level cache, a first
    reading of ``probe`` (or ``probe_error``), and ``bytes_per_token`` of ``gguf`` (``None``
    without one)."""
    meta: dict[str, Any] = {
        "cpu": cpu_model(),
        "llc_bytes": llc_bytes(),
        "gguf": gguf.name if gguf else None,
        "bytes_per_token": decode_bytes(gguf) if gguf else None,
        "probe": None,
    }
    try:
        meta["probe"] = probe.run()
    except ProbeError as e:
        meta["probe_error"] = str(e)
    return meta


def bracket(probe: Probe | None, measure_run: Callable[[], Any]) -> tuple[Any, list[float]]:
    """``measure_run()`` between two readings of ``probe``: its result, and the two GB/s
    (none when there is no probe or it cannot run here)."""
    if probe is None:
        return measure_run(), []
    try:
        before = probe.run()["gb_s"]
    except ProbeError:
        return measure_run(), []
    result = measure_run()
    try:
        return result, [before, probe.run()["gb_s"]]
    except ProbeError:
        return result, []


def add_shares(
    runs: list[dict[str, Any]],
    meta: dict[str, Any],
    reads_gguf: Callable[[str], bool],
    speculated: Callable[[dict[str, Any]], bool],
) -> None:
    """Each W1 run of a system that ``reads_gguf``: its :func:`share` of the probe
    (``bandwidth``), when a probe ran and the byte count is there. The probe is the mean of
    the readings just before and after the run (``probes_gb_s``, with ``steady``: whether
    they agree within :data:`STEADY_SPREAD`), or the run's first reading where those are
    missing. A run that was ``speculated`` gets none (``{"drafted": True}``): its tokens
    came several a step, so its ITL is not a step's time (``infer-nospec`` gives infer's)."""
    first, per_token = meta.get("probe"), meta.get("bytes_per_token")
    if not per_token:
        return
    for run in runs:
        if run["workload"] != "W1" or not reads_gguf(run["system"]):
            continue
        if speculated(run):
            run["bandwidth"] = {"drafted": True}
            continue
        around = run.get("probes_gb_s") or []
        if around:
            reference = sum(around) / len(around)
            steady = max(around) <= min(around) * (1 + STEADY_SPREAD)
            extra: dict[str, Any] = {"probe_gb_s": round(reference, 2), "steady": steady}
        elif first:
            reference, extra = first["gb_s"], {"probe_gb_s": first["gb_s"]}
        else:
            continue
        itl = run["metrics"]["itl_ms"]["p50"]
        run["bandwidth"] = share(per_token, itl, reference) | extra
