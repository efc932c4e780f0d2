"""The playground's code pane in headless Chromium, against a real ``infer serve`` of
Qwen2.5-Coder-0.5B (a model with fill-in-the-middle tokens): ghost text while a person
types, the numbers of the last completion, Tab, and keystrokes that end the request before
them on the server.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
from playwright.sync_api import Page, Request, expect

from support.browser import API_KEY, Server, Watched, open_playground
from support.server import parse_metrics

CODE = (  # what the person pasted before typing on
    "import math\n\n\n"
    "def area(radius):\n"
    '    """The area of a circle."""\n'
    "    return math.pi * radius * radius\n\n\n"
)
MAX_TOKENS = 24


def open_code(page: Page, url: str, max_tokens: int = MAX_TOKENS) -> None:
    """The code pane with ``CODE`` in the editor and the caret at its end. No time budget:
    a completion's length does not depend on how busy the machine is."""
    open_playground(page, url)
    page.check("#mode-code")
    page.fill("#code-max-tokens", str(max_tokens))
    page.fill("#code-budget", "0")
    page.fill("#code-editor", CODE)
    page.click("#code-editor")
    page.keyboard.press("Control+End")


def split(text: str, caret: int) -> dict[str, Any]:
    """The text fields llama.vim sends for the caret at ``caret`` (written from its source)."""
    lines_before = text[:caret].split("\n")
    lines_after = text[caret:].split("\n")
    line_prefix, line_suffix = lines_before[-1], lines_after[0]
    return {
        "input_prefix": "".join(line + "\n" for line in lines_before[:-1]),
        "prompt": line_prefix if line_prefix.strip() else "",
        "input_suffix": line_suffix + "\n" + "\n".join(lines_after[1:]),
        "n_indent": len(line_prefix) - len(line_prefix.lstrip()),
    }


def editor(page: Page) -> tuple[str, int]:
    """The editor's text and caret."""
    value, caret = page.eval_on_selector("#code-editor", "e => [e.value, e.selectionStart]")
    return value, caret


def ghost(page: Page) -> str:
    shown = page.locator("#code-mirror .ghost")
    return shown.text_content() or "" if shown.count() else ""


def numbers(page: Page) -> dict[str, int]:
    """The last completion's numbers: latency (ms), cached, read and generated tokens."""
    data = page.eval_on_selector("#code-numbers", "e => ({...e.dataset})")
    return {name: int(value) for name, value in data.items()}


def wait_state(page: Page, state: str) -> None:
    expect(page.locator("#code")).to_have_attribute("data-state", state, timeout=120_000)


def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(server.url + path, json=body, headers=headers, timeout=120)
    assert response.status_code == 200, response.text
    return dict(response.json())


def get(server: Server, path: str) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.get(server.url + path, headers=headers, timeout=60)


def sent(page: Page) -> list[Request]:
    """The page's ``/infill`` requests, as it sends them."""
    requests: list[Request] = []
    page.on("request", lambda r: requests.append(r) if r.url.endswith("/infill") else None)
    return requests


def test_ghost_text_is_the_servers_completion_and_tab_accepts_it(
    coder_server: Server, watched: Watched, screenshot
) -> None:
    page = watched.page
    open_code(page, coder_server.url)
    requests = sent(page)
    page.keyboard.type("def perimeter(radius", delay=40)
    wait_state(page, "shown")
    text, caret = editor(page)
    assert text == CODE + "def perimeter(radius" and caret == len(text)
    # The page asked with llama.vim's split and greedy sampling; the same body through the
    # API gives what the page shows (the API adds no special text: the model's own).
    body = requests[-1].post_data_json
    assert body == {
        **split(text, caret),
        "n_predict": MAX_TOKENS,
        "t_max_predict_ms": -1,
        "temperature": 0,
        "cache_prompt": True,
    }
    answer = post(coder_server, "/infill", body)
    first = ghost(page)
    assert first and first == answer["content"].rstrip()
    assert "<|" not in first
    shown = numbers(page)
    assert shown["latency"] > 0 and shown["read"] > 0
    assert shown["generated"] == answer["timings"]["predicted_n"]
    assert f"cached {shown['cached']}" in page.locator("#code-numbers").inner_text()
    # The next character of the ghost text, typed, keeps the rest of it until the next
    # completion arrives; that one reads only the end of the prompt again.
    assert first.startswith(")"), first
    page.keyboard.type(")")
    kept = page.evaluate(
        "() => [document.getElementById('code').dataset.state,"
        " document.querySelector('#code-mirror .ghost')?.textContent]"
    )
    if kept[0] in ("pending", "waiting"):  # (the machine may have been slower than the page)
        assert kept[1] == first[1:]
    wait_state(page, "shown")
    later = numbers(page)
    assert later["cached"] > 0
    page.set_viewport_size({"width": 1200, "height": 460})  # the pane, without the page below
    screenshot(page, "playground-code")
    # Tab puts the ghost text into the editor, the caret after it.
    text, caret = editor(page)
    second = ghost(page)
    page.keyboard.press("Tab")
    assert editor(page) == (text[:caret] + second + text[caret:], caret + len(second))
    assert second in page.locator("#code-mirror").text_content()
    # Escape dismisses the next one before it is shown.
    page.keyboard.press("Escape")
    expect(page.locator("#code-mirror .ghost")).to_have_count(0)
    assert page.locator("#code").get_attribute("data-state") == "idle"
    assert watched.errors == []
    assert watched.outside(coder_server.url) == []


def test_a_completion_inside_brackets_takes_the_place_of_the_closing_ones(
    coder_server: Server, watched: Watched
) -> None:
    """Typed inside ``print(area())``: the completion writes the ``))`` already there again
    (and a comment after it), and takes their place rather than repeating them."""
    page = watched.page
    open_code(page, coder_server.url)
    page.keyboard.type("print(area())")
    for _ in "))":
        page.keyboard.press("ArrowLeft")
    page.keyboard.type("2", delay=40)
    wait_state(page, "shown")
    text, caret = editor(page)
    completion = ghost(page)
    assert text[caret:] == "))" and completion.startswith("))  #"), completion
    assert page.locator("#code-mirror").text_content().startswith(text[:caret] + completion + "\n")
    page.keyboard.press("Tab")
    assert editor(page) == (text[:caret] + completion, caret + len(completion))


def test_each_keystroke_ends_the_request_before_it_on_the_server(
    coder_server: Server, watched: Watched
) -> None:
    page = watched.page
    # Long completions: one the server did not end would still be running.
    open_code(page, coder_server.url, max_tokens=400)
    page.keyboard.press("Escape")  # (the pasted code's completion, if it was asked for)
    wait_running(coder_server, 0)
    requests = sent(page)
    before = ended(coder_server)
    # A burst faster than the pause that asks: one request once it ends, not one a key.
    burst = "def circumference("
    page.keyboard.type(burst, delay=30)
    wait_state(page, "waiting")
    assert 1 <= len(typed(requests)) < len(burst)
    # Then each keystroke lands while a completion runs on the server, and ends it.
    for char in "radius):":
        wait_running(coder_server, 1)
        page.keyboard.type(char)
        wait_state(page, "waiting")
    wait_running(coder_server, 1)
    page.keyboard.press("Escape")  # the last one ends too
    wait_running(coder_server, 0)
    # The page ended every one (one a keystroke, at least, and the burst's).
    deadline = time.monotonic() + 60
    while len(mine := typed(requests)) <= len("radius):") or any(r.failure is None for r in mine):
        outcomes = [(r.post_data_json["prompt"], r.failure) for r in mine]
        assert time.monotonic() < deadline, f"the page did not end every request: {outcomes}"
        page.wait_for_timeout(50)
    assert {r.failure for r in mine} == {"net::ERR_ABORTED"}
    # Every request that reached the engine ended there as aborted: none ran on to its end.
    after = ended(coder_server)
    finished = {reason: after[reason] - before.get(reason, 0) for reason in after}
    assert finished["abort"] >= 1 and sum(finished.values()) == finished["abort"], finished
    assert ghost(page) == ""


def typed(requests: list[Request]) -> list[Request]:
    """The requests for the function being typed (not one for the pasted code)."""
    return [r for r in requests if r.post_data_json["prompt"].startswith("def circumference")]


def ended(server: Server) -> dict[str, float]:
    """``infer_requests_total`` by finish reason."""
    metrics = parse_metrics(get(server, "/metrics").text)
    prefix = 'infer_requests_total{finish_reason="'
    return {k[len(prefix) : -2]: v for k, v in metrics.items() if k.startswith(prefix)}


def wait_running(server: Server, running: int) -> None:
    """Until ``/health`` says ``running`` requests run (and none waits)."""
    deadline = time.monotonic() + 60
    while True:
        health = httpx.get(server.url + "/health", timeout=60).json()
        if health["running"] == running and health["waiting"] == 0:
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.02)
