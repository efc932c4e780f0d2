"""What starting ``infer serve`` as a child process takes: a free port and its command line
(``infer cluster`` starts its replicas so, and so does the benchmark)."""

from __future__ import annotations

import socket
import sys
from collections.abc import Sequence


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it; another process could take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def serve_command(
    host: str, port: int, model: str, dtype: str, extra: Sequence[str] = ()
) -> list[str]:
    """``infer serve`` in this interpreter on ``host:port``, with ``extra`` flags after."""
    return [
        sys.executable,
        "-m",
        "infer",
        "serve",
        "--host",
        host,
        "--port",
        str(port),
        "--model",
        model,
        "--dtype",
        dtype,
        *extra,
    ]
