"""A real ``infer serve`` (the default model, an API key and a CORS origin set; for the code
pane, Qwen2.5-Coder-0.5B with the key), a proxy in front of it that can drop a connection,
and headless Chromium from Debian driven by Playwright.

`make test` installs Debian's ``chromium`` and the ``playwright`` package (its driver only:
Playwright's own browser download cannot work offline); these tests do not skip without
them, they fail. Screenshots go to ``$INFER_SCREENSHOTS`` when it is set (the README's
come from there), else into each test's temporary folder.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, Playwright, sync_playwright

from infer.bench.servers import running_server
from infer.procs import free_port, serve_command
from support.browser import API_KEY, CHROMIUM, CHROMIUM_ARGS, DroppingProxy, Server, Watched

CODER = "qwen2.5-coder-0.5b"  # a model with fill-in-the-middle tokens (the default has none)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    cors = ("--cors-origin", "http://elsewhere.test")
    yield from _serve("default", *cors, "--resume-window-s", "30")


@pytest.fixture(scope="module")
def coder_server() -> Iterator[Server]:
    """A server of a model that fills in the middle, for the code pane."""
    yield from _serve(CODER)


def _serve(model: str, *extra: str) -> Iterator[Server]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--api-key", API_KEY, "--log-level", "warning", *extra]
    command = serve_command("127.0.0.1", port, model, "bfloat16", flags)
    with running_server(command, url, "/health"):
        yield Server(url)


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs Debian's chromium package")
    browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    yield browser
    browser.close()


@pytest.fixture
def watched(browser: Browser) -> Iterator[Watched]:
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    seen = Watched(page)

    def console(message: ConsoleMessage) -> None:
        if message.type == "error":
            seen.errors.append(f"{message.text} at {message.location}")

    page.on("console", console)
    page.on("pageerror", lambda error: seen.errors.append(f"uncaught: {error}"))
    page.on("request", lambda request: seen.requests.append(request.url))
    yield seen
    context.close()


@pytest.fixture
def screenshot(tmp_path: Path):  # type: ignore[no-untyped-def]
    """``screenshot(page, name[, full_page])``: a PNG of the page into ``$INFER_SCREENSHOTS``
    or the test's temporary folder."""
    folder = Path(os.environ.get("INFER_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)

    def take(page: Page, name: str, full_page: bool = True) -> Path:
        path = folder / f"{name}.png"
        page.screenshot(path=str(path), full_page=full_page)
        return path

    return take


@pytest.fixture
def dropping_proxy(server: Server) -> Iterator[DroppingProxy]:
    proxy = DroppingProxy(int(server.url.rsplit(":", 1)[1]), cut_after=4000)
    yield proxy
    proxy.close()
