"""Building blocks shared by every family: norms, rotary embeddings, attention, MLP.

Attribute names match Hugging Face checkpoint keys (``q_proj``, ``input_layernorm``...), so
weights load by name. Shapes: B = batch rows, T = new tokens per row, S = attended KV length,
H = query heads, K = KV heads, D = head dim.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infer import kernels
from infer.models.config import ModelConfig, RopeConfig
from infer.models.context import AttnCapture, ForwardContext, PagedContext, PrefillSpan
from infer.models.kv_cache import keys_of, values_of
from infer.models.linear import (
    Bf16GatedLinear,
    QuantGatedLinear,
    QuantLinear,
    bf16_kernels,
    concat_linear,
)


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


def kept_rows(residual: Tensor, layer: int, ctx: ForwardContext | PagedContext) -> Tensor:
    """``residual`` cut to the rows the attention of layer ``layer`` returned (all of them
    but in the last layer of a paged forward that keeps only the rows getting logits, in
    their order: a kept row set as large as the batch may still be a permutation)."""
    if isinstance(ctx, PagedContext) and ctx.keep is not None and layer == ctx.keep_layer:
        return residual.index_select(0, ctx.keep)
    return residual


def decode_attention_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    scale: float,
    window: int,
) -> Tensor:
    """Decode attention in torch ops: what the C++ kernel computes, on any device.

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
    out = F.scaled_dot_product_attention(
        folded, keys, values, attn_mask=mask[:, None, None], scale=scale
    )
    return out.reshape(n, h, d)


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
        bias = c.attention_bias or c.qkv_bias
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * c.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * c.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * c.head_dim, bias=bias)
        o_bias = c.attention_bias
        self.o_proj = nn.Linear(self.num_heads * c.head_dim, c.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps, norm_offset) if qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps, norm_offset) if qk_norm else None

    def fuse(self) -> None:
        """Replace q/k/v with one projection (one larger matmul per step instead of three)."""
        self.qkv_proj = concat_linear(self.q_proj, self.k_proj, self.v_proj)
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
            kernels.ops().rope_and_cache(qkv, cos, sin, h, kv, *ctx.cache.layers[layer], ctx.slots)
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
            out = self._decode_attention(
                q.index_select(0, ctx.keep), ctx, *ctx.keep_arrays(), window
            )  # [R, H, D]
            return self.o_proj(out.view(out.shape[0], -1))
        nd = ctx.num_decode
        decode = None
        if nd:
            decode = self._decode_attention(
                q[:nd], ctx, ctx.block_tables, ctx.seq_lens, window
            )  # [nd, H, D]
        if not ctx.spans and decode is not None:
            out = decode
        else:
            out = q.new_empty(n, self.num_heads, self.head_dim)
            if decode is not None:
                out[:nd] = decode
            if bf16_kernels(q) and self.head_dim % 64 == 0 and ctx.cache.block_size == 16:
                # Every span at once, keys and values read from the cache (already stored).
                tables, info = ctx.span_arrays()
                kernels.ops().paged_prefill_attention(
                    q, *ctx.cache.layers[layer], tables, info, self.scale, window, out
                )
            else:
                for span in ctx.spans:
                    rows = slice(span.offset, span.offset + span.length)
                    out[rows] = self._attend_span(q[rows], k[rows], v[rows], span, ctx)
        return self.o_proj(out.view(n, -1))

    def _decode_attention(
        self, q: Tensor, ctx: PagedContext, tables: Tensor, lens: Tensor, window: int
    ) -> Tensor:
        """One query ``[S, H, D]`` per sequence over its blocks (the C++ kernel on CPU)."""
        attend = (
            kernels.ops().paged_decode_attention
            if q.device.type == "cpu"
            else decode_attention_torch
        )
        return attend(q, *ctx.cache.layers[self.layer_idx], tables, lens, self.scale, window)

    def _attend_span(
        self, q: Tensor, k: Tensor, v: Tensor, span: PrefillSpan, ctx: PagedContext
    ) -> Tensor:
        """SDPA of one span's queries ``[T, H, D]`` over its sequence so far."""
        if span.start == 0:
            keys, values = k.transpose(0, 1), v.transpose(0, 1)  # [K, T, D]
        else:
            seq = ctx.num_decode + ctx.spans.index(span)
            keys, values = ctx.cache.gather(
                self.layer_idx, ctx.seq_blocks[seq], span.start + span.length
            )
        window = ctx.windows.get(self.layer_type, 0)
        mask = span.mask(self.layer_type, window, q.device)
        # Contiguous, with each KV head repeated for its query heads: SDPA's CPU kernel is
        # faster so than given strided views and enable_gqa.
        groups = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).contiguous().unsqueeze(0),
            keys.repeat_interleave(groups, 0).unsqueeze(0),
            values.repeat_interleave(groups, 0).unsqueeze(0),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
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
        self.gate_up_proj: nn.Module = concat_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def pack_gated(self) -> None:
        """Let one kernel call project and gate (:class:`Bf16GatedLinear`,
        :class:`QuantGatedLinear`) when it can."""
        proj = self.gate_up_proj
        if isinstance(proj, QuantLinear):
            if proj.out_features % 32 == 0:
                self.gate_up_proj = QuantGatedLinear(proj, self.gelu)
            return
        if (
            isinstance(proj, nn.Linear)
            and bf16_kernels(proj.weight)
            and proj.in_features % 2 == 0
            and proj.out_features % 64 == 0
        ):
            self.gate_up_proj = Bf16GatedLinear(proj, self.gelu)

    def forward(self, x: Tensor) -> Tensor:
        if isinstance(self.gate_up_proj, Bf16GatedLinear | QuantGatedLinear):
            return self.down_proj(self.gate_up_proj(x))
        gate_up = self.gate_up_proj(x)
        if gate_up.device.type == "cpu":
            return self.down_proj(kernels.ops().gated_activation(gate_up, self.gelu))
        gate, up = gate_up.chunk(2, dim=-1)
        gate = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(gate * up)


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
        h, residual = self.post_attention_layernorm.add_forward(
            attn, kept_rows(residual, self.self_attn.layer_idx, ctx)
        )
        return self.mlp(h), residual
