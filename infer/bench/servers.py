"""Servers under test, each started as a subprocess on a free loopback port.

The server runs in its own process so that the load generator's parsing does not share a
Python interpreter (and its GIL) with the engine thread: the same split a real client has.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO

import httpx

STARTUP_TIMEOUT_S = 300.0  # model load on a busy 2-core machine
STOP_TIMEOUT_S = 30.0


class ServerError(Exception):
    """A server did not start (the message ends with the tail of its log)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it; another process could take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def infer_command(
    port: int, mode: str, model: str, dtype: str, extra: Sequence[str] = ()
) -> list[str]:
    """``infer serve`` in this interpreter, on 127.0.0.1:``port``, in batching ``mode``."""
    return [
        sys.executable, "-m", "infer", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--model", model, "--dtype", dtype, "--batching-mode", mode, "--log-level", "warning",
        *extra,
    ]


def llama_cpp_python() -> str | None:
    """A Python that can import ``llama_cpp.server``: ``$INFER_BENCH_LLAMA_CPP_PYTHON``, else
    this one when it has the package, else ``None``."""
    configured = os.environ.get("INFER_BENCH_LLAMA_CPP_PYTHON")
    if configured:
        return configured
    if importlib.util.find_spec("llama_cpp") is not None:
        return sys.executable
    return None


def llama_cpp_command(python: str, port: int, gguf: Path, threads: int, ctx: int) -> list[str]:
    """llama-cpp-python's OpenAI-compatible server on ``gguf``.

    ``--interrupt_requests False`` makes a new request wait for the running one instead of
    cutting it off (its default), so concurrent streams all finish.
    """
    return [
        python, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
        "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
        "--n_ctx", str(ctx), "--interrupt_requests", "False", "--verbose", "False",
    ]


@contextlib.contextmanager
def running_server(command: list[str], url: str, ready_path: str) -> Iterator[str]:
    """Start ``command``, wait until ``GET url+ready_path`` answers 200, yield ``url``, stop it.

    Raises:
        ServerError: The process exited or was not ready within :data:`STARTUP_TIMEOUT_S`.
    """
    with tempfile.TemporaryFile("w+b") as log:
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            _wait_ready(process, url + ready_path, log)
            yield url
        finally:
            _stop(process)


def _wait_ready(process: subprocess.Popen[bytes], url: str, log: IO[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerError(f"exited with status {process.returncode}: {_tail(log)}")
        try:
            if httpx.get(url, timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServerError(f"not ready after {STARTUP_TIMEOUT_S:.0f} s: {_tail(log)}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()  # SIGTERM: the server drains its streams and exits
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _tail(log: IO[bytes], lines: int = 15) -> str:
    log.flush()
    log.seek(0)
    text = log.read().decode(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:]) or "(no output)"
