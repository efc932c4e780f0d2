"""One step's forwards over the KV cache: decode tokens together, prefill chunks together.

Cache rows are kept in a fixed order: every decoding request sits in rows ``0..num_decode-1``
and prompts still being prefilled sit after them. The decode forward then reads the cache
through a slice (a view) instead of gathering rows, which at batch 16 would copy the whole
attended cache every step. Keeping the order costs at most two row copies when a request
leaves and one swap when a prompt finishes prefilling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from infer.engine.config import EngineConfig
from infer.engine.request import Request
from infer.engine.scheduler import PrefillChunk, SchedulerOutput
from infer.models.base import CausalLM
from infer.models.kv_cache import KVCache
from infer.models.layers import AttnCapture


@dataclass
class RunnerOutput:
    """Next-token logits for the requests that get a token this step."""

    requests: list[Request] = field(default_factory=list)
    logits: Tensor | None = None  # [N, V] float32, row i for requests[i]
    attn: dict[str, Tensor] = field(default_factory=dict)  # request id → [H, S] last query row


class ModelRunner:
    """Owns the KV cache and which request lives in which row of it."""

    def __init__(self, model: CausalLM, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.cache = KVCache(
            model.config, config.max_batch_size, config.max_seq_len, model.dtype, model.device
        )
        self.slots: list[Request] = []  # row → request
        self._rows: dict[str, int] = {}  # request id → row
        self.num_decode = 0

    @property
    def num_rows_used(self) -> int:
        return len(self.slots)

    @torch.inference_mode()
    def run(self, plan: SchedulerOutput) -> RunnerOutput:
        """Run the decode forward and the prefill forward of one step.

        Requests whose prompt completes in this step's prefill move to decode rows; their
        first token is sampled from the returned logits, as is every decode request's next one.
        """
        for chunk in plan.prefill:
            if chunk.request.request_id not in self._rows:
                self._assign(chunk.request)
        parts = [self._decode(plan.decode), self._prefill(plan.prefill)]
        parts = [p for p in parts if p.requests]
        for chunk in plan.prefill:
            chunk.request.num_cached += chunk.length
            if chunk.completes_prompt:
                self._promote(chunk.request)
        if len(parts) <= 1:
            return parts[0] if parts else RunnerOutput()
        out = RunnerOutput([r for p in parts for r in p.requests])
        out.logits = torch.cat([p.logits for p in parts if p.logits is not None])
        for p in parts:
            out.attn.update(p.attn)
        return out

    def free(self, request: Request) -> None:
        """Give the request's row back, keeping decode rows first and contiguous."""
        row = self._rows.pop(request.request_id, None)
        if row is None:
            return
        last = len(self.slots) - 1
        if row < self.num_decode:
            last_decode = self.num_decode - 1
            self._move(last_decode, row)
            if last > last_decode:
                self._move(last, last_decode)
            self.num_decode -= 1
        else:
            self._move(last, row)
        self.slots.pop()

    def _decode(self, requests: list[Request]) -> RunnerOutput:
        if not requests:
            return RunnerOutput()
        requests = sorted(requests, key=lambda r: self._rows[r.request_id])
        rows = [self._rows[r.request_id] for r in requests]
        pos = [r.num_cached for r in requests]
        device = self.model.device
        ids = torch.tensor([[r.output_ids[-1]] for r in requests], device=device)
        positions = torch.tensor(pos, device=device).unsqueeze(1)
        capture = _capture_for(requests)
        out = self.model(ids, positions, self.cache, rows, capture=capture, kv_len=max(pos) + 1)
        for r in requests:
            r.num_cached += 1
        attn = _trace_rows(requests, out.attn, [0] * len(requests), pos)
        return RunnerOutput(requests, out.logits[:, 0], attn)

    def _prefill(self, chunks: list[PrefillChunk]) -> RunnerOutput:
        if not chunks:
            return RunnerOutput()
        width = max(c.length for c in chunks)
        ids, positions = [], []
        for c in chunks:
            pad = width - c.length
            ids.append(c.request.prompt_ids[c.start : c.start + c.length] + [0] * pad)
            positions.append(list(range(c.start, c.start + c.length)) + [-1] * pad)
        device = self.model.device
        rows = [self._rows[c.request.request_id] for c in chunks]
        last = [c.length - 1 for c in chunks]
        done = [c for c in chunks if c.completes_prompt]
        out = self.model(
            torch.tensor(ids, device=device),
            torch.tensor(positions, device=device),
            self.cache,
            rows,
            logits_index=torch.tensor(last, device=device),
            capture=_capture_for([c.request for c in done]),
            kv_len=max(c.start + c.length for c in chunks),
        )
        keep = [i for i, c in enumerate(chunks) if c.completes_prompt]
        requests = [chunks[i].request for i in keep]
        end_pos = [chunks[i].start + chunks[i].length - 1 for i in keep]
        attn = _trace_rows(requests, _select(out.attn, keep), [last[i] for i in keep], end_pos)
        return RunnerOutput(requests, out.logits[keep], attn)

    def _assign(self, request: Request) -> None:
        if len(self.slots) >= self.cache.max_batch_size:
            raise RuntimeError("no free KV cache row (scheduler admitted too many requests)")
        self._rows[request.request_id] = len(self.slots)
        self.slots.append(request)

    def _promote(self, request: Request) -> None:
        row, first_prefill = self._rows[request.request_id], self.num_decode
        if row != first_prefill:
            other = self.slots[first_prefill]
            self.cache.swap_rows(row, first_prefill, request.num_cached, other.num_cached)
            self.slots[row], self.slots[first_prefill] = other, request
            self._rows[other.request_id], self._rows[request.request_id] = row, first_prefill
        self.num_decode += 1

    def _move(self, src: int, dst: int) -> None:
        if src == dst:
            return
        request = self.slots[src]
        self.cache.copy_row(src, dst, request.num_cached)
        self.slots[dst] = request
        self._rows[request.request_id] = dst


def _capture_for(requests: list[Request]) -> AttnCapture | None:
    layers = frozenset(
        r.trace.layer for r in requests if r.trace is not None and r.trace.layer is not None
    )
    return AttnCapture(layers) if layers else None


def _select(attn: dict[int, Tensor] | None, keep: list[int]) -> dict[int, Tensor] | None:
    return None if attn is None else {k: v[keep] for k, v in attn.items()}


def _trace_rows(
    requests: list[Request], attn: dict[int, Tensor] | None, query: list[int], pos: list[int]
) -> dict[str, Tensor]:
    """Each traced request's attention row ``[H, pos + 1]`` at its own layer."""
    rows: dict[str, Tensor] = {}
    if attn is None:
        return rows
    for i, r in enumerate(requests):
        if r.trace is not None and r.trace.layer is not None:
            rows[r.request_id] = attn[r.trace.layer][i, :, query[i], : pos[i] + 1]
    return rows
