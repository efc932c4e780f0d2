"""One step's forward: every decode token and every prefill chunk, packed into one batch.

The batch is one row of ``N`` tokens, no padding: one token per decoding request, then each
prefill chunk's tokens. The linears see all of them at once (one large matmul per weight
per step); attention reads each sequence's own blocks of the paged KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from infer.engine.block_manager import BlockManager
from infer.engine.config import EngineConfig
from infer.engine.request import Request
from infer.engine.scheduler import PrefillChunk, SchedulerOutput
from infer.models.base import CausalLM
from infer.models.context import AttnCapture, SequenceSlice, paged_context
from infer.models.kv_cache import PagedKVCache


@dataclass
class PromptRows:
    """Logits of prompt positions ``[start, start + R)`` of a request that scores its prompt:
    row ``i`` is the distribution of prompt token ``start + i + 1``."""

    request: Request
    start: int
    logits: Tensor  # [R, V] float32


@dataclass
class RunnerOutput:
    """Next-token logits for the requests that get tokens this step, and the prompt rows
    of the requests that score their prompts.

    Each request in ``requests`` owns ``1 + len(request.draft)`` consecutive rows of
    ``logits``: row ``j`` is the distribution of the token after its ``j``-th draft token
    (row 0: after its last token).
    """

    requests: list[Request] = field(default_factory=list)
    logits: Tensor | None = None  # [R, V] float32
    attn: list[Tensor | None] = field(default_factory=list)  # per row: [H, S] for a trace
    prompt_rows: list[PromptRows] = field(default_factory=list)


class ModelRunner:
    """Owns the KV cache; turns a step's plan into one packed forward."""

    def __init__(self, model: CausalLM, config: EngineConfig, blocks: BlockManager) -> None:
        self.model = model
        self.config = config
        self.blocks = blocks
        self.cache = PagedKVCache(
            model.config, blocks.num_blocks, blocks.block_size, model.dtype, model.device
        )

    @torch.inference_mode()
    def run(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run the step; decoding requests and requests whose prompt completes get logits.

        Each request's ``num_cached`` grows by the tokens it ran, and its full blocks are
        offered to the prefix cache.
        """
        decode, chunks = plan.decode, plan.prefill
        seqs = [*decode, *(c.request for c in chunks)]
        ids: list[int] = []
        slices: list[SequenceSlice] = []
        owners: list[Request] = []  # each decode row's request
        for r in decode:
            # The last token and the draft: each its own decode row, attending to the
            # sequence up to itself (their keys are all stored before any row attends).
            run = [r.output_ids[-1], *r.draft]
            table = self.blocks.table(r.request_id)
            ids += run
            slices += [SequenceSlice(table, r.num_cached + j, 1) for j in range(len(run))]
            owners += [r] * len(run)
        nd = len(slices)
        for c in chunks:
            ids += c.request.token_ids[c.start : c.start + c.length]
            slices.append(SequenceSlice(self.blocks.table(c.request.request_id), c.start, c.length))
        device = self.model.device
        ctx, positions = paged_context(self.cache, slices, nd, device, _capture_for(seqs))
        # Rows that get logits: every decode row, then the last token of each prompt
        # that completes.
        last = ctx.last_token
        completing = [c.request for c in chunks if c.completes_prompt]
        finishing = list(range(nd)) + [nd + i for i, c in enumerate(chunks) if c.completes_prompt]
        rows = [last[i] for i in finishing]
        scored = _scored_spans(chunks, last[nd:])
        for _, _, first_row, count in scored:
            rows += range(first_row, first_row + count)
        out = self.model.forward_paged(
            torch.tensor(ids, device=device),
            positions,
            ctx,
            torch.tensor(rows, device=device, dtype=torch.long),
        )
        for r in decode:
            r.num_cached += 1  # its last token; the draft tokens it keeps count later
        for c in chunks:
            c.request.num_cached += c.length
        for r in seqs:
            self.blocks.commit(r.request_id, r.token_ids, r.num_cached)
        logits, extra = out.logits[: len(finishing)], out.logits[len(finishing) :]
        prompt_rows = []
        for req, start, _, count in scored:
            prompt_rows.append(PromptRows(req, start, extra[:count]))
            extra = extra[count:]
        attn = _trace_rows(owners + completing, out.attn, finishing)
        return RunnerOutput(list(decode) + completing, logits, attn, prompt_rows)


def _scored_spans(
    chunks: list[PrefillChunk], last_rows: list[int]
) -> list[tuple[Request, int, int, int]]:
    """The prompt positions whose logits score a prompt token this step, per chunk of a
    request that scores its prompt: ``(request, first position, its batch row, count)``.

    Position ``p`` scores prompt token ``p + 1``; positions already scored (before a
    preemption) are not scored again.
    """
    spans = []
    for c, last in zip(chunks, last_rows, strict=True):
        req = c.request
        first = max(c.start, req.unscored)
        end = min(c.start + c.length, req.prompt_len - 1)
        if end > first:
            row = last - (c.length - 1) + (first - c.start)  # the chunk's rows end at last
            spans.append((req, first, row, end - first))
    return spans


def _capture_for(requests: list[Request]) -> AttnCapture | None:
    layers = frozenset(
        r.trace.layer for r in requests if r.trace is not None and r.trace.layer is not None
    )
    return AttnCapture(layers) if layers else None


def _trace_rows(
    owners: list[Request], attn: dict[int, list[Tensor]] | None, seqs: list[int]
) -> list[Tensor | None]:
    """Per logits row (its request in ``owners``, its sequence slice in ``seqs``): the
    attention row ``[H, S]`` at the request's trace layer, or ``None``."""
    rows: list[Tensor | None] = []
    for r, seq in zip(owners, seqs, strict=True):
        traced = attn is not None and r.trace is not None and r.trace.layer is not None
        rows.append(attn[r.trace.layer][seq] if traced else None)  # type: ignore[index,union-attr]
    return rows


def forward_sequence(
    model: CausalLM, cache: PagedKVCache, table: list[int], ids: list[int], start: int
) -> Tensor:
    """Run one sequence's tokens ``ids`` (at positions ``start...``) over its blocks.

    The single-request path (:func:`infer.engine.generate.generate`, the baselines): one
    token runs as a decode, more as a prefill span.

    Returns:
        ``[V]`` float32 logits of the last token.
    """
    n = len(ids)
    decode = n == 1 and start > 0
    ctx, positions = paged_context(
        cache, [SequenceSlice(table, start, n)], int(decode), model.device
    )
    out = model.forward_paged(
        torch.tensor(ids, device=model.device),
        positions,
        ctx,
        torch.tensor([n - 1], device=model.device),
    )
    return out.logits[0]
