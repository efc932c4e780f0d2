"""Building blocks shared by every family: norms, rotary embeddings, attention, MLP.

Attribute names match Hugging Face checkpoint keys (``q_proj``, ``input_layernorm``...), so
weights load by name. Shapes: B = batch rows, T = new tokens per row, S = attended KV length,
H = query heads, K = KV heads, D = head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infer import kernels
from infer.models.config import ModelConfig, RopeConfig
from infer.models.kv_cache import PagedKVCache, keys_of, values_of


class RMSNorm(nn.Module):
    """RMSNorm; ``offset=1`` gives Gemma's ``x * (1 + w)`` computed in float32."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type == "cpu":
            # Strided views too (Qwen3's and Gemma3's q and k heads, a view of the packed
            # qkv rows, are strided except at one row): the same kernel for every row count
            # keeps outputs independent of the batch.
            return kernels.ops().rms_norm(x.contiguous(), self.weight, self.eps, self.offset)
        if self.offset == 0.0:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        out = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (out * (self.offset + self.weight.float())).type_as(x)

    def add_forward(self, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
        """``residual + x`` and its norm, in one pass on CPU: ``(norm, new residual)``.

        Both inputs are overwritten (they are a layer's fresh output and the running sum).
        """
        if x.device.type == "cpu":
            kernels.ops().add_rms_norm(x, residual, self.weight, self.eps, self.offset)
            return x, residual
        residual = residual + x
        return self(residual), residual


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> Tensor:
    """Inverse frequencies ``[D/2]`` (float32), with linear or Llama 3 scaling applied."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos and signed sin ``[B, T, 1, D]`` for the given positions ``[B, T]``."""
    return rope_tables(*rope_angles(inv_freq, positions), dtype)


def rope_tables(cos: Tensor, sin: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """:func:`apply_rope`'s cos and signed sin ``[..., 1, D]`` from half-size angles.

    The sin's first half is negated so that :func:`apply_rope` can rotate with one ``roll``.
    """
    full_cos = torch.cat((cos, cos), dim=-1).unsqueeze(-2)
    signed_sin = torch.cat((-sin, sin), dim=-1).unsqueeze(-2)
    return full_cos.to(dtype), signed_sin.to(dtype)


def rope_angles(inv_freq: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """float32 cos and sin ``[..., D/2]`` of tokens at ``positions`` (any shape)."""
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq
    return freqs.cos(), freqs.sin()


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate ``x`` ``[B, T, H, D]`` (the half-split layout Hugging Face checkpoints use).

    ``roll`` turns ``[x1, x2]`` into ``[x2, x1]``; times ``[-sin, sin]`` that is
    ``rotate_half(x) * sin``, in three ops instead of six.
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


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
            info = torch.tensor([[s.offset, s.length, s.start] for s in self.spans],
                                dtype=torch.int32)
            self._span_arrays = (tables, info)
        return self._span_arrays

    def keep_arrays(self) -> tuple[Tensor, Tensor]:
        """Block tables ``[R, max_blocks]`` and attended lengths ``[R]`` (int32) of the
        sequences of the kept rows: each kept row is its sequence's last token."""
        assert self.keep is not None
        seq_of = {row: i for i, row in enumerate(self.last_token)}
        seqs = [seq_of[row] for row in self.keep.tolist()]
        device = self.slots.device
        tables = _block_tables([self.seq_blocks[i] for i in seqs], device)
        lens = torch.tensor([self.seq_ends[i] for i in seqs], dtype=torch.int32, device=device)
        return tables, lens


def _block_tables(blocks: list[Tensor], device: torch.device) -> Tensor:
    """Sequences' block lists as one int32 table ``[S, max_blocks]``, zero-padded."""
    tables = torch.zeros(len(blocks), max(len(b) for b in blocks), dtype=torch.int32,
                         device=device)
    for row, b in zip(tables, blocks, strict=True):
        row[: len(b)] = b
    return tables


def kept_rows(residual: Tensor, attn_out: Tensor, ctx: ForwardContext | PagedContext) -> Tensor:
    """``residual`` cut to the rows the attention returned (all of them but in the last
    layer of a paged forward that keeps only the rows getting logits)."""
    if isinstance(ctx, PagedContext) and ctx.keep is not None and \
            attn_out.shape[0] != residual.shape[0]:
        return residual.index_select(0, ctx.keep)
    return residual


def paged_decode_attention_reference(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor, seq_lens: Tensor,
    scale: float, window: int,
) -> Tensor:
    """What the C++ decode kernel computes, in torch ops (other devices; tests).

    Args:
        q: ``[N, H, D]`` one query token per sequence.
        k_cache: ``[blocks, K, D/2, block_size, 2]`` one layer's keys (see PagedKVCache).
        v_cache: ``[blocks, K, block_size/2, D, 2]`` one layer's values.
        block_tables: ``[N, max_blocks]`` int32.
        seq_lens: ``[N]`` int32 attended lengths (the query's own key included).
        scale: Score scale.
        window: Sliding window (0: none).

    Returns:
        ``[N, H, D]``.
    """
    n, h, d = q.shape
    kv = k_cache.shape[1]
    tables = block_tables.long()
    keys, values = keys_of(k_cache[tables]), values_of(v_cache[tables])  # [N, K, S, D]
    pos = torch.arange(keys.shape[2], device=q.device)
    lens = seq_lens.long().unsqueeze(1)
    mask = pos < lens
    if window:
        mask &= pos >= lens - window
    folded = q.reshape(n, kv, h // kv, d)  # each KV head's query group on the query axis
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask[:, None, None],
                                         scale=scale)
    return out.reshape(n, h, d)


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


class Attention(nn.Module):
    """Grouped-query attention over the KV cache, with optional per-head q/k norms."""

    def __init__(
        self,
        config: ModelConfig,
        layer_idx: int,
        qk_norm: bool = False,
        norm_offset: float = 0.0,
    ) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
        )
        self.layer_type = c.layer_types[layer_idx]
        scalar = c.query_pre_attn_scalar or c.head_dim
        self.scale = scalar**-0.5
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * c.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * c.head_dim, c.hidden_size, bias=bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, norm_offset) if qk_norm else None

    def fuse(self) -> None:
        """Replace q/k/v with one projection (one larger matmul per step instead of three)."""
        self.qkv_proj = _concat_linear(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj

    def _qkv(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Project and rotate: q ``[..., H, D]``, k and v ``[..., K, D]``."""
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(*x.shape[:-1], h + 2 * kv, d)
        cos, sin = rope
        if self.q_norm is not None and self.k_norm is not None:
            q = apply_rope(self.q_norm(qkv[..., :h, :]), cos, sin)
            k = apply_rope(self.k_norm(qkv[..., h : h + kv, :]), cos, sin)
        else:  # rotate q and k heads together: one set of ops instead of two
            qk = apply_rope(qkv[..., : h + kv, :], cos, sin)
            q, k = qk[..., :h, :], qk[..., h:, :]
        return q, k, qkv[..., h + kv :, :]

    def forward(self, x: Tensor, ctx: ForwardContext | PagedContext) -> Tensor:
        if isinstance(ctx, PagedContext):
            return self._forward_paged(x, ctx)
        b, t, _ = x.shape
        q, k, v = self._qkv(x, ctx.rope[self.layer_type])
        q, keys, values = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        mask = ctx.masks[self.layer_type]
        capture = ctx.capture if ctx.capture and self.layer_idx in ctx.capture.layers else None
        if capture is not None:
            out = self._attend_eager(q, keys, values, mask, capture)
        else:
            out = F.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
            ).transpose(1, 2)  # [B, T, H, D]
        return self.o_proj(out.reshape(b, t, -1))

    def _qkv_paged(self, x: Tensor, ctx: PagedContext) -> tuple[Tensor, Tensor, Tensor]:
        """Project, rotate and store this layer's keys and values: q, k, v ``[N, H or K, D]``.

        On CPU one kernel rotates q and k in place and writes k and v to the cache.
        """
        n, h, kv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        heads = qkv.view(n, h + 2 * kv, d)
        if self.q_norm is not None and self.k_norm is not None:
            heads[:, :h] = self.q_norm(heads[:, :h])
            heads[:, h : h + kv] = self.k_norm(heads[:, h : h + kv])
        cos, sin = ctx.rope[self.layer_type]
        layer = self.layer_idx
        if x.device.type == "cpu":
            kernels.ops().rope_and_cache(qkv, cos, sin, h, kv, *ctx.cache.layers[layer],
                                         ctx.slots)
        else:
            heads[:, : h + kv] = apply_rope(heads[:, : h + kv], *rope_tables(cos, sin, x.dtype))
            ctx.cache.write(layer, ctx.slots, heads[:, h : h + kv], heads[:, h + kv :])
        return heads[:, :h], heads[:, h : h + kv], heads[:, h + kv :]

    def _forward_paged(self, x: Tensor, ctx: PagedContext) -> Tensor:
        """``x`` is ``[N, hidden]``: decode tokens first, then prefill spans."""
        n, layer, window = x.shape[0], self.layer_idx, ctx.windows.get(self.layer_type, 0)
        q, k, v = self._qkv_paged(x, ctx)  # [N, H or K, D]
        if ctx.capture is not None and layer in ctx.capture.layers:
            ctx.capture.probs[layer] = self._last_rows(q, ctx, window)
        if ctx.keep is not None and layer == ctx.keep_layer:
            # Only the kept rows go on (each its sequence's last token): one query each over
            # its sequence, as a decode. Every row's key and value are stored above.
            out = self._decode_attention(q.index_select(0, ctx.keep), ctx,
                                         *ctx.keep_arrays(), window)  # [R, H, D]
            return self.o_proj(out.view(out.shape[0], -1))
        nd = ctx.num_decode
        decode = None
        if nd:
            decode = self._decode_attention(q[:nd], ctx, ctx.block_tables, ctx.seq_lens,
                                            window)  # [nd, H, D]
        if not ctx.spans and decode is not None:
            out = decode
        else:
            out = q.new_empty(n, self.num_heads, self.head_dim)
            if decode is not None:
                out[:nd] = decode
            if _bf16_kernels(q) and self.head_dim % 64 == 0 and ctx.cache.block_size == 16:
                # Every span at once, keys and values read from the cache (already stored).
                tables, info = ctx.span_arrays()
                kernels.ops().paged_prefill_attention(q, *ctx.cache.layers[layer], tables, info,
                                                      self.scale, window, out)
            else:
                for span in ctx.spans:
                    rows = slice(span.offset, span.offset + span.length)
                    out[rows] = self._attend_span(q[rows], k[rows], v[rows], span, ctx)
        return self.o_proj(out.view(n, -1))

    def _decode_attention(self, q: Tensor, ctx: PagedContext, tables: Tensor, lens: Tensor,
                          window: int) -> Tensor:
        """One query ``[S, H, D]`` per sequence over its blocks (the C++ kernel on CPU)."""
        attend = (kernels.ops().paged_decode_attention if q.device.type == "cpu"
                  else paged_decode_attention_reference)
        return attend(q, *ctx.cache.layers[self.layer_idx], tables, lens, self.scale, window)

    def _attend_span(self, q: Tensor, k: Tensor, v: Tensor, span: PrefillSpan,
                     ctx: PagedContext) -> Tensor:
        """SDPA of one span's queries ``[T, H, D]`` over its sequence so far."""
        if span.start == 0:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [K, T, D]
        else:
            seq = ctx.num_decode + ctx.spans.index(span)
            keys, values = ctx.cache.gather(self.layer_idx, ctx.seq_blocks[seq],
                                            span.start + span.length)
        window = ctx.windows.get(self.layer_type, 0)
        mask = span.mask(self.layer_type, window, q.device)
        # Contiguous, with each KV head repeated for its query heads: SDPA's CPU kernel runs
        # a 1024-token span in 16-21 ms per layer so, against 26-30 ms given strided views
        # and enable_gqa.
        groups = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).contiguous().unsqueeze(0),
            keys.repeat_interleave(groups, 0).unsqueeze(0),
            values.repeat_interleave(groups, 0).unsqueeze(0),
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
        )  # [1, H, T, D]
        return out[0].transpose(0, 1)

    def _last_rows(self, q: Tensor, ctx: PagedContext, window: int) -> list[Tensor]:
        """Each sequence's attention probabilities ``[H, S]`` for its last token (traces)."""
        rows = []
        groups = self.num_heads // self.num_kv_heads
        for blocks, end, last in zip(ctx.seq_blocks, ctx.seq_ends, ctx.last_token, strict=True):
            keys, _ = ctx.cache.gather(self.layer_idx, blocks, end)  # [K, S, D]
            keys = keys.repeat_interleave(groups, dim=0)  # [H, S, D]
            scores = torch.einsum("hd,hsd->hs", q[last].float(), keys.float()) * self.scale
            if window:
                scores[:, : max(0, end - window)] = float("-inf")
            rows.append(torch.softmax(scores, dim=-1))
        return rows

    def _attend_eager(
        self, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor, capture: AttnCapture
    ) -> Tensor:
        """Attention with its probabilities kept (for traces and inspection); ``[B, T, H, D]``."""
        groups = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scale  # [B, H, T, S]
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        capture.probs[self.layer_idx] = probs
        return torch.matmul(probs.to(values.dtype), values).transpose(1, 2)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with SiLU (Llama, Qwen) or tanh-GELU (Gemma)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=bias)
        self.up_proj = nn.Linear(h, i, bias=bias)
        self.down_proj = nn.Linear(i, h, bias=bias)
        if config.hidden_act not in ("silu", "swish", "gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported activation {config.hidden_act!r}")
        self.gelu = config.hidden_act.startswith("gelu")

    def fuse(self) -> None:
        """Replace gate/up with one projection."""
        self.gate_up_proj: nn.Module = _concat_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def pack_gated(self) -> None:
        """Let one bf16 kernel call project and gate (:class:`Bf16GatedLinear`) when it can."""
        proj = self.gate_up_proj
        if (isinstance(proj, nn.Linear) and _bf16_kernels(proj.weight)
                and proj.in_features % 2 == 0 and proj.out_features % 64 == 0):
            self.gate_up_proj = Bf16GatedLinear(proj, self.gelu)

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.gate_up_proj, Bf16GatedLinear):
            return self.down_proj(self.gate_up_proj(x))
        gate_up = self.gate_up_proj(x)
        if gate_up.device.type == "cpu":
            return self.down_proj(kernels.ops().gated_activation(gate_up, self.gelu))
        gate, up = gate_up.chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * up)


def _concat_linear(*parts: nn.Linear) -> nn.Linear:
    """One Linear whose output is the concatenation of ``parts``' outputs."""
    first = parts[0]
    out_features = sum(p.out_features for p in parts)
    bias = first.bias is not None
    fused = nn.Linear(first.in_features, out_features, bias=bias, device="meta")
    weight = torch.cat([p.weight for p in parts])
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
    return fused


# oneDNN picks its blocked weight layout for a typical row count; 64 measured best across
# 1, 16 and 64 rows here (a layout packed for 1 row is 30% slower at 16).
_PACK_ROWS_HINT = 64


def can_pack(weight: Tensor) -> bool:
    """Whether oneDNN can hold ``weight`` pre-packed (CPU, bf16 or fp32)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float32)
        and torch.backends.mkldnn.is_available()
    )


class PackedLinear(nn.Module):
    """A frozen ``Linear`` whose weight oneDNN reordered once, at load time.

    An eager bf16 ``F.linear`` on CPU reorders the weight into oneDNN's blocked layout on
    every call; for the small row counts of decode that copy costs as much as the matmul
    (the model's linears at 1 row: 18.4 ms eager vs 9.5 ms packed, one thread). This is
    the layout inductor's weight freezing produces, without compiling anything.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
        self.bias = bias

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _bf16_kernels(x: Tensor) -> bool:
    """Whether ``x`` can go through the AVX512-BF16 kernels (bf16 on a CPU that has them)."""
    return (x.device.type == "cpu" and x.dtype == torch.bfloat16
            and kernels.has_bf16())


class Bf16Linear(nn.Module):
    """A frozen bf16 ``Linear`` run by our AVX512-BF16 kernel (``infer/kernels/linear.cpp``).

    At decode's row counts it beats oneDNN's packed linear (the model's linears at 1 row:
    8.9 vs 19.3 ms; 16 rows: 15.8 vs 19.9; 64 rows: 42.7 vs 50.5) and matches it at 1024.
    Each output is accumulated in the same order whatever the number of rows.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = kernels.ops().pack_bf16_linear(weight.detach())
        self.bias = bias

    def forward(self, x: Tensor, out_float: bool = False) -> Tensor:
        """``x @ W.T + b``; ``out_float`` returns float32 without rounding to bf16."""
        return kernels.ops().bf16_linear(x, self.packed, self.out_features, self.bias, out_float)


class Bf16GatedLinear(nn.Module):
    """``act(gate(x)) * up(x)`` of a fused gate/up projection in one call of the bf16 kernel.

    The weight is packed with gate's and up's rows taken 32 at a time in turn, so that each
    64-column tile of the kernel holds 32 gate and the matching 32 up columns: it applies the
    activation to the float accumulators and writes only the product. That saves the
    ``[rows, 2 * intermediate]`` bf16 write and its reread by a separate activation pass, and
    rounds once instead of three times: 30 layers' projection and activation at 1024 rows,
    298-301 -> 266-272 ms; 64 rows, 18.0-18.4 -> 17.2-17.8 ms.
    """

    def __init__(self, gate_up: nn.Linear, gelu: bool) -> None:
        super().__init__()
        self.width, self.gelu = gate_up.out_features // 2, gelu
        self.in_features = gate_up.in_features
        order = torch.arange(2 * self.width).view(2, -1, 32).transpose(0, 1).reshape(-1)
        self.packed = kernels.ops().pack_bf16_linear(gate_up.weight.detach()[order])
        self.bias = None if gate_up.bias is None else gate_up.bias.detach()[order].float()

    def forward(self, x: Tensor) -> Tensor:
        return kernels.ops().bf16_gated_linear(x, self.packed, self.width, self.bias, self.gelu)


def pack_linear(weight: Tensor, bias: Tensor | None) -> nn.Module | None:
    """The fastest frozen form of a linear layer on this machine, or ``None`` (keep it)."""
    if _bf16_kernels(weight) and weight.shape[1] % 2 == 0:
        return Bf16Linear(weight, bias)
    if can_pack(weight):
        return PackedLinear(weight, bias)
    return None


def pack_linears(module: nn.Module) -> None:
    """Replace every CPU bf16/fp32 ``nn.Linear`` below ``module`` with a frozen, packed one."""
    for name, child in list(module.named_children()):
        packed = pack_linear(child.weight, child.bias) if isinstance(child, nn.Linear) else None
        if packed is not None:
            setattr(module, name, packed)
        else:
            pack_linears(child)


class DecoderLayer(nn.Module):
    """The pre-norm block of Llama and Qwen3: ``x + attn(norm(x))``, ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, qk_norm=qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def stack_norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm, RMSNorm | None]:
        """Its norms as :class:`DecodeStack` runs them: before attention (adding to the
        residual), after it (none), before the MLP (adding), after it (none)."""
        return self.input_layernorm, None, self.post_attention_layernorm, None

    def forward(
        self, x: Tensor, residual: Tensor | None, ctx: ForwardContext | PagedContext
    ) -> tuple[Tensor, Tensor]:
        """The hidden state is ``x + residual`` (``x`` alone before the first layer).

        Keeping the sum unmade lets one kernel add and normalize (vLLM's layout).
        """
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        attn = self.self_attn(h, ctx)
        h, residual = self.post_attention_layernorm.add_forward(attn,
                                                                kept_rows(residual, attn, ctx))
        return self.mlp(h), residual


class DecodeStack:
    """Every layer of a decode-only step in one kernel call (``decode_stack.cpp``).

    The call runs the kernels the layers run, in their order, so its outputs are the same
    bits; what it saves is the ~8 Python calls per layer. Each of those releases the GIL for
    its kernel and must retake it afterwards, and in a server the event loop holds the GIL
    while it writes tokens. Built by :meth:`of` for stacks of :class:`DecoderLayer` (Llama,
    Qwen3) or Gemma3's layer whose linears all run the bf16 kernel; other models, and steps
    with prompt chunks or attention capture, run the layers one by one.
    """

    _NONE = torch.empty(0)  # a weight, bias or norm the layer does not have

    def __init__(self, layers: list[Any], config: ModelConfig) -> None:
        attn: Attention = layers[0].self_attn
        self.kinds = [layer.self_attn.layer_type for layer in layers]
        self.heads = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        first_norm: RMSNorm = layers[0].input_layernorm
        self.scale, self.eps, self.offset = attn.scale, first_norm.eps, first_norm.offset
        self.intermediate = config.intermediate_size
        self.gelu = layers[0].mlp.gelu
        self.weights: list[Tensor] = []
        for layer in layers:
            packed = _packed(layer)
            assert packed is not None, "of() builds a stack only from packed layers"
            qkv, o, gate_up, down = packed
            pre_attn, post_attn, pre_mlp, post_mlp = layer.stack_norms()
            a = layer.self_attn
            self.weights += [
                pre_attn.weight, qkv.packed, self._opt(qkv.bias), o.packed, self._opt(o.bias),
                self._norm(post_attn), pre_mlp.weight, gate_up.packed, self._opt(gate_up.bias),
                down.packed, self._opt(down.bias), self._norm(post_mlp),
                self._norm(a.q_norm), self._norm(a.k_norm),
            ]

    @classmethod
    def _opt(cls, t: Tensor | None) -> Tensor:
        return cls._NONE if t is None else t

    @classmethod
    def _norm(cls, norm: RMSNorm | None) -> Tensor:
        return cls._NONE if norm is None else norm.weight

    @classmethod
    def of(cls, modules: list[nn.Module], config: ModelConfig) -> DecodeStack | None:
        """The stack for these (packed) layers, or ``None`` when the kernel cannot run them:
        layers of different classes or of one without ``stack_norms``, a linear not on the
        bf16 kernel, or layers that differ in their norms, scale or activation."""
        kind = type(modules[0]) if modules else None
        if kind is None or not hasattr(kind, "stack_norms") or \
                any(type(m) is not kind for m in modules):
            return None
        layers: list[Any] = list(modules)
        first_norm: RMSNorm = layers[0].input_layernorm
        first_attn: Attention = layers[0].self_attn
        qk_norm = first_attn.q_norm is not None
        for layer in layers:
            a: Attention = layer.self_attn
            if (a.q_norm is not None) != qk_norm or (a.k_norm is not None) != qk_norm:
                return None
            norms = [n for n in (*layer.stack_norms(), a.q_norm, a.k_norm) if n is not None]
            if (_packed(layer) is None or a.scale != first_attn.scale
                    or layer.mlp.gelu != layers[0].mlp.gelu
                    or any(n.offset != first_norm.offset or n.eps != first_norm.eps
                           or n.weight.dtype != torch.bfloat16 for n in norms)):
                return None
        return cls(layers, config)

    def runs(self, x: Tensor, ctx: ForwardContext | PagedContext) -> bool:
        """Whether this forward is one the kernel runs: decode tokens only (so no kept rows,
        which only steps with prompt spans have), nothing captured."""
        return (isinstance(ctx, PagedContext) and not ctx.spans and ctx.capture is None
                and ctx.num_decode == x.shape[0] > 0)

    def __call__(self, x: Tensor, ctx: PagedContext) -> tuple[Tensor, Tensor]:
        """``(x, residual)`` after every layer, as :meth:`CausalLM._layers` returns them."""
        rope = [t for kind in self.kinds for t in ctx.rope[kind]]
        caches = [t for pair in ctx.cache.layers for t in pair]
        windows = [ctx.windows.get(kind, 0) for kind in self.kinds]
        x, residual = kernels.ops().decode_layers(
            x.contiguous(), self.weights, caches, rope, windows, ctx.slots, ctx.block_tables,
            ctx.seq_lens, *self.heads, self.intermediate, self.scale, self.eps, self.offset,
            self.gelu)
        return x, residual


def _packed(layer: Any) -> tuple[Bf16Linear, Bf16Linear, Bf16GatedLinear, Bf16Linear] | None:
    """A layer's qkv, o, gate/up and down projections, if all run the bf16 kernel."""
    a, mlp = layer.self_attn, layer.mlp
    qkv, o = getattr(a, "qkv_proj", None), a.o_proj
    gate_up, down = getattr(mlp, "gate_up_proj", None), mlp.down_proj
    if (isinstance(qkv, Bf16Linear) and isinstance(o, Bf16Linear)
            and isinstance(gate_up, Bf16GatedLinear) and isinstance(down, Bf16Linear)):
        return qkv, o, gate_up, down
    return None
