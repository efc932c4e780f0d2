"""The logits step before sampling: OpenAI's penalties, logit bias and grammar masks.

:func:`process_logits` takes a step's ``[N, V]`` logits and its requests and returns the
logits :func:`infer.engine.sampler.sample` should draw from. Each part is one batched tensor
operation over the rows that use it; a step whose requests use none of them returns its
logits untouched, so a batch without these fields pays one Python check per row.

Order: logit bias, then presence/frequency penalties, then the grammar mask (a banned token
stays banned whatever the bias), then min-p (among the tokens left). ``repetition_penalty``,
temperature, top-k and top-p follow in the sampler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from infer.engine.grammar import allocate_bitmask, apply_bitmask
from infer.engine.params import SamplingParams
from infer.engine.request import Request


def needs_processing(params: SamplingParams) -> bool:
    """Whether a request uses a part of this step other than a grammar."""
    min_p = params.min_p > 0 and not params.greedy  # the argmax always passes min-p
    return bool(params.presence_penalty or params.frequency_penalty or params.logit_bias or min_p)


def process_logits(logits: Tensor, requests: Sequence[Request]) -> Tensor:
    """Apply logit bias, presence/frequency penalties and grammar masks to a step's logits.

    Args:
        logits: ``[N, V]`` logits of the last position of each request (any float dtype).
        requests: The ``N`` requests, in row order.

    Returns:
        ``logits`` itself when no request needs processing; otherwise a new float32
        ``[N, V]`` tensor (the input stays as it was, for the reported logprobs).
    """
    constrained = advance_grammars(requests)
    if not constrained and not any(needs_processing(r.params) for r in requests):
        return logits
    out = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
    apply_logit_bias(out, [r.params.logit_bias for r in requests])
    apply_penalties(out, requests)
    apply_grammars(out, requests, constrained)
    apply_min_p(out, [r.params for r in requests])
    return out


def apply_min_p(logits: Tensor, params: Sequence[SamplingParams]) -> None:
    """Drop every token less likely than ``min_p`` times the likeliest one, in place (on the
    logits before temperature, as llama.cpp's chain applies it): ``p / p_max < min_p`` is
    ``logit - max_logit < ln(min_p)``."""
    rows = [i for i, p in enumerate(params) if p.min_p > 0 and not p.greedy]
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    part = logits.index_select(0, index)
    floor = part.max(dim=1, keepdim=True).values + _column(
        [math.log(params[i].min_p) for i in rows], logits
    )
    logits.index_copy_(0, index, part.masked_fill(part < floor, -math.inf))


def apply_logit_bias(logits: Tensor, biases: Sequence[dict[int, float]]) -> None:
    """Add each row's ``{token_id: bias}`` to its logits, in place (ids past V are ignored)."""
    rows, cols, values = [], [], []
    for row, bias in enumerate(biases):
        for token, value in bias.items():
            if token < logits.shape[1]:
                rows.append(row)
                cols.append(token)
                values.append(value)
    if not rows:
        return
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    logits.index_put_(
        index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True
    )


def apply_penalties(logits: Tensor, requests: Sequence[Request]) -> None:
    """OpenAI's presence and frequency penalties on the generated tokens, in place.

    ``logit[t] -= count[t] * frequency_penalty + (count[t] > 0) * presence_penalty``, where
    ``count[t]`` is how often the request has generated ``t`` (its prompt does not count).
    """
    rows = [
        i
        for i, r in enumerate(requests)
        if (r.params.presence_penalty or r.params.frequency_penalty) and r.output_ids
    ]
    if not rows:
        return
    vocab = logits.shape[1]
    counts = output_counts([requests[i].output_ids for i in rows], vocab, logits.device)
    presence = _column([requests[i].params.presence_penalty for i in rows], logits)
    frequency = _column([requests[i].params.frequency_penalty for i in rows], logits)
    penalty = counts * frequency + (counts > 0).to(logits.dtype) * presence  # [R, V]
    index = torch.tensor(rows, device=logits.device)
    logits.index_add_(0, index, -penalty)


def output_counts(outputs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> Tensor:
    """``[R, V]`` float32 counts of each token in each row's output ids (ids past V dropped)."""
    longest = max(len(ids) for ids in outputs)
    padded = torch.full((len(outputs), longest), vocab, dtype=torch.long)  # pad: column V
    for row, ids in enumerate(outputs):
        padded[row, : len(ids)] = torch.tensor(ids, dtype=torch.long).clamp_(max=vocab)
    counts = torch.zeros(len(outputs), vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.float32))
    return counts[:, :vocab].to(device)


def advance_grammars(requests: Sequence[Request]) -> list[int]:
    """Bring each grammar's state up to its request's output; the rows a grammar constrains
    this step (a lazy grammar's only once the reply has opened what it describes).

    Each request's state is created on its first step and consumes the tokens generated
    since the last one.
    """
    rows = []
    for row, req in enumerate(requests):
        grammar = req.params.grammar
        if grammar is None:
            continue
        if req.grammar_state is None:
            req.grammar_state = grammar.new_state()
        req.grammar_state.advance(req.output_ids)
        if req.grammar_state.active:
            rows.append(row)
    return rows


def apply_grammars(logits: Tensor, requests: Sequence[Request], rows: list[int]) -> None:
    """Mask the tokens each constrained row's grammar forbids next, in place (the rows
    :func:`advance_grammars` returned; the others are not touched)."""
    if not rows:
        return
    bitmask = allocate_bitmask(logits.shape[0], logits.shape[1])
    for row in rows:
        state = requests[row].grammar_state
        assert state is not None  # made by advance_grammars
        state.fill(bitmask, row)
    apply_bitmask(logits, bitmask, rows)


def _column(values: Sequence[float], like: Tensor) -> Tensor:
    """``[R, 1]`` tensor of per-row values."""
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)
