"""The playground and ``/docs`` in headless Chromium, against a real ``infer serve``.

Each test works the page as a person would (typing, clicking, hovering) and checks what
the page shows against what the server says.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
from playwright.sync_api import Page, expect

from support.browser import API_KEY, DroppingProxy, Server, Watched, open_playground
from support.server import parse_metrics

LONG_PROMPT = (  # three blocks of the prefix cache and more
    "The painter mixed her colours on a wooden palette by the window. She had red, yellow "
    "and blue, and from those three she could make every other colour she needed for the "
    "sea, the sky and the fields. The three primary colours are"
)


def call(server: Server, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    """The API, with the key (a GET without a body)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if body is None:
        response = httpx.get(server.url + path, headers=headers, timeout=60)
    else:
        response = httpx.post(server.url + path, json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def configure(page: Page, **fields: str) -> None:
    """Set the settings named (``trace_layer`` is a choice, the rest are fields)."""
    for name, value in fields.items():
        if name == "trace_layer":
            page.select_option(f"#{name}", value)
        else:
            page.fill(f"#{name}", value)


def send(page: Page, text: str) -> None:
    page.fill("#input", text)
    page.click("#send")


def complete(page: Page, url: str, prompt: str, columns: int = 1, **fields: str) -> None:
    """Open the page in completion mode, set ``fields``, send ``prompt``, wait for the end."""
    open_playground(page, url)
    page.check("#mode-completion")
    configure(page, **fields)
    send(page, prompt)
    wait_done(page, columns)


def wait_done(page: Page, columns: int = 1) -> None:
    """Wait until ``columns`` columns exist and none is streaming."""
    expect(page.locator(".column")).to_have_count(columns)
    expect(page.locator(".column[data-status=running]")).to_have_count(0)


def numbers(page: Page, column: int = 0) -> str:
    """A column's line of numbers (TTFT, tok/s, prompt/cached/generated, finish)."""
    return page.locator(".column .numbers").nth(column).inner_text()


def count(page: Page, name: str, column: int = 0) -> int:
    """One count from a column's numbers: ``prompt``, ``cached`` or ``generated``."""
    found = re.search(rf"\b{name} (\d+)", numbers(page, column))
    assert found, numbers(page, column)
    return int(found.group(1))


def test_page_loads_with_no_console_error_and_no_request_leaving_the_server(
    server: Server, watched: Watched, screenshot
) -> None:
    page = watched.page
    open_playground(page, server.url)
    expect(page.locator("#server-stats")).to_contain_text("KV blocks")
    assert page.locator("#trace_layer option").count() == 31  # "off" and 30 layers
    assert watched.errors == []
    assert watched.outside(server.url) == []
    # The API answers the page because it sends the key; without it the API is closed.
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/playground/app.js").status_code == 200
    fresh = page.context.browser.new_page()  # its own context: no key stored
    fresh.goto(server.url + "/")
    expect(fresh.locator("#model")).to_contain_text("an API key is needed")
    fresh.fill("#api-key", API_KEY)
    fresh.dispatch_event("#api-key", "change")
    expect(fresh.locator("#model")).to_contain_text("tokens of context")
    fresh.context.close()


def test_a_chat_streams_tokens_into_the_strip_and_hovering_shows_the_top_k(
    server: Server, watched: Watched, screenshot
) -> None:
    page = watched.page
    open_playground(page, server.url)
    configure(page, temperature="0", max_tokens="24", trace_k="4")
    send(page, "What is the capital of France?")
    wait_done(page)
    chips = page.locator(".column .chip")
    assert chips.count() == count(page, "generated") > 0
    assert "Paris" in page.locator(".column .strip").inner_text()
    assert page.locator("#history .turn.user").inner_text() == "What is the capital of France?"
    # Coloured by probability: every chip carries its own token's probability.
    probs = [float(p) for p in chips.evaluate_all("cs => cs.map(c => c.dataset.prob)")]
    assert all(0 < p <= 1 for p in probs)
    chips.nth(0).hover()
    popover = page.locator("#popover")
    expect(popover).to_be_visible()
    expect(popover.locator(".alt")).to_have_count(4)
    # Greedy: the generated token is the likeliest one, marked in the list.
    assert popover.locator(".alt").nth(0).get_attribute("class") == "alt chosen"
    prompt = page.locator("#rendered-prompt").text_content()
    assert "What is the capital of France?" in prompt and "<|im_start|>" in prompt, prompt
    request = json.loads(page.locator("#raw-request").text_content())
    assert request["messages"][-1] == {"role": "user", "content": "What is the capital of France?"}
    assert request["trace"]["top_k"] == 4
    page.click("#request-details summary")
    page.click("#copy-curl")
    expect(page.locator("#curl")).to_contain_text("curl -N " + server.url + "/v1/generate")
    chips.nth(0).hover()
    screenshot(page, "playground-chat")


def test_tokens_from_kept_drafts_are_marked_with_the_tokens_per_step(
    server: Server, watched: Watched
) -> None:
    """A prompt whose continuation repeats it: speculative decoding drafts from the prompt,
    and the page marks the tokens the model agreed with."""
    page = watched.page
    counting = ", ".join(str(i % 10) for i in range(40)) + ","
    complete(page, server.url, counting, temperature="0", max_tokens="40")
    drafted = page.locator(".column .chip.drafted")
    assert 0 < drafted.count() < count(page, "generated")
    found = re.search(r"drafted (\d+) · ([\d.]+) tokens/step", numbers(page))
    assert found, numbers(page)
    assert int(found.group(1)) == drafted.count() and float(found.group(2)) > 1
    assert "drafted" in (drafted.first.get_attribute("title") or "")


def test_a_kept_reply_joins_the_conversation_before_the_next_message(
    server: Server, watched: Watched
) -> None:
    page = watched.page
    open_playground(page, server.url)
    configure(page, temperature="0", max_tokens="12", n="2")
    send(page, "Name a colour.")
    wait_done(page, columns=2)
    page.locator(".column .keep").nth(1).click()
    expect(page.locator(".column.kept")).to_have_count(1)
    kept = page.evaluate("() => window.__playground.columnText(1)")
    configure(page, n="1")
    send(page, "And another one?")
    wait_done(page)
    turns = page.locator("#history .turn")
    assert turns.all_inner_texts() == ["Name a colour.", kept.strip(), "And another one?"]
    request = json.loads(page.locator("#raw-request").text_content())
    assert [m["role"] for m in request["messages"]] == ["user", "assistant", "user"]
    assert request["messages"][1]["content"] == kept
    assert kept in page.locator("#rendered-prompt").text_content()


def test_clicking_an_alternative_branches_from_that_token(
    server: Server, watched: Watched, screenshot
) -> None:
    page = watched.page
    complete(page, server.url, LONG_PROMPT, temperature="0", max_tokens="16", trace_k="5")
    chip = page.locator(".column .chip").nth(2)
    chip.click()
    alternative = page.locator("#popover .alt:not(.chosen)").nth(0)
    alt_text = json.loads(alternative.locator(".alt-text").inner_text())
    alternative.click()
    wait_done(page, columns=2)
    branch = page.locator(".column").nth(1)
    expect(branch.locator(".column-head")).to_contain_text("branch of reply at token 3")
    forced = branch.locator(".chip.forced")
    expect(forced).to_have_count(1)
    assert branch.locator(".chip").nth(2).get_attribute("class").split()[1:] == [
        "inherited",
        "forced",
    ]
    assert forced.inner_text() == (alt_text or "·").replace("\n", "↵\n")
    assert branch.locator(".chip:not(.inherited)").count() > 0
    # Its prompt is the original prompt and the three tokens up to the alternative, and the
    # prefix cache served most of it.
    assert count(page, "prompt", 1) == count(page, "prompt", 0) + 3
    assert count(page, "cached", 1) > 0
    screenshot(page, "playground-branch")


def test_the_attention_view_draws_for_a_chosen_token(
    server: Server, watched: Watched, screenshot
) -> None:
    page = watched.page
    complete(page, server.url, LONG_PROMPT, temperature="0", max_tokens="8", trace_layer="3")
    prompt_tokens = count(page, "prompt")
    page.locator(".column .chip").nth(4).click()
    page.select_option("#attn-layer", "3")
    page.select_option("#attn-head", "1")
    expect(page.locator("#attention-source")).to_have_text("from the stream's trace")
    keys = page.locator("#heat .key")
    expect(keys).to_have_count(prompt_tokens + 4)
    traced = [float(w) for w in keys.evaluate_all("ks => ks.map(k => k.dataset.weight)")]
    assert abs(sum(traced) - 1) < 0.02
    # Another layer is not in the trace: the page asks /v1/inspect/attention instead.
    page.select_option("#attn-layer", "0")
    expect(page.locator("#attention-source")).to_have_text("from /v1/inspect/attention")
    expect(keys).to_have_count(prompt_tokens + 4)
    # The inspection route gives the row the trace gave at the traced layer.
    ids = [int(x) for x in _prompt_and_tokens(page, 4)]
    inspected = call(server, "/v1/inspect/attention", {"prompt": ids, "layer": 3, "head": 1})
    inspected = inspected["attn"][-1]
    # (bf16: the decode step's kernels and the inspection's forward round differently.)
    assert max(abs(a - b) for a, b in zip(traced, inspected, strict=True)) < 0.1
    assert traced.index(max(traced)) == inspected.index(max(inspected))
    page.select_option("#attn-layer", "3")
    expect(page.locator("#attention-source")).to_have_text("from the stream's trace")
    page.keyboard.press("Escape")
    expect(page.locator("#popover")).to_be_hidden()
    screenshot(page, "playground-attention")
    page.click("#prompt-attention")
    expect(page.locator("#matrix")).to_be_visible()
    expect(page.locator("#matrix-label")).to_contain_text(f"{prompt_tokens} × {prompt_tokens}")


def _prompt_and_tokens(page: Page, before: int) -> list[int]:
    """The token ids the selected column's token ``before`` attended to."""
    return list(page.evaluate("(before) => window.__playground.idsBefore(0, before)", before))


def test_n_3_shows_three_columns_and_marks_where_they_diverge(
    server: Server, watched: Watched, screenshot
) -> None:
    page = watched.page
    prompt = "My favourite food is"
    complete(page, server.url, prompt, 3, temperature="1.2", max_tokens="12", n="3", seed="7")
    columns = page.locator(".column")
    heads = [columns.nth(i).locator(".column-head strong").inner_text() for i in range(3)]
    assert heads == ["sample 1 (seed 7)", "sample 2 (seed 8)", "sample 3 (seed 9)"]
    ids = page.evaluate("() => window.__playground.columnIds()")
    assert len({tuple(x) for x in ids}) > 1, ids  # three samples at 1.2: not all the same
    first = next(i for i in range(min(map(len, ids))) if len({x[i] for x in ids}) > 1)
    for i in range(3):
        marked = columns.nth(i).locator(".chip.diverge")
        expect(marked).to_have_count(1)
        assert marked.get_attribute("data-index") == str(first)
    screenshot(page, "playground-samples")


def test_structured_output_is_checked_against_the_schema(server: Server, watched: Watched) -> None:
    page = watched.page
    open_playground(page, server.url)
    page.check("#schema-enabled")
    configure(page, temperature="0.7", max_tokens="120", seed="3")
    send(page, "Describe a person as JSON.")
    wait_done(page)
    check = page.locator(".column .schema-check")
    expect(check).to_have_attribute("data-valid", "true")
    person = json.loads(page.evaluate("() => window.__playground.columnText(0)"))
    assert set(person) == {"name", "age"} and isinstance(person["age"], int)


def test_a_stream_cut_by_the_network_resumes_where_it_stopped(
    server: Server, watched: Watched, dropping_proxy: DroppingProxy
) -> None:
    page = watched.page
    prompt = "Here is a long story about a dragon:"
    complete(page, dropping_proxy.url, prompt, temperature="0", max_tokens="48")
    assert dropping_proxy.cuts == 1
    resumed = [h for h in dropping_proxy.heads if b"last-event-id:" in h.lower()]
    assert len(resumed) == 1, [h.split(b"\r\n")[0] for h in dropping_proxy.heads] + [numbers(page)]
    stats = numbers(page)
    assert "resumed ×1" in stats and "finish:" in stats
    generated = count(page, "generated")
    # Every token once, in order: what the page shows equals one uninterrupted run.
    ids = page.evaluate("() => window.__playground.columnIds()")[0]
    assert len(ids) == generated == page.locator(".column .chip").count()
    model = call(server, "/v1/models")["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 48, "temperature": 0}
    again = call(server, "/v1/completions", body)
    assert page.evaluate("() => window.__playground.columnText(0)") == again["choices"][0]["text"]


def test_stop_ends_the_streams_and_frees_the_server(server: Server, watched: Watched) -> None:
    page = watched.page
    open_playground(page, server.url)
    page.check("#mode-completion")
    configure(page, temperature="1", max_tokens="1500", n="2", seed="5")
    send(page, "Write a very long essay about the sea.")
    expect(page.locator(".column .chip").nth(3)).to_be_visible()
    page.click("#stop-all")
    wait_done(page, columns=2)
    for i in range(2):
        assert "finish: stopped" in numbers(page, i)
    # The server stopped generating them (a resumable stream would otherwise run on).
    deadline = time.monotonic() + 30
    while call_metrics(server)["infer_requests_running"] != 0:
        assert time.monotonic() < deadline, "the stopped requests still run"
        time.sleep(0.1)


def call_metrics(server: Server) -> dict[str, float]:
    text = httpx.get(
        server.url + "/metrics", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60
    ).text
    return parse_metrics(text)


def test_a_refused_request_shows_the_servers_error_code(server: Server, watched: Watched) -> None:
    page = watched.page
    complete(page, server.url, "Hello", max_tokens="9000")  # over the 8192-token context
    assert page.locator(".column").get_attribute("data-status") == "error"
    assert "finish: context_length_exceeded" in numbers(page)


def test_the_code_pane_says_when_the_model_does_not_fill_in_the_middle(
    server: Server, watched: Watched
) -> None:
    page = watched.page
    open_playground(page, server.url)
    page.check("#mode-code")
    page.click("#code-editor")
    page.keyboard.type("def add(a, b):", delay=20)
    expect(page.locator("#code")).to_have_attribute("data-state", "error")
    status = page.locator("#code-status")
    expect(status).to_contain_text("does not fill in the middle")
    assert call(server, "/v1/models")["data"][0]["id"] in status.inner_text()
    assert page.locator("#code-mirror .ghost").count() == 0
    # Without a completion Tab indents to the next tab stop; after Escape it leaves.
    page.keyboard.press("Enter")
    page.keyboard.press("Tab")
    page.keyboard.type("return a + b")
    assert page.locator("#code-editor").input_value() == "def add(a, b):\n    return a + b"
    page.keyboard.press("Escape")
    page.keyboard.press("Tab")
    assert page.evaluate("() => document.activeElement.id") != "code-editor"


def test_docs_render_the_operations_offline(server: Server, watched: Watched, screenshot) -> None:
    page = watched.page
    page.goto(server.url + "/docs")
    operations = page.locator(".opblock")
    expect(operations.first).to_be_visible()
    paths = operations.locator(".opblock-summary-path").all_inner_texts()
    assert {"/v1/chat/completions", "/v1/generate", "/v1/inspect/attention"} <= {
        p.replace("\u200b", "") for p in paths
    }
    assert watched.errors == []
    assert watched.outside(server.url) == []
    screenshot(page, "docs", full_page=False)
