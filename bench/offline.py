"""In-process measurements without HTTP: decode speed and batching gains.

    python bench/offline.py generate   # batch-1 greedy tok/s: generate() vs transformers
    python bench/offline.py engine     # W2 offline: sequential vs static vs continuous
    python bench/offline.py steps      # median decode step time at batch 1, 16, 64
    python bench/offline.py verify     # one stream's forward time by rows verified (drafts)

Run on a quiet machine; each command prints one table. Ratios within one run are what to
compare: absolute numbers move with whatever else the 2 cores are doing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from infer import kernels
from infer.bench.workloads import BenchRequest, PromptSource, mixed_requests
from infer.engine.config import DTYPES, WEIGHT_MODES, EngineConfig
from infer.engine.engine import Engine
from infer.engine.generate import generate
from infer.engine.params import SamplingParams
from infer.models.default import ensure_default_model
from infer.models.loader import LoadedModel, load_model


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def bench_generate(new_tokens: int, prompt_len: int) -> None:
    """Batch-1 greedy decode tok/s of our generate() and transformers' generate()."""
    print("| dtype | infer generate() tok/s | transformers generate() tok/s | ratio |")
    print("|---|---|---|---|")
    for name in ("bfloat16", "float32"):
        dtype = DTYPES[name]
        loaded = load_model("default", dtype)
        ids = PromptSource(loaded.tokenizer).prompt(prompt_len, random.Random(0))
        ours = _tok_per_s(partial(_ours, loaded, ids, new_tokens))
        theirs = _tok_per_s(partial(_transformers, _hf_model(dtype), ids, new_tokens))
        print(
            f"| {name} | {ours * new_tokens:.1f} | {theirs * new_tokens:.1f} | "
            f"{ours / theirs:.2f}x |"
        )


def _ours(loaded: LoadedModel, ids: tuple[int, ...], n: int) -> None:
    list(generate(loaded.model, ids, _greedy(n)))


def _hf_model(dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=dtype).eval()


def _transformers(hf: Any, ids: tuple[int, ...], n: int) -> None:
    x = torch.tensor([ids])
    with torch.inference_mode():
        hf.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )


def _tok_per_s(fn: Callable[[], None]) -> float:
    """Best of three runs, in runs per second (the caller scales by tokens per run)."""
    fn()  # warm-up
    return max(1.0 / _timed(fn) for _ in range(3))


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_engine(seed: int) -> None:
    """W2 offline: 16 requests, prompts 32-1024, 64-256 new tokens, all submitted at once."""
    loaded = load_model("default", torch.bfloat16)
    reqs = mixed_requests(PromptSource(loaded.tokenizer), 16, (32, 1024), (64, 256), f"W2/{seed}")
    total = sum(r.max_new_tokens for r in reqs)
    start = time.perf_counter()
    for r in reqs:
        list(generate(loaded.model, r.prompt_ids, _greedy(r.max_new_tokens)))
    seq = time.perf_counter() - start
    print("| system | output tok/s | x sequential |\n|---|---|---|")
    print(f"| sequential generate() | {total / seq:.1f} | 1.00x |")
    for mode in ("static", "continuous"):
        elapsed = _run_engine(loaded, reqs, mode)
        print(f"| engine {mode} | {total / elapsed:.1f} | {seq / elapsed:.2f}x |")


def _run_engine(loaded: LoadedModel, reqs: tuple[BenchRequest, ...], mode: str) -> float:
    config = EngineConfig(max_batch_size=16, max_seq_len=1400, batching_mode=mode)
    engine = Engine(config, loaded.model, loaded.tokenizer, loaded.eos_token_ids)
    start = time.perf_counter()
    for r in reqs:
        engine.add_request(list(r.prompt_ids), _greedy(r.max_new_tokens))
    with torch.inference_mode():
        while engine.has_work():
            engine.step()
    return time.perf_counter() - start


def step_engine(loaded: LoadedModel, batch: int, context: int, steps: int) -> Engine:
    """An engine holding ``batch`` copies of one ``context``-token prompt, each to decode
    ``steps`` greedy tokens: its first step prefills them all, every later one decodes one
    token per sequence (no drafts: a verify step would run several rows per sequence)."""
    config = EngineConfig(
        max_batch_size=batch,
        max_seq_len=context + steps + 8,
        prefill_token_budget=4096,
        kv_cache_gb=4.0,
        draft_tokens=0,
    )
    engine = Engine(config, loaded.model, loaded.tokenizer, loaded.eos_token_ids)
    prompt = list(PromptSource(loaded.tokenizer).prompt(context, random.Random(0)))
    for _ in range(batch):
        engine.add_request(prompt, _greedy(steps))
    return engine


def bench_steps(
    context: int,
    steps: int,
    model: str,
    weights: str,
    batches: tuple[int, ...],
    amx_both: bool = False,
) -> None:
    """Median time of one decode step at each batch size, every sequence at ``context``;
    with ``amx_both``, steps alternate between the kernels with AMX tiles and without."""
    loaded = load_model(model, torch.bfloat16, weights=weights)
    if amx_both and not kernels.ops().set_amx(True):
        raise SystemExit("--amx-both: this CPU has no AMX (or Linux refused the tile state)")
    if amx_both:
        print(f"| batch | step ms, AMX (context {context}) | without AMX | ratio |")
        print("|---|---|---|---|")
    else:
        print(f"| batch | decode step ms (context {context}) | tok/s |\n|---|---|---|")
    for batch in batches:
        engine = step_engine(loaded, batch, context, steps)
        times: list[float] = []
        with torch.inference_mode():
            while engine.has_work():
                if amx_both:
                    kernels.ops().set_amx(len(times) % 2 == 0)
                start = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - start)
        kernels.ops().set_amx(True)
        if amx_both:  # the prefill step is the first, with AMX: the decode steps after it
            on, off = (statistics.median(times[i::2][1:]) * 1000 for i in (0, 1))
            print(f"| {batch} | {on:.1f} | {off:.1f} | {on / off:.2f} |")
            continue
        ms = statistics.median(times[-steps // 2 :]) * 1000
        print(f"| {batch} | {ms:.1f} | {batch * 1000 / ms:.0f} |")


def bench_verify(model: str, module: str, new_tokens: int) -> None:
    """One stream editing a standard-library file: tok/s without drafts, drafting from its
    prompt, and from the file as its prediction; the forward's median time by rows run."""
    import collections
    import importlib.util

    loaded = load_model(model, torch.bfloat16)
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin is not None, module
    source = open(spec.origin).read()
    ask = "Add type hints to every function. Return the whole file in one python code block."
    messages = [{"role": "user", "content": f"{ask}\n\n```python\n{source}```"}]
    rendered: Any = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids: list[int] = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    print(f"{len(ids)}-token prompt\n")
    print("| drafts | tok/s | drafted | kept | forward ms by rows (median, steps) |")
    print("|---|---|---|---|---|")
    for name, draft_tokens, prediction in (
        ("none", 0, None),
        ("prompt", 16, None),
        ("prediction", 16, source),
    ):
        config = EngineConfig(max_seq_len=len(ids) + new_tokens + 16, draft_tokens=draft_tokens)
        engine = Engine(config, loaded.model, loaded.tokenizer, loaded.eos_token_ids)
        greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
        req = engine.add_request(ids, greedy, prediction=prediction)
        while not req.output_ids:  # the prompt
            engine.step()
        by_rows: dict[int, list[float]] = collections.defaultdict(list)
        run = engine.runner.run

        def timed(plan: Any, run: Any = run, by_rows: Any = by_rows) -> Any:
            start = time.perf_counter()
            out = run(plan)
            by_rows[sum(1 + len(r.draft) for r in plan.decode)].append(time.perf_counter() - start)
            return out

        engine.runner.run = timed  # type: ignore[method-assign]
        first, start = len(req.output_ids), time.perf_counter()
        while engine.has_work():
            engine.step()
        rate = (len(req.output_ids) - first) / (time.perf_counter() - start)
        spec_ = engine.scheduler.speculator
        rows = ", ".join(
            f"{k}: {statistics.median(v) * 1000:.0f} ({len(v)})" for k, v in sorted(by_rows.items())
        )
        print(f"| {name} | {rate:.1f} | {spec_.drafted} | {spec_.accepted} | {rows} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["generate", "engine", "steps", "verify"])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="default", help="steps: the model to load")
    p.add_argument("--weights", default="auto", choices=WEIGHT_MODES, help="steps: as serve's")
    p.add_argument("--batches", default="1,16,64", help="steps: comma-separated batch sizes")
    p.add_argument("--file", default="colorsys", help="verify: the standard-library module")
    p.add_argument(
        "--amx-both", action="store_true", help="steps: alternate steps with AMX and without"
    )
    args = p.parse_args()
    if args.what == "generate":
        bench_generate(args.new_tokens, args.prompt_len)
    elif args.what == "engine":
        bench_engine(args.seed)
    elif args.what == "verify":
        bench_verify(args.model, args.file, args.new_tokens)
    else:
        bench_steps(
            args.context,
            args.steps,
            args.model,
            args.weights,
            tuple(int(b) for b in args.batches.split(",")),
            args.amx_both,
        )


if __name__ == "__main__":
    main()
