"""Embedding throughput: infer's Embedder against sentence-transformers (and llama.cpp's
``llama-server --embedding``), same model, same threads.

    python bench/embed_bench.py                     # 32 code chunks of 256 tokens, 2 threads
    python bench/embed_bench.py --rounds 8 --dtype float32
    python bench/embed_bench.py --gguf minilm-bf16.gguf   # and llama-server (make peers)

Each round embeds one batch of ``--batch`` chunks of Python source (the standard library's
own, cut at ``--tokens`` tokens with [CLS] and [SEP]) with each system, in turns whose order
rotates every round, so a VM whose speed moves from minute to minute slows all alike. Each
times the whole call from text to normalised vectors (tokenizing included; llama-server's
over loopback HTTP). Tokens/s counts the tokens each system's model read. The last lines are
the smallest cosine between each system's vectors and sentence-transformers'.

The GGUF comes from llama.cpp's own converter (in the llama-cpp-python source package that
``make peers`` unpacks into .peers/llama-src), on the folder infer extracts:
``python convert_hf_to_gguf.py ~/.cache/infer/models/all-minilm-l6-v2 --outtype bf16
--outfile minilm-bf16.gguf``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from infer.bench.servers import (
    default_llama_server,
    free_port,
    llama_server_command,
    running_server,
)
from infer.engine.embed import DEFAULT_TOKEN_BUDGET, Embedder
from infer.models import packaged
from infer.models.config import ModelKind
from infer.models.loader import load_model

MODEL = "all-minilm-l6-v2"
SOURCES = ("argparse", "inspect", "json.decoder", "textwrap", "dataclasses")


def code_chunks(tokenizer: PreTrainedTokenizerBase, count: int, tokens: int) -> list[str]:
    """``count`` pieces of standard-library source, each ``tokens - 2`` tokens long."""
    import importlib

    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in SOURCES)
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    size = tokens - 2
    if len(ids) < count * size:
        raise SystemExit(f"the sources hold {len(ids)} tokens, fewer than {count} x {size}")
    return [str(tokenizer.decode(ids[i * size : (i + 1) * size])) for i in range(count)]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    get = {k.strip(): v.strip() for k, v in fields.items()}.get
    return f"{get('Model name', '?')} family {get('CPU family', '?')} model {get('Model', '?')}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--token-budget", type=int, default=DEFAULT_TOKEN_BUDGET)
    parser.add_argument("--gguf", type=Path, help="the model as GGUF: adds llama-server")
    parser.add_argument("--llama-server", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(MODEL, getattr(torch, args.dtype), kind=ModelKind.EMBED)
    ours = Embedder(loaded, token_budget=args.token_budget)
    reference = SentenceTransformer(str(packaged.extract(MODEL)), device="cpu")
    chunks = code_chunks(loaded.tokenizer, args.batch, args.tokens)
    tokens = ours.embed(chunks, truncate=True).total_tokens  # same tokenizer as the reference

    def run_ours() -> tuple[int, Tensor]:
        out = ours.embed(chunks, truncate=True)
        return out.total_tokens, out.vectors

    def run_reference() -> tuple[int, Tensor]:
        return tokens, reference.encode(chunks, batch_size=args.batch, convert_to_tensor=True)

    systems: dict[str, Callable[[], tuple[int, Tensor]]] = {
        "infer": run_ours,
        "sentence-transformers": run_reference,
    }
    with contextlib.ExitStack() as stack:
        if args.gguf is not None:
            binary = args.llama_server or default_llama_server()
            systems["llama.cpp"] = stack.enter_context(
                llama_embedder(binary, args.gguf, args.threads, args.batch, chunks)
            )
        print(f"{cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
        print(
            f"{args.batch} chunks, {tokens} tokens; infer in {args.dtype}, "
            f"{args.token_budget} tokens a forward; sentence-transformers in float32"
            + (f"; llama-server on {args.gguf.name}" if args.gguf else "")
        )
        rounds(systems, args.rounds)


def rounds(systems: dict[str, Callable[[], tuple[int, Tensor]]], n: int) -> None:
    """``n`` rounds, the systems' order rotating; a table of tokens/s and infer's ratios."""
    names = list(systems)
    vectors = {name: call()[1] for name, call in systems.items()}  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in names}
    print(
        "| round | "
        + " | ".join(f"{n} tok/s" for n in names)
        + " | "
        + " | ".join(f"infer / {n}" for n in names[1:])
        + " |"
    )
    print("|---" * (2 * len(names)) + "|")
    for r in range(n):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start = time.perf_counter()
            count, _ = systems[name]()
            rates[name].append(count / (time.perf_counter() - start))
        row = [rates[name][-1] for name in names]
        print(
            f"| {r + 1} | "
            + " | ".join(f"{x:,.0f}" for x in row)
            + " | "
            + " | ".join(f"{row[0] / x:.2f}x" for x in row[1:])
            + " |"
        )
    med = [statistics.median(rates[name]) for name in names]
    ours = rates["infer"]
    ratios = [
        statistics.median(a / b for a, b in zip(ours, rates[n], strict=True)) for n in names[1:]
    ]
    print(
        "| median | "
        + " | ".join(f"{x:,.0f}" for x in med)
        + " | "
        + " | ".join(f"{x:.2f}x" for x in ratios)
        + " |"
    )
    want = vectors["sentence-transformers"]
    for name in names:
        if name != "sentence-transformers":
            cos = F.cosine_similarity(vectors[name], want).min()
            print(f"min cosine {name} vs sentence-transformers: {cos:.6f}")


@contextlib.contextmanager
def llama_embedder(
    binary: Path, gguf: Path, threads: int, slots: int, chunks: list[str]
) -> Iterator[Callable[[], tuple[int, Tensor]]]:
    """``llama-server --embedding --pooling mean`` on ``gguf``, a slot per chunk, and a call
    that posts the chunks to its ``/v1/embeddings`` (its default 512-token ubatch measured
    fastest: a larger one attends across the sequences it holds)."""
    port = free_port()
    command = llama_server_command(binary, port, gguf, threads, slots, 512)
    command += ["--embedding", "--pooling", "mean", "--batch-size", str(slots * 512)]
    url = f"http://127.0.0.1:{port}"
    with running_server(command, url, "/health"), httpx.Client(timeout=600) as client:

        def call() -> tuple[int, Tensor]:
            body = client.post(f"{url}/v1/embeddings", json={"input": chunks}).json()
            vectors = torch.tensor([d["embedding"] for d in body["data"]])
            return int(body["usage"]["prompt_tokens"]), vectors

        yield call


if __name__ == "__main__":
    main()
