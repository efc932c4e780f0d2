"""Embedding throughput: infer's Embedder against sentence-transformers, same model, same threads.

    python bench/embed_bench.py                     # 32 code chunks of 256 tokens, 2 threads
    python bench/embed_bench.py --rounds 8 --dtype float32 --threads 2

Each round embeds one batch of ``--batch`` chunks of Python source (the standard library's
own, cut at ``--tokens`` tokens with [CLS] and [SEP]) with both, in turns whose order swaps
every round, so a VM whose speed moves from minute to minute slows both alike. Both time the
whole call from text to normalised vectors (tokenizing included). Tokens/s counts the tokens
the model read. The last line is the smallest cosine between the two systems' vectors.
"""

from __future__ import annotations

import argparse
import inspect
import platform
import statistics
import subprocess
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer

from infer.engine.embed import DEFAULT_TOKEN_BUDGET, Embedder
from infer.models import packaged
from infer.models.config import ModelKind
from infer.models.loader import load_model

MODEL = "all-minilm-l6-v2"
SOURCES = ("argparse", "inspect", "json.decoder", "textwrap", "dataclasses")


def code_chunks(tokenizer: object, count: int, tokens: int) -> list[str]:
    """``count`` pieces of standard-library source, each ``tokens - 2`` tokens long."""
    import importlib

    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in SOURCES)
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]  # type: ignore[operator]
    size = tokens - 2
    if len(ids) < count * size:
        raise SystemExit(f"the sources hold {len(ids)} tokens, fewer than {count} x {size}")
    return [tokenizer.decode(ids[i * size : (i + 1) * size]) for i in range(count)]  # type: ignore[attr-defined]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    get = {k.strip(): v.strip() for k, v in fields.items()}.get
    return f"{get('Model name', '?')} family {get('CPU family', '?')} model {get('Model', '?')}"


def timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--token-budget", type=int, default=DEFAULT_TOKEN_BUDGET)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    loaded = load_model(MODEL, getattr(torch, args.dtype), kind=ModelKind.EMBED)
    ours = Embedder(loaded, token_budget=args.token_budget)
    reference = SentenceTransformer(str(packaged.extract(MODEL)), device="cpu")
    chunks = code_chunks(loaded.tokenizer, args.batch, args.tokens)
    tokens = ours.embed(chunks, truncate=True).total_tokens  # also warms both up
    reference.encode(chunks, batch_size=args.batch)

    def run_ours() -> object:
        return ours.embed(chunks, truncate=True)

    def run_reference() -> object:
        return reference.encode(chunks, batch_size=args.batch)

    print(f"{cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"{args.batch} chunks, {tokens} tokens; infer in {loaded.model.dtype}, budget "
        f"{args.token_budget} tokens a forward; sentence-transformers in float32, one batch"
    )
    print("| round | infer tok/s | sentence-transformers tok/s | ratio |")
    print("|---|---|---|---|")
    ratios, rates = [], []
    for r in range(args.rounds):
        if r % 2:
            ref_s, ours_s = timed(run_reference), timed(run_ours)
        else:
            ours_s, ref_s = timed(run_ours), timed(run_reference)
        rates.append((tokens / ours_s, tokens / ref_s))
        ratios.append(ref_s / ours_s)
        print(
            f"| {r + 1} | {tokens / ours_s:,.0f} | {tokens / ref_s:,.0f} | {ref_s / ours_s:.2f}x |"
        )
    ours_med = statistics.median(r[0] for r in rates)
    ref_med = statistics.median(r[1] for r in rates)
    print(f"| median | {ours_med:,.0f} | {ref_med:,.0f} | {statistics.median(ratios):.2f}x |")
    got = ours.embed(chunks, truncate=True).vectors
    want = reference.encode(chunks, batch_size=args.batch, convert_to_tensor=True)
    print(f"min cosine infer vs sentence-transformers: {F.cosine_similarity(got, want).min():.6f}")


if __name__ == "__main__":
    main()
