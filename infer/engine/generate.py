"""The plain single-request loop: prefill once, then one decode forward per token.

This is the sequential baseline the batched engine is measured against, so it does the honest
fast thing: a KV cache sized to the request, logits only for the last position, inference mode.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from infer.engine.params import SamplingParams
from infer.engine.runner import forward_sequence
from infer.engine.sampler import make_generator, sample_token
from infer.models.base import CausalLM
from infer.models.kv_cache import PagedKVCache


def generate(
    model: CausalLM,
    prompt_ids: Sequence[int],
    params: SamplingParams,
    eos_token_ids: Sequence[int] = (),
) -> Iterator[int]:
    """Yield generated token ids one at a time until EOS or ``max_new_tokens``.

    Stop strings are text-level and belong to the caller's detokenizer; the caller stops
    iterating when one matches. An EOS token is yielded (so the caller can see why the loop
    ended) unless ``params.ignore_eos`` is set, in which case generation simply continues.

    Args:
        model: Any :class:`CausalLM`.
        prompt_ids: The prompt, at least one token.
        params: Sampling parameters (a seed makes the output reproducible).
        eos_token_ids: Tokens that end generation.

    Raises:
        ValueError: The prompt is empty.
    """
    if not prompt_ids:
        raise ValueError("prompt must contain at least one token")
    with torch.inference_mode():
        yield from _generate(model, list(prompt_ids), params, frozenset(eos_token_ids))


def _generate(
    model: CausalLM, prompt: list[int], params: SamplingParams, eos: frozenset[int]
) -> Iterator[int]:
    n = len(prompt)
    size = 16
    table = list(range(-(-(n + params.max_new_tokens) // size)))
    cache = PagedKVCache(model.config, len(table), size, model.dtype, model.device)
    generator = make_generator(params.seed)
    history = list(prompt)
    logits = forward_sequence(model, cache, table, prompt, 0)
    for step in range(params.max_new_tokens):
        token = sample_token(logits, params, generator, history)
        history.append(token)
        yield token
        if token in eos and not params.ignore_eos:
            return
        if step + 1 == params.max_new_tokens:
            return
        logits = forward_sequence(model, cache, table, [token], n + step)
