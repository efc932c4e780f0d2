"""What the browser tests share: Chromium's flags, opening the playground with a key, a
page's watch list (console errors, every URL it asked for) and a proxy that drops a
connection mid-stream."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field

from playwright.sync_api import Page, expect

API_KEY = "playground-test-key"
CHROMIUM = os.environ.get("INFER_CHROMIUM", "/usr/bin/chromium")
# As root Chromium needs --no-sandbox; the rest keep it from calling Google's services
# (refused here, and "no request leaves the server" is what the tests check).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def open_playground(page: Page, url: str) -> None:
    """Load the page as a user who entered the API key before (the page keeps it in the
    browser), and wait until it knows the model."""
    page.add_init_script(f"localStorage.setItem('infer.apiKey', {json.dumps(API_KEY)})")
    page.goto(url + "/")
    expect(page.locator("#model")).to_contain_text("tokens of context")


@dataclass
class Watched:
    """A page and what it did: console errors, and every URL it requested."""

    page: Page
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)

    def outside(self, origin: str) -> list[str]:
        """Requests that went anywhere but ``origin`` (``data:`` URLs stay in the page)."""
        return [u for u in self.requests if not (u.startswith(origin) or u.startswith("data:"))]


class DroppingProxy:
    """A TCP proxy to ``upstream`` that cuts the first ``/v1/generate`` response it carries
    once ``cut_after`` bytes of it have passed (both sides closed, as a dropped network
    would), and records the requests' first lines and ``Last-Event-ID`` headers.

    Before the cut it holds the stream for ``settle_s``: a fetch body that errors drops
    the chunks its reader has not taken yet, so without the pause the page might lose every
    event before the cut and (rightly) resume from the start, without ``Last-Event-ID``.
    """

    def __init__(self, upstream_port: int, cut_after: int, settle_s: float = 1.0) -> None:
        self.upstream_port = upstream_port
        self.cut_after = cut_after
        self.settle_s = settle_s
        self.cuts = 0
        self.heads: list[bytes] = []  # each request's head, as the client sent it
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            pair = _Pair(client, upstream)
            for target in (self._upward, self._downward):
                threading.Thread(target=target, args=(pair,), daemon=True).start()

    def _upward(self, pair: _Pair) -> None:
        while data := _recv(pair.client):
            if b"HTTP/1.1\r\n" in data:
                with self._lock:
                    self.heads.append(data.split(b"\r\n\r\n")[0])
                if data.startswith(b"POST /v1/generate "):
                    pair.generating, pair.passed = True, 0
            try:
                pair.upstream.sendall(data)
            except OSError:
                break
        pair.close()

    def _downward(self, pair: _Pair) -> None:
        while data := _recv(pair.upstream):
            try:
                pair.client.sendall(data)
            except OSError:
                break
            if pair.generating:
                pair.passed += len(data)
                with self._lock:
                    cut = self.cuts == 0 and pair.passed >= self.cut_after
                    self.cuts += cut
                if cut:
                    time.sleep(self.settle_s)  # the page reads what it has; nothing more comes
                    break
        pair.close()


@dataclass
class _Pair:
    client: socket.socket
    upstream: socket.socket
    generating: bool = False
    passed: int = 0

    def close(self) -> None:
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def _recv(s: socket.socket) -> bytes:
    try:
        return s.recv(65536)
    except OSError:
        return b""


@dataclass
class Server:
    url: str
