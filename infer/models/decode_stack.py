"""Every layer of a decode-only step in one C++ call (``infer/kernels/decode_stack.cpp``)."""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import Tensor, nn

from infer import kernels
from infer.models.config import ModelConfig
from infer.models.context import ForwardContext, PagedContext
from infer.models.layers import Attention, RMSNorm
from infer.models.linear import Bf16GatedLinear, Bf16Linear, QuantGatedLinear, QuantLinear


class DecodeStack:
    """Every layer of a decode-only step in one kernel call (``decode_stack.cpp``).

    The call runs the kernels the layers run, in their order, so its outputs are the same
    bits; what it saves is the ~8 Python calls per layer. Each of those releases the GIL for
    its kernel and must retake it afterwards, and in a server the event loop holds the GIL
    while it writes tokens. Built by :meth:`of` for stacks of :class:`DecoderLayer` (Llama,
    Qwen2, Qwen3) or Gemma3's layer whose linears each run one call of the bf16 or the
    quantized kernel; other models, and steps with prompt chunks or attention capture, run
    the layers one by one.
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
                pre_attn.weight,
                _weight(qkv),
                self._opt(qkv.bias),
                _weight(o),
                self._opt(o.bias),
                self._norm(post_attn),
                pre_mlp.weight,
                _weight(gate_up),
                self._opt(gate_up.bias),
                _weight(down),
                self._opt(down.bias),
                self._norm(post_mlp),
                self._norm(a.q_norm),
                self._norm(a.k_norm),
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
        if (
            kind is None
            or not hasattr(kind, "stack_norms")
            or any(type(m) is not kind for m in modules)
        ):
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
            if (
                _packed(layer) is None
                or a.scale != first_attn.scale
                or layer.mlp.gelu != layers[0].mlp.gelu
                or any(
                    n.offset != first_norm.offset
                    or n.eps != first_norm.eps
                    or n.weight.dtype != torch.bfloat16
                    for n in norms
                )
            ):
                return None
        return cls(layers, config)

    def runs(self, x: Tensor, ctx: ForwardContext | PagedContext) -> bool:
        """Whether this forward is one the kernel runs: decode tokens only (so no kept rows,
        which only steps with prompt spans have), nothing captured."""
        return (
            isinstance(ctx, PagedContext)
            and not ctx.spans
            and ctx.capture is None
            and ctx.num_decode == x.shape[0] > 0
        )

    def __call__(self, x: Tensor, ctx: PagedContext) -> tuple[Tensor, Tensor]:
        """``(x, residual)`` after every layer, as :meth:`CausalLM._layers` returns them."""
        rope = [t for kind in self.kinds for t in ctx.rope[kind]]
        caches = [t for pair in ctx.cache.layers for t in pair]
        windows = [ctx.windows.get(kind, 0) for kind in self.kinds]
        x, residual = kernels.ops().decode_layers(
            x.contiguous(),
            self.weights,
            caches,
            rope,
            windows,
            ctx.slots,
            ctx.block_tables,
            ctx.seq_lens,
            *self.heads,
            self.intermediate,
            self.scale,
            self.eps,
            self.offset,
            self.gelu,
        )
        return x, residual


Linear = Bf16Linear | QuantLinear
GatedLinear = Bf16GatedLinear | QuantGatedLinear


def _packed(layer: Any) -> tuple[Linear, Linear, GatedLinear, Linear] | None:
    """A layer's qkv, o, gate/up and down projections, if each runs one call of the bf16 or
    the quantized kernel."""
    a, mlp = layer.self_attn, layer.mlp
    qkv, o = getattr(a, "qkv_proj", None), a.o_proj
    gate_up, down = getattr(mlp, "gate_up_proj", None), mlp.down_proj

    def single(lin: Any) -> bool:
        return isinstance(lin, Bf16Linear) or (
            isinstance(lin, QuantLinear) and lin.packed is not None
        )

    if single(qkv) and single(o) and isinstance(gate_up, GatedLinear) and single(down):
        return cast(Linear, qkv), cast(Linear, o), gate_up, cast(Linear, down)
    return None


def _weight(linear: Linear | GatedLinear) -> Tensor:
    """The one packed tensor the kernel reads (bf16, or uint8 when quantized)."""
    assert linear.packed is not None
    return linear.packed
