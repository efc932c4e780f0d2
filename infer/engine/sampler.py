"""Batched next-token sampling, each row by its own :class:`SamplingParams`.

The engine calls :func:`sample` once per step on the ``[B, V]`` logits of the last
position of every running sequence. Each row is processed with its own parameters,
generator and token history only, so a seeded request gives the same tokens whatever
else shares its batch. A batch that is all greedy with no repetition penalty (the common
case) is one ``argmax``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import Tensor

from infer import kernels
from infer.engine.params import SamplingParams

# Top-p first looks for its nucleus among this many most likely tokens.
_NUCLEUS_CANDIDATES = 256
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """Build a request's private random generator.

    Args:
        seed: The request's seed; ``None`` for no private generator.
        device: Device the logits live on (a generator must match it).

    Returns:
        A seeded generator, or ``None`` so that sampling falls back to the global RNG.
    """
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def apply_repetition_penalty(logits: Tensor, history: Sequence[int], penalty: float) -> Tensor:
    """Penalise every token id seen in ``history`` (Hugging Face semantics).

    Positive logits are divided by ``penalty`` and negative ones multiplied by it, so
    a penalty > 1 always makes a seen token less likely. Each id counts once however
    often it was seen.

    Args:
        logits: ``[V]`` float logits of one row.
        history: Prompt and generated token ids of that row.
        penalty: The penalty; 1 returns ``logits`` unchanged.

    Returns:
        A new ``[V]`` tensor (or ``logits`` itself when there is nothing to do).
    """
    if penalty == 1.0 or not history:
        return logits
    ids = torch.tensor(sorted(set(history)), dtype=torch.long, device=logits.device)
    # Ids past the logits' width (tokenizer added tokens the head lacks) cannot be sampled.
    ids = ids[(ids >= 0) & (ids < logits.shape[-1])]
    seen = logits[ids]
    out = logits.clone()
    out[ids] = torch.where(seen < 0, seen * penalty, seen / penalty)
    return out


def _nucleus(probs: Tensor, p: float) -> tuple[Tensor, Tensor]:
    """The tokens top-p keeps: ``(probs [n], ids [n])``, most likely first.

    Sorting the whole vocabulary costs milliseconds on CPU; the nucleus nearly always
    lies within the few hundred most likely tokens, so look there first.
    """
    n = min(_NUCLEUS_CANDIDATES, probs.shape[-1])
    values, ids = torch.topk(probs, n)
    cum = torch.cumsum(values, dim=-1)
    if n < probs.shape[-1] and float(cum[-1]) < p:  # a flat distribution: look wider
        values, ids = torch.sort(probs, descending=True)
        cum = torch.cumsum(values, dim=-1)
    # A token is dropped once the tokens before it already hold mass >= p.
    keep = max(1, int((cum - values < p).sum()))
    return values[:keep], ids[:keep]


def _candidates(
    logits: Tensor, params: SamplingParams, history: Sequence[int]
) -> tuple[Tensor, Tensor | None]:
    """Penalty, temperature, top-k and top-p: what one sampling row draws from.

    Returns:
        ``(weights [n], ids [n])``; ``ids`` is ``None`` when ``n == V`` (no truncation).
        Weights need not sum to 1.
    """
    logits = apply_repetition_penalty(logits, history, params.repetition_penalty)
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        # Same as apply_top_k then apply_top_p, working on the k survivors only.
        values, ids = torch.topk(logits, params.top_k)
        probs = torch.softmax(values, dim=-1)
        if params.top_p < 1.0:
            probs, order = _nucleus(probs, params.top_p)
            ids = ids[order]
        return probs, ids
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        return _nucleus(probs, params.top_p)
    return probs, None


def _draw(weights: Tensor, generator: torch.Generator | None) -> int:
    """Draw one index in proportion to ``weights`` ``[n]`` by inverting the CDF.

    One uniform and a binary search: cheaper than ``torch.multinomial`` on a CPU
    vocabulary, and just as reproducible with a seeded generator.
    """
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=weights.device)
    # right=True skips zero-weight entries: their CDF equals their predecessor's.
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if index == weights.shape[-1]:  # u * total rounded up to the total itself
        index = int(torch.nonzero(weights).max())
    return index


def _sample_row(
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
    history: Sequence[int],
) -> int:
    """Pick one token for one row that is not plain greedy."""
    if params.greedy or abs(float(logits.max())) / params.temperature >= _FLOAT32_MAX:
        # Greedy, or a temperature so small that logit / t overflows: its limit is greedy.
        penalized = apply_repetition_penalty(logits, history, params.repetition_penalty)
        return int(torch.argmax(penalized))
    weights, ids = _candidates(logits, params, history)
    index = _draw(weights, generator)
    return index if ids is None else int(ids[index])


def sample(
    logits: Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[Sequence[int]],
) -> list[int]:
    """Pick the next token of every row of a batch.

    A row's token depends only on its own logits, parameters, generator and history,
    never on the other rows. Rows that are greedy without a penalty share one argmax;
    the others are processed one by one in float32.

    Args:
        logits: ``[B, V]`` logits of the last position of each sequence.
        params: Sampling parameters of each row.
        generators: Each row's generator, or ``None`` for the global RNG.
        histories: Each row's prompt + generated ids (for the repetition penalty).

    Returns:
        The ``B`` chosen token ids.

    Raises:
        ValueError: ``logits`` is not 2-D or the sequences do not all have ``B`` items.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, V], got shape {tuple(logits.shape)}")
    batch = logits.shape[0]
    if not (len(params) == len(generators) == len(histories) == batch):
        raise ValueError(
            f"need one params, generator and history per row: B={batch}, got "
            f"{len(params)}, {len(generators)}, {len(histories)}"
        )
    plain = [p.greedy and p.repetition_penalty == 1.0 for p in params]
    # float32 is exact for bf16/fp16 values, and it is what the CPU kernels take.
    logits = logits.float()  # [B, V]
    tokens: list[int] = _argmax(logits).tolist()
    rows = [row for row in range(batch) if not plain[row]]
    if not rows:
        return tokens
    if logits.device.type == "cpu" and logits.stride(-1) == 1:
        picked = _sample_rows(logits, rows, params, generators, histories)
        for row, token in zip(rows, picked, strict=True):
            tokens[row] = token
        return tokens
    for row in rows:
        tokens[row] = _sample_row(logits[row], params[row], generators[row], histories[row])
    return tokens


def _sample_rows(
    logits: Tensor,
    rows: list[int],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[Sequence[int]],
) -> list[int]:
    """The given rows by the CPU kernel, all in one call: the rules of :func:`_sample_row`
    (penalty, temperature, top-k, top-p, one uniform from the row's generator per draw).

    One call instead of a dozen torch ops per row (and a sort of the whole vocabulary when
    top-p meets a flat distribution): the kernel sorts only the top tokens.
    """
    chosen = [params[row] for row in rows]
    uniform = [
        0.0 if p.greedy else float(torch.rand(1, generator=generators[row], dtype=torch.float64))
        for row, p in zip(rows, chosen, strict=True)
    ]
    seen: list[int] = []
    offsets = [0]
    for row, p in zip(rows, chosen, strict=True):
        if p.repetition_penalty != 1.0:
            seen.extend(histories[row])
        offsets.append(len(seen))
    picked = kernels.ops().sample_rows(
        logits,
        torch.tensor(rows, dtype=torch.long),
        torch.tensor([p.temperature for p in chosen], dtype=torch.float32),
        torch.tensor([p.top_k for p in chosen], dtype=torch.long),
        torch.tensor([p.top_p for p in chosen], dtype=torch.float64),
        torch.tensor([p.repetition_penalty for p in chosen], dtype=torch.float32),
        torch.tensor(seen, dtype=torch.long),
        torch.tensor(offsets, dtype=torch.long),
        torch.tensor(uniform, dtype=torch.float64),
    )
    return cast(list[int], picked.tolist())


def _argmax(logits: Tensor) -> Tensor:
    """``torch.argmax(logits, dim=-1)``; on the CPU by the kernel (its rows split over the
    threads), cheaper than torch's on a decode step's logits."""
    if logits.device.type == "cpu" and logits.stride(-1) == 1:
        return cast(Tensor, kernels.ops().argmax_rows(logits))
    return torch.argmax(logits, dim=-1)


def sample_token(
    logits: Tensor,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    history: Sequence[int] = (),
) -> int:
    """Pick the next token of a single sequence (see :func:`sample`).

    Args:
        logits: ``[V]`` logits of the last position.
        params: The request's sampling parameters.
        generator: The request's generator, or ``None`` for the global RNG.
        history: Prompt + generated ids so far.

    Returns:
        The chosen token id.

    Raises:
        ValueError: ``logits`` is not 1-D.
    """
    if logits.dim() != 1:
        raise ValueError(f"logits must be [V], got shape {tuple(logits.shape)}")
    return sample(logits.unsqueeze(0), [params], [generator], [history])[0]


def token_logprobs(
    logits: Tensor, tokens: Sequence[int], k: int
) -> list[tuple[float, list[tuple[int, float]]]]:
    """Log-probabilities of the chosen tokens and of each row's top ``k`` tokens.

    Computed from the raw logits (before penalty, temperature and truncation), as the
    OpenAI API reports them.

    Args:
        logits: ``[B, V]`` raw logits.
        tokens: The ``B`` chosen token ids.
        k: How many top alternatives to report per row (0 for none).

    Returns:
        Per row, ``(chosen_logprob, [(token_id, logprob), ...])`` with the list sorted by
        decreasing logprob.

    Raises:
        ValueError: Shapes disagree or ``k`` is out of ``[0, V]``.
    """
    if logits.dim() != 2 or logits.shape[0] != len(tokens):
        raise ValueError(
            f"need [B, V] logits and B tokens, got {tuple(logits.shape)} and {len(tokens)}"
        )
    if not (0 <= k <= logits.shape[1]):
        raise ValueError(f"k must be in [0, {logits.shape[1]}], got {k}")
    logp = torch.log_softmax(logits.float(), dim=-1)  # [B, V]
    index = torch.tensor(tokens, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen: list[float] = logp.gather(1, index).squeeze(1).tolist()
    if k == 0:
        return [(c, []) for c in chosen]
    top = torch.topk(logp, k, dim=-1)
    ids: list[list[int]] = top.indices.tolist()
    values: list[list[float]] = top.values.tolist()
    return [(c, list(zip(i, v, strict=True))) for c, i, v in zip(chosen, ids, values, strict=True)]


def ranked_logprobs(
    logits: Tensor, tokens: Sequence[int], k: int
) -> list[tuple[float, int, list[tuple[int, float]]]]:
    """Log-probabilities of given tokens, their ranks, and each row's top ``k`` tokens.

    Computed in float32 with a log-softmax over the whole vocabulary (prompt scoring).

    Args:
        logits: ``[R, V]`` raw logits.
        tokens: The ``R`` tokens to score.
        k: How many top alternatives to report per row (0 for none).

    Returns:
        Per row, ``(logprob, rank, [(token_id, logprob), ...])``: rank 1 is the likeliest
        token (ties share the better rank); the list is sorted by decreasing logprob.
    """
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    index = torch.tensor(tokens, dtype=torch.long, device=logits.device).unsqueeze(1)
    chosen = logp.gather(1, index)  # [R, 1]
    ranks: list[int] = ((logp > chosen).sum(dim=1) + 1).tolist()
    values: list[float] = chosen.squeeze(1).tolist()
    if k == 0:
        return [(v, r, []) for v, r in zip(values, ranks, strict=True)]
    top = torch.topk(logp, k, dim=-1)
    ids: list[list[int]] = top.indices.tolist()
    tops: list[list[float]] = top.values.tolist()
    return [
        (v, r, list(zip(i, t, strict=True)))
        for v, r, i, t in zip(values, ranks, ids, tops, strict=True)
    ]
