"""Linears on a torch without oneDNN's private packed-linear ops: plain ``F.linear``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from infer.models import linear
from infer.models.linear import PackedLinear, pack_linear, pack_linears

# bf16 keeps 8 bits of mantissa: two sums of the same products, rounded to bf16 in another
# order, differ by a step or two of the output.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float32: 1e-5}


def _layer(dtype: torch.dtype, bias: bool) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(96, 40, bias=bias).to(dtype).requires_grad_(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_without_mkldnn_ops_linears_stay_plain_and_agree_with_the_packed_path(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, bias: bool
) -> None:
    """With the ops missing, packing keeps ``nn.Linear``; its outputs equal oneDNN's."""
    layer = _layer(dtype, bias)
    x = torch.randn(5, 96).to(dtype)
    want = x.float() @ layer.weight.float().T + (layer.bias.float() if bias else 0)

    # The oneDNN path (our bf16 kernel, tried first, turned off to reach it); the pinned
    # torch (constraints.txt) has its ops.
    monkeypatch.setattr(linear, "bf16_kernels", lambda _: False)
    packed = pack_linear(layer.weight, layer.bias)
    assert isinstance(packed, PackedLinear), "this torch lacks oneDNN's packed linear"
    onednn = packed(x)

    monkeypatch.setattr(linear, "mkldnn_linear", lambda: False)
    assert pack_linear(layer.weight, layer.bias) is None
    model = nn.Sequential(layer)
    pack_linears(model)
    assert model[0] is layer  # kept as it was: F.linear on the plain weight
    plain = model(x)

    tol = TOLERANCE[dtype]
    assert plain.dtype == onednn.dtype == dtype
    torch.testing.assert_close(plain.float(), onednn.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(plain.float(), want, atol=tol, rtol=tol)


def test_mkldnn_helper_says_no_when_onednn_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    """The helper asks torch.backends.mkldnn first (cached: cleared around the test)."""
    linear.mkldnn_linear.cache_clear()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    try:
        assert not linear.mkldnn_linear()
        assert not linear.can_pack(torch.zeros(4, 4))
    finally:
        linear.mkldnn_linear.cache_clear()
