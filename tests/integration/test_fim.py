"""Code completion (fill in the middle) through a real server on the real
Qwen2.5-Coder-0.5B: llama.cpp's ``/infill`` with the bodies llama.vim and llama.vscode send
(written from their sources), ``suffix`` through the ``openai`` client, every editor stop,
the cache that makes a keystroke cheap, keystrokes that replace each other, and the refusals.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from support.server import served

pytestmark = pytest.mark.slow

QWEN = "qwen2.5-coder-0.5b"
SMOL = "SmolLM2-135M-Instruct"
FIB = "def fibonacci(n):\n    if n < 2:\n        return n\n"
TOTAL = "def total(items):\n    total = 0\n    for x in items:\n"
SPECIAL = re.compile(r"<\|[a-z_]+\|>")
AppFactory = Callable[..., Any]


# What llama.vim asks /infill to answer (its response_fields; autoload/llama.vim)
VIM_FIELDS = [
    "content",
    "timings/prompt_n",
    "timings/prompt_ms",
    "timings/prompt_per_token_ms",
    "timings/prompt_per_second",
    "timings/predicted_n",
    "timings/predicted_ms",
    "timings/predicted_per_token_ms",
    "timings/predicted_per_second",
    "truncated",
    "tokens_cached",
]


def llama_vim(prefix: str, middle: str, suffix: str, indent: int, **extra: Any) -> dict[str, Any]:
    """The body llama.vim's ``llama#fim`` sends (autoload/llama.vim), with its defaults."""
    ring = [{"text": "def helper(x):\n    return x * 2\n", "time": [1732, 5], "filename": "a.py"}]
    return {
        "id_slot": 0,
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": ring,
        "prompt": middle,
        "n_predict": 128,
        "stop": [],
        "n_indent": indent,
        "top_k": 40,
        "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"],
        "stream": False,
        "cache_prompt": True,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 1000,
        "response_fields": VIM_FIELDS,
        "model": "",
        **extra,
    }


def llama_vscode(prefix: str, middle: str, suffix: str, indent: int) -> dict[str, Any]:
    """The body llama.vscode's ``getFIMCompletion`` sends (src/llama-server.ts)."""
    return {
        "id_slot": 0,
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": [],
        "prompt": middle,
        "n_predict": 128,
        "n_cmpl": 1,
        "top_k": 40,
        "top_p": 0.99,
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
        "n_indent": indent,
        "t_max_prompt_ms": 500,
        "t_max_predict_ms": 2500,
    }


def test_infill_answers_what_llama_vim_and_llama_vscode_send(qwen_app: AppFactory) -> None:
    def run(url: str) -> tuple[str, Any, Any, Any]:
        client = httpx.Client(base_url=url, timeout=300)
        vim = client.post("/infill", json=llama_vim(FIB, "    else", "\n", 4, seed=1))
        warm = llama_vim("", "", "", 0, n_predict=0, response_fields=[""], temperature=0.0)
        vscode = client.post("/infill", json=llama_vscode(FIB, "    else", "\n", 4) | {"seed": 1})
        two = client.post("/infill", json=llama_vscode(TOTAL, "", "\n", 0) | {"n_cmpl": 2})
        return vim.text, client.post("/infill", json=warm).json(), vscode.json(), two.json()

    raw, warm, vscode, two = trio.run(served, qwen_app(), run)
    # llama.vim reads the body only where it matches this (compact JSON)
    assert re.search(r'"content"\s*:"', raw)
    vim = json.loads(raw)
    assert set(vim) == set(VIM_FIELDS)  # the fields it asked for, and no others
    assert vim["content"] and not SPECIAL.search(vim["content"]) and vim["truncated"] is False
    assert vim["timings/predicted_n"] > 0 and vim["tokens_cached"] > vim["timings/prompt_n"]
    assert warm == {}  # its warm-up asks for no fields
    # llama.vscode reads content, the context size and the timings
    assert vscode["content"] and vscode["generation_settings"]["n_ctx"] > 0
    assert vscode["timings"]["prompt_n"] > 0 and vscode["stop"] is True
    assert [c["index"] for c in two] == [0, 1] and all(c["content"] for c in two)


def test_every_editor_stop(qwen_app: AppFactory) -> None:
    def run(url: str) -> dict[str, Any]:
        client = httpx.Client(base_url=url, timeout=300)

        def fill(prefix: str, suffix: str, **options: Any) -> Any:
            body = {"input_prefix": prefix, "input_suffix": suffix, "temperature": 0.0}
            body |= {"n_predict": 48, "return_tokens": True} | options
            return client.post("/infill", json=body).json()

        return {
            "repeat": fill(TOTAL, "\n    return total\n"),
            "no repeat stop": fill(TOTAL, "\n    return total\n", stop_at_suffix=False),
            "indent": fill(FIB, "\n", prompt="    else", n_indent=4),
            "no indent": fill(FIB, "\n", prompt="    else"),
            "budget": fill(FIB, "\n", prompt="    else", t_max_predict_ms=1),
        }

    got = trio.run(served, qwen_app(), run)
    # the fill reaches code that is already there: it ends before repeating it
    assert got["repeat"]["content"] == "        total += x"
    assert "    return total" in got["no repeat stop"]["content"]
    # ... and the model then ends the fill with a FIM end token (<|endoftext|>), not shown
    whole = got["no repeat stop"]
    assert whole["stop_type"] == "eos" and whole["tokens"][-1] == 151643
    # a line indented less than the cursor's line ends the completion before it
    free, cut = got["no indent"]["content"], got["indent"]["content"]
    assert free.startswith(cut) and len(cut) < len(free)
    assert any(line and not line.startswith("    ") for line in free.split("\n")[1:])
    assert all(not line or line.startswith("    ") for line in cut.split("\n")[1:])
    # past its time budget the completion ends at the end of a line
    budget = got["budget"]
    assert budget["stop_type"] == "limit" and budget["content"].endswith("\n")
    assert free.startswith(budget["content"].rstrip("\n")) and len(budget["content"]) < len(free)
    for answer in got.values():
        assert not SPECIAL.search(answer["content"])


def test_suffix_through_the_openai_client(qwen_app: AppFactory) -> None:
    from openai import OpenAI, UnprocessableEntityError

    def run(url: str) -> tuple[Any, str, Any]:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        args = dict(model=QWEN, prompt=TOTAL, suffix="\n    return total\n", temperature=0)
        whole = client.completions.create(**args, max_tokens=32)
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(**args, max_tokens=32, stream=True)
        )
        with pytest.raises(UnprocessableEntityError) as refused:
            client.completions.create(**args, max_tokens=32, echo=True)
        return whole, streamed, refused.value

    whole, streamed, refused = trio.run(served, qwen_app(), run)
    choice = whole.choices[0]
    assert choice.text == streamed == "        total += x" and choice.finish_reason == "stop"
    assert "echo is not supported with suffix" in str(refused)


def test_a_keystroke_reads_only_what_changed(qwen_app: AppFactory) -> None:
    """An editor warms the cache, then asks at each keystroke: each reads a few tokens."""
    code = "".join(f"    value_{i} = compute({i})\n" for i in range(40))
    prefix = f"def values():\n{code}"
    suffix = "\n    return values\n" * 20

    def run(url: str) -> list[Any]:
        client = httpx.Client(base_url=url, timeout=300)
        warm = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 0}
        read = [client.post("/infill", json=warm).json()]
        for typed in ("    v", "    val", "    value_", "    value_40"):
            body = warm | {"prompt": typed, "n_predict": 4, "temperature": 0.0}
            read.append(client.post("/infill", json=body).json())
        return read

    warm, *keys = trio.run(served, qwen_app(engine={"max_seq_len": 2048}), run)
    assert warm["content"] == "" and warm["tokens_predicted"] == 0
    for answer in keys:
        assert answer["timings"]["cache_n"] > 400  # the file around the cursor, cached
        assert answer["timings"]["prompt_n"] < 24  # the keystroke, and the token before it


def test_keystrokes_that_replace_each_other_free_their_work(qwen_app: AppFactory) -> None:
    """An editor drops the request a new keystroke replaces: many a second, each one
    ended on the server at once."""

    def run(url: str) -> tuple[dict[str, Any], Any]:
        client = httpx.Client(base_url=url)
        body = {"input_prefix": FIB, "input_suffix": "\n", "n_predict": 256, "ignore_eos": True}
        for i in range(12):
            try:
                client.post("/infill", json=body | {"prompt": "    " + "x" * i}, timeout=0.15)
            except httpx.TimeoutException:
                pass  # the editor closed the connection
        health = {}
        for _ in range(100):
            health = client.get("/health").json()
            if health["running"] == 0 and health["waiting"] == 0:
                break
            time.sleep(0.1)
        last = client.post("/infill", json=body | {"n_predict": 8}, timeout=300)
        return health, last.json()

    health, last = trio.run(served, qwen_app(), run)
    assert health["running"] == 0 and health["waiting"] == 0
    assert last["tokens_predicted"] == 8


def test_refusals_in_llama_cpp_shape(qwen_app: AppFactory, real_app: AppFactory) -> None:
    def run(url: str) -> list[httpx.Response]:
        client = httpx.Client(base_url=url, timeout=300)
        return [
            client.post("/infill", json={"input_suffix": "x"}),
            client.post("/infill", content=b"{not json"),
            client.post("/infill", json={"input_prefix": "a", "input_suffix": "b", "top_k": -1}),
        ]

    for response in trio.run(served, qwen_app(), run):
        error = response.json()["error"]
        assert 400 <= response.status_code < 500 and error["code"] == response.status_code
        assert error["message"] and error["type"]

    def no_fim(url: str) -> list[httpx.Response]:
        client = httpx.Client(base_url=url, timeout=300)
        body = {"model": SMOL, "prompt": "def f(", "suffix": ")", "max_tokens": 4}
        return [
            client.post("/infill", json={"input_prefix": "def f(", "input_suffix": ")"}),
            client.post("/v1/completions", json=body),
        ]

    infill, completion = trio.run(served, real_app(), no_fim)
    assert infill.status_code == completion.status_code == 400
    assert SMOL in infill.json()["error"]["message"]
    assert completion.json()["error"]["code"] == "fim_not_supported"
