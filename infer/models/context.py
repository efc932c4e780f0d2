"""Per-forward state: which tokens run where, the masks and the paged cache's block tables.

A plain forward (no cache) runs ``[B, T]`` right-padded rows under a :class:`ForwardContext`.
A packed forward over the paged KV cache runs ``N`` tokens in one row under a
:class:`PagedContext`, which :func:`paged_context` builds from the slices of sequences that
run: the engine's steps and the single-request loop both build it there.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from infer.models.kv_cache import PagedKVCache


@dataclass
class AttnCapture:
    """Ask some layers to hand back their attention probabilities ``[B, H, T, S]`` (float32)."""

    layers: frozenset[int]
    # layer → [B, H, T, S] from a plain forward; from a paged one, each sequence's
    # [H, S] row for its last token (decode sequences first, then prefill spans).
    probs: dict[int, Any] = field(default_factory=dict)


@dataclass
class ForwardContext:
    """Per-forward state of a plain forward (no cache): ``[B, T]`` rows, right-padded."""

    positions: Tensor  # [B, T], -1 marks padding
    rope: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    masks: dict[str, Tensor] = field(default_factory=dict)  # [B, 1, T, T] bool, True = attend
    capture: AttnCapture | None = None


@dataclass
class PrefillSpan:
    """One sequence's prompt tokens in a packed batch.

    Tokens ``[offset, offset + length)`` of the batch sit at positions ``[start, start +
    length)``. A span that starts past 0 also attends to the sequence's cached tokens.
    """

    offset: int
    length: int
    start: int
    masks: dict[str, Tensor] = field(default_factory=dict)  # kind → [T, S], built on demand

    def mask(self, kind: str, window: int, device: torch.device) -> Tensor | None:
        """``[T, S]`` for a span that attends past its own tokens or through a window (``None``:
        plain causal over its own tokens); built once per layer kind, only where needed (the
        CPU prefill kernel masks by position itself)."""
        if self.start == 0 and not window:
            return None
        if kind not in self.masks:
            q_pos = torch.arange(self.start, self.start + self.length, device=device)[None]
            k_pos = torch.arange(self.start + self.length, device=device)[None]
            self.masks[kind] = build_mask(q_pos, k_pos, None, window or None)[0, 0]
        return self.masks[kind]


@dataclass
class PagedContext:
    """Per-forward state of a packed forward over the paged KV cache.

    The batch is ``N`` tokens in one row: first one decode token of each of ``num_decode``
    sequences, then the prefill spans. Decode attention reads the pool through block
    tables; so do the prefill spans, through theirs, on CPU in bf16 (their own keys are
    stored first); elsewhere each span attends with SDPA to its own tokens and cached prefix.
    """

    cache: PagedKVCache
    slots: Tensor  # [N] int64: where each new key and value goes, block * block_size + offset
    num_decode: int
    block_tables: Tensor  # [num_decode, max_blocks] int32
    seq_lens: Tensor  # [num_decode] int32: attended length, the new token included
    spans: list[PrefillSpan]
    seq_blocks: list[Tensor]  # every sequence's blocks (int64), decode ones first
    seq_ends: list[int]  # every sequence's attended length
    last_token: list[int]  # every sequence's last token in the batch
    windows: dict[str, int] = field(default_factory=dict)  # kind → sliding window (0: none)
    rope: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # float32 [N, D/2]
    capture: AttnCapture | None = None
    # The rows the last layer computes beyond its keys and values (those that get logits,
    # each its sequence's last token); None: every row. See CausalLM.forward_paged.
    keep: Tensor | None = None
    keep_layer: int = -1
    _span_arrays: tuple[Tensor, Tensor] | None = None

    def span_arrays(self) -> tuple[Tensor, Tensor]:
        """The spans' block tables ``[S, max_blocks]`` and ``(offset, length, start)`` rows
        ``[S, 3]``, int32, for the CPU prefill kernel (built once per forward)."""
        if self._span_arrays is None:
            tables = _block_tables(self.seq_blocks[self.num_decode :], torch.device("cpu"))
            info = torch.tensor(
                [[s.offset, s.length, s.start] for s in self.spans], dtype=torch.int32
            )
            self._span_arrays = (tables, info)
        return self._span_arrays

    def keep_arrays(self) -> tuple[Tensor, Tensor]:
        """Block tables ``[R, max_blocks]`` and attended lengths ``[R]`` (int32) of the
        sequences of the kept rows: each kept row attends to its sequence up to itself
        (usually it is the sequence's last token; a prompt being scored keeps them all)."""
        assert self.keep is not None
        seqs, lens = [], []
        for row in self.keep.tolist():
            i = bisect.bisect_left(self.last_token, row)  # rows of a sequence are contiguous
            seqs.append(i)
            lens.append(self.seq_ends[i] - (self.last_token[i] - row))
        device = self.slots.device
        tables = _block_tables([self.seq_blocks[i] for i in seqs], device)
        return tables, torch.tensor(lens, dtype=torch.int32, device=device)


def _block_tables(blocks: list[Tensor], device: torch.device) -> Tensor:
    """Sequences' block lists as one int32 table ``[S, max_blocks]``, zero-padded."""
    tables = torch.zeros(len(blocks), max(len(b) for b in blocks), dtype=torch.int32, device=device)
    for row, b in zip(tables, blocks, strict=True):
        row[: len(b)] = b
    return tables


def build_mask(q_pos: Tensor, k_pos: Tensor, k_valid: Tensor | None, window: int | None) -> Tensor:
    """Boolean mask ``[B, 1, T, S]``: causal by position, optionally windowed.

    A padded query (position -1) is given position 0 so its row is never all-masked (a fully
    masked softmax yields NaN); its output is thrown away.
    """
    q = q_pos.clamp(min=0).unsqueeze(-1)  # [B, T, 1]
    k = k_pos.unsqueeze(-2)  # [B or 1, 1, S]
    mask = k <= q
    if window is not None:
        mask &= k > q - window
    if k_valid is not None:
        mask &= k_valid.unsqueeze(-2)
    return mask.unsqueeze(1)


@dataclass
class SequenceSlice:
    """Tokens ``[start, start + length)`` of one sequence, run this forward over its blocks."""

    blocks: list[int]
    start: int
    length: int


def paged_context(
    cache: PagedKVCache,
    slices: Sequence[SequenceSlice],
    num_decode: int,
    device: torch.device,
    capture: AttnCapture | None = None,
) -> tuple[PagedContext, Tensor]:
    """The context of one packed forward, and its tokens' positions ``[N]``.

    Args:
        cache: The paged KV cache.
        slices: The sequences that run, in batch order: ``num_decode`` decode tokens (one
            token each) first, then prefill spans.
        num_decode: How many of ``slices`` decode.
        device: Where the forward runs.
        capture: Layers whose attention rows to keep (traces).
    """
    size = cache.block_size
    positions: list[int] = []
    slots: list[int] = []
    ends: list[int] = []
    last: list[int] = []
    spans: list[PrefillSpan] = []
    for i, s in enumerate(slices):
        if i >= num_decode:
            spans.append(PrefillSpan(len(positions), s.length, s.start))
        span = range(s.start, s.start + s.length)
        positions += span
        slots += [s.blocks[p // size] * size + p % size for p in span]
        ends.append(s.start + s.length)
        last.append(len(positions) - 1)
    tables = [s.blocks for s in slices[:num_decode]]
    width = max((len(t) for t in tables), default=0)
    ctx = PagedContext(
        cache=cache,
        slots=torch.tensor(slots, device=device),
        num_decode=num_decode,
        block_tables=torch.tensor(
            [t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device
        ).reshape(num_decode, width),
        seq_lens=torch.tensor(ends[:num_decode], dtype=torch.int32, device=device),
        spans=spans,
        seq_blocks=[torch.tensor(s.blocks, device=device) for s in slices],
        seq_ends=ends,
        last_token=last,
        capture=capture,
    )
    return ctx, torch.tensor(positions, device=device)
