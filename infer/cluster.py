"""``infer cluster``: local replicas of ``infer serve`` behind SGLang Model Gateway.

The command starts N replicas (each ``infer serve`` on its own free port, same model, same
serve flags), waits until every one answers ``GET /health`` with 200, then starts the
gateway (``sglang-router launch``) in front of them, or in front of ``--worker-url``
replicas that run elsewhere, and waits for it too. It prints one line per piece, then
watches them: SIGINT or SIGTERM stops everything (SIGTERM to each, which makes a replica
drain its open streams; SIGKILL for whatever is left after the stop timeout), and so does
a piece that exits on its own, with exit status 1 and a line saying which.

Every child runs in its own session, so a Ctrl-C in the terminal reaches this process
only, and the stop order is this module's to choose.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import FrameType

import httpx

from infer.procs import free_port, serve_command

GATEWAY_BINARY = "sglang-router"
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "manual")
STARTUP_TIMEOUT_S = 300.0  # model load on a busy machine
STOP_TIMEOUT_S = 30.0
POLL_S = 0.25
EXIT_FAILED = 1


class ClusterError(Exception):
    """The cluster cannot start or a piece of it failed (the message says which)."""


@dataclass
class Piece:
    """One process of the cluster: a replica or the gateway."""

    name: str
    url: str
    process: subprocess.Popen[bytes]
    ready_path: str


def gateway_binary() -> Path:
    """``sglang-router`` next to this Python (its virtual environment), else on ``PATH``.

    Raises:
        ClusterError: It is not installed.
    """
    beside = Path(sys.executable).with_name(GATEWAY_BINARY)
    if beside.is_file():
        return beside
    found = shutil.which(GATEWAY_BINARY)
    if found:
        return Path(found)
    raise ClusterError(
        f"{GATEWAY_BINARY} (SGLang Model Gateway) is not installed; "
        "install it with: pip install 'infer[cluster]'"
    )


def url_of(host: str, port: int) -> str:
    """``http://host:port``, with brackets around an IPv6 address; ``0.0.0.0`` and ``::``
    (every interface) are reached on loopback."""
    reach = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{reach}]:{port}" if ":" in reach else f"http://{reach}:{port}"


def gateway_command(
    binary: Path,
    host: str,
    port: int,
    worker_urls: Sequence[str],
    policy: str,
    metrics_port: int,
    gateway_args: Sequence[str] = (),
) -> list[str]:
    """``sglang-router launch`` on ``host:port`` in front of ``worker_urls``."""
    return [
        str(binary),
        "launch",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *worker_urls,
        "--policy",
        policy,
        "--prometheus-port",
        str(metrics_port),
        *gateway_args,
    ]


class Cluster:
    """The running pieces, started in order and stopped together.

    Args:
        out: Where the address lines go (stdout); logs of the pieces go to stderr.
        stop_timeout_s: How long the pieces get to exit after SIGTERM before SIGKILL.
    """

    def __init__(self, out: Callable[[str], None], stop_timeout_s: float = STOP_TIMEOUT_S):
        self.pieces: list[Piece] = []
        self.out = out
        self.stop_timeout_s = stop_timeout_s
        self.signalled: int | None = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        """SIGINT/SIGTERM handler: ask the watch loop to stop."""
        self.signalled = signum

    def start(self, name: str, command: list[str], url: str, ready_path: str) -> Piece:
        """Start ``command`` in its own session, its output on this process's stderr."""
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=sys.stderr.fileno(),
            stderr=sys.stderr.fileno(),
            start_new_session=True,
        )
        piece = Piece(name, url, process, ready_path)
        self.pieces.append(piece)
        return piece

    def wait_ready(self, pieces: Sequence[Piece], timeout_s: float) -> bool:
        """Wait until every piece answers 200 at its ready path.

        Returns:
            Whether they did; false when a signal came first.

        Raises:
            ClusterError: A piece exited, or was not ready within ``timeout_s``.
        """
        waiting = list(pieces)
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=5.0) as client:
            while waiting:
                if self.signalled is not None:
                    return False
                self.check_alive()
                for piece in list(waiting):
                    try:
                        response = client.get(piece.url + piece.ready_path)
                    except httpx.HTTPError:
                        continue
                    if response.status_code == 200:
                        waiting.remove(piece)
                if time.monotonic() > deadline:
                    names = ", ".join(p.name for p in waiting)
                    raise ClusterError(f"{names} not ready after {timeout_s:.0f} s")
                if waiting:
                    time.sleep(POLL_S)
        return True

    def check_alive(self) -> None:
        """Raise :class:`ClusterError` naming the first piece that has exited."""
        for piece in self.pieces:
            code = piece.process.poll()
            if code is not None:
                raise ClusterError(
                    f"{piece.name} ({piece.url}, pid {piece.process.pid}) exited "
                    f"unexpectedly with status {code}"
                )

    def watch(self) -> None:
        """Return at the first signal; raise :class:`ClusterError` when a piece exits."""
        while self.signalled is None:
            self.check_alive()
            time.sleep(POLL_S)

    def stop(self) -> None:
        """SIGTERM every piece (the gateway first), wait, then SIGKILL what is left."""
        for piece in reversed(self.pieces):  # the gateway was started last
            if piece.process.poll() is None:
                piece.process.terminate()
        deadline = time.monotonic() + self.stop_timeout_s
        for piece in self.pieces:
            try:
                piece.process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(
                    f"infer cluster: {piece.name} (pid {piece.process.pid}) did not stop in "
                    f"{self.stop_timeout_s:.0f} s; killing it",
                    file=sys.stderr,
                    flush=True,
                )
                piece.process.kill()
                piece.process.wait()
            # Whatever a piece started itself goes with it.
            try:
                os.killpg(piece.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@dataclass(frozen=True)
class ClusterSpec:
    """What ``infer cluster`` runs.

    Args:
        replicas: Local replicas to start (ignored when ``worker_urls`` is given).
        worker_urls: Replicas running elsewhere; when given, only the gateway starts.
        model: The model every local replica serves.
        dtype: Its dtype.
        serve_args: Further ``infer serve`` flags for every local replica.
        replica_host: The address local replicas bind.
        host: The gateway's address.
        port: The gateway's port.
        policy: The gateway's routing policy.
        metrics_port: The gateway's Prometheus port.
        gateway_args: Further ``sglang-router launch`` flags.
        startup_timeout_s: Longest wait for the replicas, then for the gateway.
        stop_timeout_s: Longest wait for the pieces to exit after SIGTERM.
    """

    replicas: int
    worker_urls: Sequence[str]
    model: str
    dtype: str
    serve_args: Sequence[str]
    replica_host: str
    host: str
    port: int
    policy: str
    metrics_port: int
    gateway_args: Sequence[str] = ()
    startup_timeout_s: float = STARTUP_TIMEOUT_S
    stop_timeout_s: float = STOP_TIMEOUT_S


def run_cluster(spec: ClusterSpec) -> int:
    """Run the cluster until SIGINT/SIGTERM or until a piece exits.

    Returns:
        0 after a signal stopped it cleanly, 1 when a piece failed (a line on stderr says
        which).

    Raises:
        ClusterError: The gateway is not installed.
    """
    binary = gateway_binary()
    if not spec.worker_urls and spec.replicas < 1:
        raise ValueError("--replicas must be at least 1")
    cluster = Cluster(_say, spec.stop_timeout_s)
    with _stopped_at_exit(cluster):
        try:
            urls = list(spec.worker_urls)
            local: list[Piece] = []
            if not urls:
                serve = partial(
                    serve_command, model=spec.model, dtype=spec.dtype, extra=spec.serve_args
                )
                local = start_replicas(cluster, spec.replicas, spec.replica_host, serve)
                urls = [piece.url for piece in local]
            if cluster.wait_ready(local, spec.startup_timeout_s):
                for piece in local:
                    _say(f"{piece.name}: {piece.url} (pid {piece.process.pid})")
                _run_gateway(cluster, binary, spec, urls)
            if cluster.signalled is not None:
                name = signal.Signals(cluster.signalled).name
                print(f"infer cluster: {name}: stopping", file=sys.stderr, flush=True)
            return 0
        except ClusterError as e:
            print(f"infer cluster: error: {e}; stopping the rest", file=sys.stderr, flush=True)
            return EXIT_FAILED


def _run_gateway(cluster: Cluster, binary: Path, spec: ClusterSpec, urls: list[str]) -> None:
    """Start the gateway in front of ``urls``; once it is ready, watch every piece."""
    url = url_of(spec.host, spec.port)
    command = gateway_command(
        binary, spec.host, spec.port, urls, spec.policy, spec.metrics_port, spec.gateway_args
    )
    gateway = cluster.start("gateway", command, url, "/readiness")
    if cluster.wait_ready([gateway], spec.startup_timeout_s):
        replicas = f"{len(urls)} replicas: {' '.join(urls)}"
        _say(f"gateway: {url} (pid {gateway.process.pid}, policy {spec.policy}, {replicas})")
        cluster.watch()


@contextmanager
def _stopped_at_exit(cluster: Cluster) -> Iterator[None]:
    """SIGINT and SIGTERM stop ``cluster``'s watch while the block runs; every piece is
    stopped when it ends."""
    previous = {
        signum: signal.signal(signum, cluster.on_signal)
        for signum in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        cluster.stop()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def start_replicas(
    cluster: Cluster, count: int, host: str, command: Callable[[str, int], list[str]]
) -> list[Piece]:
    """Start ``count`` replicas on free ports of ``host``; ``command(host, port)`` runs one."""
    bind = host if ":" not in host else "127.0.0.1"
    pieces = []
    for i in range(count):
        port = free_port(bind)
        url = url_of(host, port)
        pieces.append(cluster.start(f"replica {i + 1}", command(host, port), url, "/health"))
    return pieces


def _say(line: str) -> None:
    print(line, flush=True)
