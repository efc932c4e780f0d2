"""The ``assistant`` load: the three models of a coding assistant at once, on one machine.

One person types (code completion on Qwen2.5-Coder-0.5B, the ``fim`` load's session) while
chat answers stream on Qwen2.5-Coder-1.5B, one after another, and chunks of the codebase are
embedded in batches by all-MiniLM-L6-v2. Two systems do the same work:

- infer: one ``infer serve`` holding the three models, one lock over the cores;
- llama.cpp: three ``llama-server`` processes, one per model (the embedder with
  ``--embedding`` on a GGUF that llama.cpp's own converter makes from the same MiniLM
  folder), each with the machine's threads.

Both are offered the same work: a completion at most every ``TYPING_PERIOD_S`` and a batch of
chunks every ``EMBED_PERIOD_S``; the chat answers run back to back. Reported per system:
keystroke latency alone (idle) and beside the other two loads, the chat streams' tokens per
second alone and beside the others, the embedding tokens per second.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

from infer.bench.fim import LLAMA_FLAGS, replay, sampling, summary
from infer.bench.servers import (
    default_llama_server,
    infer_command,
    llama_server_command,
    running_server,
)
from infer.bench.typing import ring, session
from infer.procs import free_port

COMPLETE, CHAT, EMBED = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "all-minilm-l6-v2"
FUNCTIONS = {"full": 6, "quick": 2, "smoke": 1}
SMOKE_REQUESTS = 4
CHAT_TOKENS = 128
EMBED_BATCH, EMBED_TOKENS = 32, 256  # as an indexer batches them (MiniLM's limit: 256)
# The same work offered to each system: a completion asked at most every TYPING_PERIOD_S (a
# person pauses a couple of words apart) and a batch of chunks every EMBED_PERIOD_S (an
# indexer following saved files); the chat answers run back to back and show what is left.
TYPING_PERIOD_S = 2.0
EMBED_PERIOD_S = 4.0
QUESTIONS = (
    "Explain what a Python generator is, with a short example.",
    "How do I read a large CSV file in chunks with pandas?",
    "Write a function that merges two sorted lists.",
    "What is the difference between a process and a thread?",
    "Show how to use functools.lru_cache and when it helps.",
    "How can I profile a slow Python function?",
)


def chunks(count: int = EMBED_BATCH, tokens: int = EMBED_TOKENS) -> list[str]:
    """Pieces of Python's own sources of about ``tokens`` MiniLM tokens each (its special
    tokens included), as an indexer would cut a codebase."""
    import textwrap

    from transformers import AutoTokenizer

    from infer.models.packaged import extract

    tokenizer = AutoTokenizer.from_pretrained(extract(EMBED))
    text, start = Path(textwrap.__file__).read_text(), 0
    pieces: list[str] = []
    while len(pieces) < count:
        low, high = start, min(len(text), start + 8 * tokens)
        while low < high:  # the longest piece from `start` that fits
            mid = (low + high + 1) // 2
            if len(tokenizer(text[start:mid])["input_ids"]) <= tokens:
                low = mid
            else:
                high = mid - 1
        pieces.append(text[start:low])
        start = low if low < len(text) else 0
    return pieces


class Background:
    """A loop of requests on a thread of its own until stopped, each started at least
    ``period_s`` after the one before (0: back to back); what it did and for how long."""

    def __init__(self, run_once: Any, period_s: float = 0.0) -> None:
        self.run_once = run_once
        self.period_s = period_s
        self.stop = threading.Event()
        self.tokens = 0
        self.busy_s = 0.0
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            try:
                self.tokens += self.run_once()
            except Exception as e:  # noqa: BLE001 - reported, the load goes on
                self.errors.append(str(e)[:200])
                time.sleep(0.5)
            self.stop.wait(max(0.0, started + self.period_s - time.perf_counter()))
            self.busy_s += time.perf_counter() - started

    def __enter__(self) -> Background:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.thread.join(timeout=600)

    def rate(self) -> float:
        return self.tokens / self.busy_s if self.busy_s else 0.0


def chat_once(url: str, model: str, counter: list[int]) -> int:
    """One streamed chat answer of :data:`CHAT_TOKENS` tokens; the tokens it streamed."""
    question = QUESTIONS[counter[0] % len(QUESTIONS)]
    counter[0] += 1
    body = {
        "model": model,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": CHAT_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    tokens = 0
    with (
        httpx.Client(timeout=600.0) as client,
        client.stream("POST", f"{url}/v1/chat/completions", json=body) as response,
    ):
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: {") and '"usage"' in line:
                usage = httpx.Response(200, content=line[6:]).json().get("usage") or {}
                tokens = usage.get("completion_tokens", tokens)
    return int(tokens)


def embed_once(url: str, model: str, texts: list[str]) -> int:
    """One batch of embeddings; the tokens it read."""
    body = {"model": model, "input": texts}
    response = httpx.post(f"{url}/v1/embeddings", json=body, timeout=600.0)
    response.raise_for_status()
    return int(response.json()["usage"]["prompt_tokens"])


def minilm_gguf(folder: Path, out: Path) -> Path:
    """all-MiniLM-L6-v2 as a GGUF file, made by llama.cpp's own converter (once)."""
    if out.is_file():
        return out
    peers = default_llama_server().resolve().parents[1]
    script = next(peers.glob("llama-src/*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, str(script), str(folder), "--outfile", str(out), "--outtype", "bf16"],
        check=True,
        capture_output=True,
    )
    return out


def serve_models(port: int, models: dict[str, str], threads: int) -> list[str]:
    """``infer serve`` of ``models`` (name: source; the first is the default)."""
    flags = [f for name, source in models.items() for f in ("--model", f"{name}={source}")]
    command = infer_command(port, "continuous", "default", "bfloat16", flags)
    at = command.index("--model")
    del command[at : at + 2]  # the plain --model infer_command gives: the flags name them all
    return [*command, "--num-threads", str(threads)]


@contextmanager
def infer_server(threads: int) -> Iterator[dict[str, tuple[str, str]]]:
    """One ``infer serve`` with the three models: each part's URL and model name."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = serve_models(port, {"complete": COMPLETE, "chat": CHAT, "embed": EMBED}, threads)
    with running_server(command, url, "/health", timeout_s=900):
        for name in ("chat", "embed"):  # loaded before the clock starts, as a pinned model is
            httpx.post(
                f"{url}/v1/embeddings" if name == "embed" else f"{url}/v1/completions",
                json={"model": name, "input": "x"}
                if name == "embed"
                else {"model": name, "prompt": "x", "max_tokens": 1},
                timeout=900.0,
            ).raise_for_status()
        yield {"complete": (url, "complete"), "chat": (url, "chat"), "embed": (url, "embed")}


@contextmanager
def llama_servers(gguf: dict[str, Path], threads: int) -> Iterator[dict[str, tuple[str, str]]]:
    """Three ``llama-server`` processes, one per model."""
    binary = default_llama_server()
    urls = {}
    with ExitStack() as stack:
        for part, ctx, extra in (
            ("complete", 8192, list(LLAMA_FLAGS)),
            ("chat", 2048, []),
            ("embed", 8192, ["--embedding", "--pooling", "mean", "-ub", "8192", "-b", "8192"]),
        ):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            command = [*llama_server_command(binary, port, gguf[part], threads, 1, ctx), *extra]
            stack.enter_context(running_server(command, url, "/health", timeout_s=900))
            urls[part] = (url, "")
        yield urls


def measure(parts: dict[str, tuple[str, str]], scale: str, seed: int) -> dict[str, Any]:
    """The typing session alone, then again beside the chat and embedding loops."""
    keystrokes = session(FUNCTIONS[scale], seed=seed)[
        : SMOKE_REQUESTS if scale == "smoke" else None
    ]
    extra, sampled = ring(seed), sampling(0.0, 0.9)
    url, name = parts["complete"]
    for k in keystrokes[:1]:  # first loads (kernels, vocabulary), as the fim load does
        replay(url, [k], extra, sampled, model=name)
    idle = replay(url, keystrokes, extra, sampled, name, TYPING_PERIOD_S)
    counter = [0]
    texts = chunks()
    chat_url, chat_model = parts["chat"]
    embed_url, embed_model = parts["embed"]
    started = time.perf_counter()
    alone = sum(chat_once(chat_url, chat_model, counter) for _ in range(2))
    chat_alone = alone / (time.perf_counter() - started)
    with (
        Background(lambda: chat_once(chat_url, chat_model, counter)) as chat,
        Background(lambda: embed_once(embed_url, embed_model, texts), EMBED_PERIOD_S) as embed,
    ):
        time.sleep(2.0)  # both loops under way
        loaded = replay(url, keystrokes, extra, sampled, name, TYPING_PERIOD_S)
    return {
        "idle": summary(idle),
        "loaded": summary(loaded),
        "chat_alone_tok_s": round(chat_alone, 2),
        "chat_tok_s": round(chat.rate(), 2),
        "embed_tok_s": round(embed.rate(), 1),
        "chat_errors": chat.errors[:3],
        "embed_errors": embed.errors[:3],
    }


def table(report: dict[str, Any]) -> str:
    """The report as a Markdown table, with infer's ratios to llama.cpp's."""
    rows = report["systems"]
    lines = [
        "assistant load: typing on the 0.5B (fim session, a completion at most every "
        f"{TYPING_PERIOD_S:g} s) beside chat streams on the 1.5B (back to back) and "
        f"embedding batches (MiniLM, 32 x {EMBED_TOKENS} tokens every {EMBED_PERIOD_S:g} s)",
        "",
        "| system | typing p50 idle, ms | p50 loaded | p95 loaded | loaded / idle "
        "| chat tok/s alone | chat tok/s loaded | embedding tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for system, r in rows.items():
        idle, loaded = r["idle"]["p50_ms"], r["loaded"]["p50_ms"]
        lines.append(
            f"| {system} | {idle:.0f} | {loaded:.0f} | {r['loaded']['p95_ms']:.0f} "
            f"| {loaded / idle:.2f}x | {r.get('chat_alone_tok_s', 0):.1f} "
            f"| {r['chat_tok_s']:.1f} | {r['embed_tok_s']:.0f} |"
        )
    if {"infer", "llama.cpp"} <= set(rows):
        a, b = rows["infer"], rows["llama.cpp"]
        typing = a["loaded"]["p50_ms"] / b["loaded"]["p50_ms"]
        lines.append(
            f"\ninfer / llama.cpp: typing p50 loaded {typing:.2f}x, "
            f"chat {a['chat_tok_s'] / max(b['chat_tok_s'], 1e-9):.2f}x, "
            f"embeddings {a['embed_tok_s'] / max(b['embed_tok_s'], 1e-9):.2f}x"
        )
    return "\n".join(lines)


def run(systems: list[str], scale: str, seed: int, threads: int) -> dict[str, Any]:
    """The load on each system (``infer``, ``llama.cpp``); each one's figures."""
    from infer.models.derived_files import cache_dir
    from infer.models.packaged import assemble, extract

    report: dict[str, Any] = {"systems": {}}
    for system in systems:
        if system == "llama.cpp":
            gguf = {
                "complete": assemble(COMPLETE),
                "chat": assemble(CHAT),
                "embed": minilm_gguf(
                    extract(EMBED), cache_dir() / "gguf" / "all-minilm-l6-v2-bf16.gguf"
                ),
            }
            servers = llama_servers(gguf, threads)
        else:
            servers = infer_server(threads)
        with servers as parts:
            report["systems"][system] = measure(parts, scale, seed)
    return report
