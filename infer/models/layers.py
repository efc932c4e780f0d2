"""Building blocks shared by every family: norms, rotary embeddings, attention, MLP.

Attribute names match Hugging Face checkpoint keys (``q_proj``, ``input_layernorm``...), so
weights load by name. Shapes: B = batch rows, T = new tokens per row, S = attended KV length,
H = query heads, K = KV heads, D = head dim.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infer.models.config import ModelConfig, RopeConfig
from infer.models.kv_cache import KVCache


class RMSNorm(nn.Module):
    """RMSNorm; ``offset=1`` gives Gemma's ``x * (1 + w)`` computed in float32."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim) if offset == 0.0 else torch.zeros(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: Tensor) -> Tensor:
        if self.offset == 0.0:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        out = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (out * (self.offset + self.weight.float())).type_as(x)


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
    """cos and signed sin ``[B, T, 1, D]`` for the given positions ``[B, T]``.

    The sin's first half is negated so that :func:`apply_rope` can rotate with one ``roll``.
    """
    freqs = positions.to(torch.float32).unsqueeze(-1) * inv_freq  # [B, T, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(2)
    sin = torch.cat((-sin, sin), dim=-1).unsqueeze(2)
    return cos.to(dtype), sin.to(dtype)


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
    probs: dict[int, Tensor] = field(default_factory=dict)


@dataclass
class ForwardContext:
    """Per-forward state built once and read by every layer."""

    positions: Tensor  # [B, T], -1 marks padding
    cache: KVCache | None
    row_slice: slice | None  # the cache rows as a slice when they are consecutive
    row_index: Tensor  # [B, 1] cache rows
    flat_index: Tensor  # [B * T * K] cache slot of each new key (padding → scratch)
    kv_len: int
    rope: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    masks: dict[str, Tensor] = field(default_factory=dict)  # [B, 1, T, S] bool, True = attend
    capture: AttnCapture | None = None

    def read_kv(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store this step's k/v ``[B, T, K, D]`` and return what to attend ``[B, K, S, D]``."""
        if self.cache is None:
            return k.transpose(1, 2), v.transpose(1, 2)
        self.cache.write(layer, self.flat_index, k, v)
        ck, cv = self.cache.k[layer], self.cache.v[layer]  # [R, K, S_max + 1, D]
        if self.row_slice is not None:  # a view: no copy of the attended cache
            return ck[self.row_slice, :, : self.kv_len], cv[self.row_slice, :, : self.kv_len]
        index = self.row_index.squeeze(1)
        return ck[index, :, : self.kv_len], cv[index, :, : self.kv_len]


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

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        b, t, _ = x.shape
        h, kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(b, t, h + 2 * kv, d)
        cos, sin = ctx.rope[self.layer_type]
        if self.q_norm is not None and self.k_norm is not None:
            q = apply_rope(self.q_norm(qkv[:, :, :h]), cos, sin)
            k = apply_rope(self.k_norm(qkv[:, :, h : h + kv]), cos, sin)
        else:  # rotate q and k heads together: one set of ops instead of two
            qk = apply_rope(qkv[:, :, : h + kv], cos, sin)
            q, k = qk[:, :, :h], qk[:, :, h:]
        v = qkv[:, :, h + kv :]
        keys, values = ctx.read_kv(self.layer_idx, k, v)  # [B, K, S, D]
        mask = ctx.masks[self.layer_type]
        capture = ctx.capture if ctx.capture and self.layer_idx in ctx.capture.layers else None
        if capture is not None:
            out = self._attend_eager(q.transpose(1, 2), keys, values, mask, capture)
        elif t == 1 and kv != h:
            # Decode: fold each KV head's group of query heads into the query axis
            # ([B, K, G, D]) so SDPA reads each KV head once; with enable_gqa it is ~5x slower
            # here. The [B, 1, 1, S] mask broadcasts over the group.
            folded = q.reshape(b, kv, h // kv, d)
            out = F.scaled_dot_product_attention(
                folded, keys, values, attn_mask=mask, scale=self.scale
            ).view(b, 1, h, d)
        else:
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
            ).transpose(1, 2)  # [B, T, H, D]
        return self.o_proj(out.reshape(b, t, -1))

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
        self.gate_up_proj = _concat_linear(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
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


def pack_linears(module: nn.Module) -> None:
    """Replace every CPU bf16/fp32 ``nn.Linear`` below ``module`` with a :class:`PackedLinear`."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear) and can_pack(child.weight):
            setattr(module, name, PackedLinear.from_linear(child))
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

    def forward(self, x: Tensor, ctx: ForwardContext) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))
