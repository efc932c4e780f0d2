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
from infer.engine.scheduler import SchedulerOutput
from infer.models.base import CausalLM
from infer.models.kv_cache import PagedKVCache
from infer.models.layers import AttnCapture, PagedContext, PrefillSpan


@dataclass
class RunnerOutput:
    """Next-token logits for the requests that get a token this step."""

    requests: list[Request] = field(default_factory=list)
    logits: Tensor | None = None  # [N, V] float32, row i for requests[i]
    attn: dict[str, Tensor] = field(default_factory=dict)  # request id → [H, S] last query row


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
        tables = [self.blocks.table(r.request_id) for r in seqs]
        size, nd = self.blocks.block_size, len(decode)
        ids, positions, slots, ends, last = [], [], [], [], []
        for r, table in zip(decode, tables, strict=False):
            ids.append(r.output_ids[-1])
            positions.append(r.num_cached)
            slots.append(table[r.num_cached // size] * size + r.num_cached % size)
            ends.append(r.num_cached + 1)
            last.append(len(ids) - 1)
        spans: list[PrefillSpan] = []
        for c, table in zip(chunks, tables[nd:], strict=True):
            spans.append(PrefillSpan(len(ids), c.length, c.start))
            ids += c.request.token_ids[c.start : c.start + c.length]
            span_positions = range(c.start, c.start + c.length)
            positions += span_positions
            slots += [table[p // size] * size + p % size for p in span_positions]
            ends.append(c.start + c.length)
            last.append(len(ids) - 1)
        device = self.model.device
        width = max((len(t) for t in tables[:nd]), default=0)
        ctx = PagedContext(
            cache=self.cache,
            slots=torch.tensor(slots, device=device),
            num_decode=nd,
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables[:nd]],
                                      dtype=torch.int32, device=device).reshape(nd, width),
            seq_lens=torch.tensor(ends[:nd], dtype=torch.int32, device=device),
            spans=spans,
            seq_blocks=[torch.tensor(t, device=device) for t in tables],
            seq_ends=ends,
            last_token=last,
            capture=_capture_for(seqs),
        )
        finishing = list(range(nd)) + [nd + i for i, c in enumerate(chunks) if c.completes_prompt]
        out = self.model.forward_paged(
            torch.tensor(ids, device=device), torch.tensor(positions, device=device), ctx,
            torch.tensor([last[i] for i in finishing], device=device, dtype=torch.long))
        for r in decode:
            r.num_cached += 1
        for c in chunks:
            c.request.num_cached += c.length
        for r in seqs:
            self.blocks.commit(r.request_id, r.token_ids, r.num_cached)
        requests = [seqs[i] for i in finishing]
        return RunnerOutput(requests, out.logits, _trace_rows(requests, out.attn, finishing))

def _capture_for(requests: list[Request]) -> AttnCapture | None:
    layers = frozenset(
        r.trace.layer for r in requests if r.trace is not None and r.trace.layer is not None
    )
    return AttnCapture(layers) if layers else None


def _trace_rows(
    requests: list[Request], attn: dict[int, list[Tensor]] | None, seqs: list[int]
) -> dict[str, Tensor]:
    """Each traced request's attention row ``[H, S]`` at its own layer."""
    rows: dict[str, Tensor] = {}
    if attn is None:
        return rows
    for r, seq in zip(requests, seqs, strict=True):
        if r.trace is not None and r.trace.layer is not None:
            rows[r.request_id] = attn[r.trace.layer][seq]
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
    device, size, n = model.device, cache.block_size, len(ids)
    positions = list(range(start, start + n))
    decode = n == 1 and start > 0
    span = PrefillSpan(0, n, start)
    ctx = PagedContext(
        cache=cache,
        slots=torch.tensor([table[p // size] * size + p % size for p in positions],
                           device=device),
        num_decode=1 if decode else 0,
        block_tables=torch.tensor([table] if decode else [], dtype=torch.int32,
                                  device=device).reshape(int(decode), -1 if decode else 0),
        seq_lens=torch.tensor([start + n] if decode else [], dtype=torch.int32, device=device),
        spans=[] if decode else [span],
        seq_blocks=[torch.tensor(table, device=device)],
        seq_ends=[start + n],
        last_token=[n - 1],
    )
    out = model.forward_paged(torch.tensor(ids, device=device),
                              torch.tensor(positions, device=device), ctx,
                              torch.tensor([n - 1], device=device))
    return out.logits[0]
