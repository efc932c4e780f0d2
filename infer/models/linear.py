"""Frozen linear layers in the fastest form this machine runs: packed once, at load time.

On a CPU with AVX512-BF16, bf16 weights go through our kernel (``infer/kernels/linear.cpp``);
elsewhere oneDNN holds them pre-packed, where this torch has its (private) packed-linear ops;
otherwise they stay ``nn.Linear`` (``F.linear`` on the plain weight). Quantized weights
(a GGUF file's, or ``--weights int8/int4``) stay quantized in :class:`QuantLinear` on a CPU with
AVX2 (``infer/kernels/quant_linear.cpp``), and are dequantized at load elsewhere.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import Tensor, nn

from infer import kernels
from infer.models import huge_pages, quant
from infer.models.quant import QuantTensor


class QuantLinear(nn.Module):
    """A frozen linear over quantized weights, read as they are by ``quant_linear.cpp``.

    Built from one :class:`QuantTensor`, or from several whose layouts differ (parts of its
    output rows, in order). q/k/v (or gate/up) concatenate into one where their layouts
    agree (:func:`quant.concat`); where they do not (Q4_K_M's Q4_K q and k beside a Q6_K v),
    each layout stays a part and is read at its own bits, rather than all at the widest
    (which read q and k at 6 bits). :meth:`pack` writes the kernel's layout and drops the
    unpacked arrays.
    """

    def __init__(
        self,
        weight: QuantTensor | list[QuantTensor],
        bias: Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        parts = weight if isinstance(weight, list) else [weight]
        self.parts: list[QuantTensor] | None = parts
        self.dtype = dtype  # the model's: what a dequantized copy of it would be
        self.out_features = sum(p.shape[0] for p in parts)
        self.in_features = parts[0].shape[1]
        self.bias: nn.Parameter | None = None if bias is None else nn.Parameter(bias, False)
        self.packed: Tensor | None = None

    @classmethod
    def concat(cls, linears: list[QuantLinear]) -> QuantLinear:
        # neighbours of one layout in one part, each layout apart
        parts: list[list[QuantTensor]] = []
        for weight in (p for lin in linears for p in lin._unpacked()):
            if parts and parts[-1][0].layout == weight.layout:
                parts[-1].append(weight)
            else:
                parts.append([weight])
        merged = [quant.concat(same) if len(same) > 1 else same[0] for same in parts]
        bias = None
        if any(lin.bias is not None for lin in linears):
            bias = torch.cat(
                [
                    lin.bias.detach().float()
                    if lin.bias is not None
                    else torch.zeros(lin.out_features)
                    for lin in linears
                ]
            )
        return cls(merged, bias, linears[0].dtype)

    def _unpacked(self) -> list[QuantTensor]:
        assert self.parts is not None, "a packed QuantLinear no longer holds its QuantTensor"
        return self.parts

    def quantized(self) -> QuantTensor:
        """The weight as one :class:`QuantTensor` (parts in a layout that holds each)."""
        parts = self._unpacked()
        return parts[0] if len(parts) == 1 else quant.concat(parts)

    def pack(self) -> None:
        if self.packed is None:
            parts = self._unpacked()
            self.packed = quant.pack(parts[0]) if len(parts) == 1 else quant.pack_parts(parts)
            self.parts = None
            if self.bias is not None:
                self.bias = nn.Parameter(self.bias.detach().float(), requires_grad=False)

    def forward(self, x: Tensor, out_float: bool = False) -> Tensor:
        """``x @ W.T + b``; ``out_float`` returns float32 without rounding to bf16."""
        assert self.packed is not None, "pack() first"
        out = kernels.ops().quant_linear(x, self.packed, self.bias, out_float)
        return out if out_float else out.to(x.dtype)


class QuantEmbedding(nn.Module):
    """An embedding table kept quantized: rows are dequantized as they are looked up, to the
    same numbers a dequantized table holds (4-bit values two to a byte)."""

    def __init__(self, table: QuantTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = table.shape
        self.dtype = dtype
        u = table.u
        self.u = u[:, 0::2] | (u[:, 1::2] << 4) if table.bits == 4 else u
        self.scale, self.offset, self.d, self.m = table.scale, table.offset, table.d, table.m
        self.layout = table.layout

    def forward(self, ids: Tensor) -> Tensor:
        # one kernel call: in torch ops a lookup took some 25 of them, each a dispatch
        rows = kernels.ops().quant_embedding(
            ids.reshape(-1).long().contiguous(),
            self.u,
            self.scale,
            self.offset,
            self.d,
            self.m,
            *self.layout,
            self.dtype,
        )
        return rows.reshape(*ids.shape, -1)


class QuantGatedLinear(nn.Module):
    """``act(gate(x)) * up(x)`` of a quantized gate/up projection in one kernel call: rows are
    packed 16 gate then the matching 16 up at a time (see :class:`Bf16GatedLinear`)."""

    def __init__(self, gate_up: QuantLinear, gelu: bool) -> None:
        super().__init__()
        weight = gate_up.quantized()
        self.width, self.gelu = gate_up.out_features // 2, gelu
        self.in_features = gate_up.in_features
        order = torch.arange(2 * self.width).view(2, -1, 16).transpose(0, 1).reshape(-1)
        self.packed = quant.pack(quant.rows(weight, order))
        self.bias = None if gate_up.bias is None else gate_up.bias.detach()[order].float()

    def forward(self, x: Tensor) -> Tensor:
        return kernels.ops().quant_gated_linear(x, self.packed, self.bias, self.gelu).to(x.dtype)


def concat_linear(*parts: nn.Module) -> nn.Module:
    """One Linear whose output is the concatenation of ``parts``' outputs."""
    quantized = [p for p in parts if isinstance(p, QuantLinear)]
    if len(quantized) == len(parts):
        return QuantLinear.concat(quantized)
    dense = [_dense(p) for p in parts]
    first = dense[0]
    out_features = sum(p.out_features for p in dense)
    bias = first.bias is not None
    fused = nn.Linear(first.in_features, out_features, bias=bias, device="meta")
    weight = torch.cat([p.weight for p in dense])
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if bias:
        fused.bias = nn.Parameter(torch.cat([p.bias for p in dense]), requires_grad=False)
    return fused


# oneDNN picks its blocked weight layout for a typical row count; 64 measured best across
# decode's row counts (bench/results/LOG.md).
_PACK_ROWS_HINT = 64


@cache
def mkldnn_linear() -> bool:
    """Whether this torch has oneDNN and its packed-linear ops (private: not every torch
    that ``torch>=2.6`` admits need have them)."""
    try:
        mkldnn = torch.ops.mkldnn
        return (
            torch.backends.mkldnn.is_available()
            and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise")
        )
    except Exception:  # an op namespace that fails to load is as good as missing
        return False


def can_pack(weight: Tensor) -> bool:
    """Whether oneDNN can hold ``weight`` pre-packed (CPU, bf16 or fp32, the ops present)."""
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.bfloat16, torch.float32)
        and mkldnn_linear()
    )


class PackedLinear(nn.Module):
    """A frozen ``Linear`` whose weight oneDNN reordered once, at load time.

    An eager bf16 ``F.linear`` on CPU reorders the weight into oneDNN's blocked layout on
    every call; for the small row counts of decode that copy costs as much as the matmul.
    This is the layout inductor's weight freezing produces, without compiling anything.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _PACK_ROWS_HINT)
        self.bias = bias

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def bf16_kernels(x: Tensor) -> bool:
    """Whether ``x`` can go through the AVX512-BF16 kernels (bf16 on a CPU that has them)."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and kernels.has_bf16()


class Bf16Linear(nn.Module):
    """A frozen bf16 ``Linear`` run by our AVX512-BF16 kernel (``infer/kernels/linear.cpp``).

    At decode's row counts it beats oneDNN's packed linear, and matches it at 1024 rows
    (bench/results/LOG.md). Each output is accumulated in the same order whatever the number
    of rows.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = huge_pages.adopt(kernels.ops().pack_bf16_linear(weight.detach()))
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
    rounds once instead of three times.
    """

    def __init__(self, gate_up: nn.Linear, gelu: bool) -> None:
        super().__init__()
        self.width, self.gelu = gate_up.out_features // 2, gelu
        self.in_features = gate_up.in_features
        order = torch.arange(2 * self.width).view(2, -1, 32).transpose(0, 1).reshape(-1)
        self.packed = huge_pages.adopt(
            kernels.ops().pack_bf16_linear(gate_up.weight.detach()[order])
        )
        self.bias = None if gate_up.bias is None else gate_up.bias.detach()[order].float()

    def forward(self, x: Tensor) -> Tensor:
        return kernels.ops().bf16_gated_linear(x, self.packed, self.width, self.bias, self.gelu)


def _dense(linear: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` of a part that may be quantized (fusing it with a dense one)."""
    if isinstance(linear, nn.Linear):
        return linear
    assert isinstance(linear, QuantLinear), f"cannot fuse {type(linear).__name__}"
    weight = linear.quantized().dequantize(linear.dtype)
    dense = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    dense.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        dense.bias = nn.Parameter(linear.bias.detach().to(linear.dtype), requires_grad=False)
    return dense


def pack_linear(weight: Tensor, bias: Tensor | None) -> nn.Module | None:
    """The fastest frozen form of a linear layer on this machine, or ``None`` (keep it)."""
    if bf16_kernels(weight) and weight.shape[1] % 2 == 0:
        return Bf16Linear(weight, bias)
    if can_pack(weight):
        return PackedLinear(weight, bias)
    return None


def pack_linears(module: nn.Module) -> None:
    """Replace every CPU bf16/fp32 ``nn.Linear`` below ``module`` with a frozen, packed one."""
    for name, child in list(module.named_children()):
        if isinstance(child, QuantLinear):
            child.pack()
            continue
        packed = pack_linear(child.weight, child.bias) if isinstance(child, nn.Linear) else None
        if packed is not None:
            setattr(module, name, packed)
        else:
            pack_linears(child)
