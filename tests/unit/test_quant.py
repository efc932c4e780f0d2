"""Quantized weights: GGUF blocks kept as the file has them, and the kernel that reads them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize, quantize

from infer import kernels
from infer.models import quant
from infer.models.linear import QuantEmbedding, QuantGatedLinear, QuantLinear
from infer.models.quant import QuantTensor

# Every kernel target this CPU can run (its own, and the AVX2 ones for laptops): each must
# compute the same product, bit for bit the same. `make` builds them all.
TARGETS = [t for t in kernels.runnable_isas() if kernels.ops_for(t).has_quant_linear()]
each_target = pytest.mark.parametrize("target", TARGETS)

# Bytes per block, and where each block's float16 scales sit (offsets of d, and dmin).
_K_TYPES = {QT.Q4_K: (144, (0, 2)), QT.Q5_K: (176, (0, 2)), QT.Q6_K: (210, (208,))}


def _blocks(qtype: QT, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A ``[n, k]`` tensor's raw blocks: gguf's own quantizer where it has one, else random
    bytes with sane float16 scales (any bit pattern of the rest is a valid block)."""
    if qtype not in _K_TYPES:
        return quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    size, scale_offsets = _K_TYPES[qtype]
    raw = rng.integers(0, 256, (n * k // 256, size), dtype=np.uint8)
    for off in scale_offsets:
        d = (rng.random(len(raw)) * 0.01 + 0.001).astype(np.float16)
        raw[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", quant.GGUF_TYPES, ids=lambda t: t.name)
def test_every_kept_gguf_type_holds_the_files_own_numbers(qtype: QT) -> None:
    rng = np.random.default_rng(0)
    raw = _blocks(qtype, 32, 512, rng)
    kept = quant.from_gguf(qtype, raw, (32, 512))
    assert kept is not None
    expected = torch.from_numpy(dequantize(raw, qtype).astype(np.float32)).reshape(32, 512)
    assert torch.equal(kept.dequantize(), expected)  # bit for bit


@pytest.mark.parametrize("qtype", quant.GGUF_TYPES, ids=lambda t: t.name)
def test_a_tensor_decoded_and_packed_in_pieces_is_the_same(
    qtype: QT, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large tensors are decoded and packed a few rows at a time, on several threads: pieces
    that do not divide the rows change nothing."""
    raw = _blocks(qtype, 112, 512, np.random.default_rng(3))
    whole = quant.from_gguf(qtype, raw, (112, 512))
    assert whole is not None
    packed = quant.pack(whole)
    monkeypatch.setattr(quant, "_CHUNK", 512 * 48)  # 48 rows, or 3 blocks of 16 columns
    pieces = quant.from_gguf(qtype, raw, (112, 512))
    assert pieces is not None
    for a, b in zip(dataclasses.astuple(whole), dataclasses.astuple(pieces), strict=True):
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    assert torch.equal(quant.pack(pieces), packed)


@pytest.mark.parametrize(
    ("qtype", "bits"),
    [
        (QT.Q4_0, 4),
        (QT.Q4_K, 4),
        (QT.Q5_0, 6),
        (QT.Q5_1, 6),
        (QT.Q5_K, 6),
        (QT.Q6_K, 6),
        (QT.Q8_0, 8),
    ],
    ids=lambda v: getattr(v, "name", str(v)),
)
def test_values_are_packed_in_as_few_bits_as_hold_them(qtype: QT, bits: int) -> None:
    """5- and 6-bit values take 6 bits a weight, not 8: fewer bytes read per token."""
    n, k = 32, 512
    kept = quant.from_gguf(qtype, _blocks(qtype, n, k, np.random.default_rng(4)), (n, k))
    assert kept is not None and kept.bits == bits
    packed = quant.pack(kept)
    scales = n * k // kept.group * 2 + n * k // (kept.group * kept.supers_every) * 4
    assert packed.numel() <= 128 + n * k * bits // 8 + scales + 128  # header, alignment


def test_a_layout_too_narrow_for_its_values_is_refused() -> None:
    kept = quant.from_gguf(QT.Q8_0, _blocks(QT.Q8_0, 16, 64, np.random.default_rng(5)), (16, 64))
    assert kept is not None
    with pytest.raises(ValueError, match="do not fit"):
        quant.pack(QuantTensor(kept.u, kept.scale, kept.offset, kept.d, kept.m, 6, 32, 1))


def test_other_types_are_not_kept() -> None:
    raw = np.zeros((4, 64), dtype=np.float32)
    assert quant.from_gguf(QT.F32, raw, (4, 64)) is None


SPAN_K = 256  # most k's that share one activation scale (quant_linear.cpp's kSpanK)


def _reference(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """The kernel's arithmetic in torch: x quantized to int8 (d = max|x| / 127) per span of
    up to 256 k's within a K-quant's superblock (as llama.cpp's Q8_K) or else per group,
    integer dot products per group, then the group's float scale and offset."""
    n, k = w.shape
    g, per = w.group, 1
    if w.supers_every % 2 == 0 and (k // g) % w.supers_every == 0 and quant.stored_scales(w) < 2:
        spans = range(2, min(w.supers_every, SPAN_K // g) + 1, 2)
        per = max(p for p in spans if w.supers_every % p == 0)
    xs = x.float().reshape(x.shape[0], k // (g * per), g * per)
    amax = xs.abs().amax(-1, keepdim=True)
    # 127 / amax divided as the kernel does: torch's scalar / tensor multiplies by a
    # reciprocal, one ulp off at times, and a product on a .5 tie then rounds the other way
    inv = torch.full_like(amax, 127.0).div(amax)
    q_a = torch.round(xs * torch.where(amax > 0, inv, 0)).clamp(-127, 127)
    q_a = q_a.reshape(x.shape[0], k // g, g)
    d_a = (amax / 127).repeat_interleave(per, 1)
    d = w.d.float().repeat_interleave(w.supers_every, 1)[:, : k // g]
    m = w.m.float().repeat_interleave(w.supers_every, 1)[:, : k // g]
    u = w.u.float().reshape(n, k // g, g)
    dots = torch.einsum("rgk,ngk->rng", q_a.double(), u.double()).float()  # exact integers
    sums = q_a.sum(-1)  # [rows, groups]
    scale, offset = d * w.scale.float(), m * w.offset.float()  # [n, groups]
    return (dots * d_a.squeeze(-1)[:, None, :] * scale).sum(-1) - (
        (d_a.squeeze(-1) * sums) @ offset.T
    )


def _weights() -> list[QuantTensor]:
    rng = np.random.default_rng(1)
    out = []
    for qtype in (QT.Q4_0, QT.Q4_K, QT.Q5_0, QT.Q6_K, QT.Q8_0):
        kept = quant.from_gguf(qtype, _blocks(qtype, 96, 512, rng), (96, 512))
        assert kept is not None
        out.append(kept)
    out += [quant.quantize(torch.randn(96, 512), bits) for bits in (4, 8)]
    return out


@each_target
@pytest.mark.parametrize("index", range(7))
def test_quant_linear_computes_the_quantized_product(target: str, index: int) -> None:
    w = _weights()[index]
    packed = quant.pack(w)
    x = torch.randn(7, 512).bfloat16()
    bias = torch.randn(96)
    out = kernels.ops_for(target).quant_linear(x, packed, bias, True)
    expected = _reference(x, w) + bias
    torch.testing.assert_close(out, expected, atol=2e-5 * expected.abs().max().item(), rtol=0)
    # and close to the dense product: the int8 activations cost well under 1%
    dense = x.float() @ w.dequantize().T + bias
    assert (out - dense).abs().max() < 0.02 * dense.abs().max()


def _gated(
    rng: np.random.Generator, qtype: QT = QT.Q4_K
) -> tuple[QuantTensor, QuantTensor, torch.Tensor]:
    """A gate and up of 64 x 512, and the packed gated weight of both (16 gate columns, then
    their 16 up columns, and so on), packed by the models' own gated linear."""
    gate, up = (quant.from_gguf(qtype, _blocks(qtype, 64, 512, rng), (64, 512)) for _ in "gu")
    assert gate is not None and up is not None
    both = quant.concat([gate, up])
    assert both is not None
    return gate, up, QuantGatedLinear(QuantLinear(both), gelu=False).packed


def test_every_target_gives_the_same_bits() -> None:
    """A laptop's AVX2 kernels and this CPU's own compute each column with the same integer
    sums: outputs (float and bf16, plain and gated, in tiles of 1 to 8 rows) are identical.
    AVX2 without VNNI adds a span's scaled sums in int32 where the others add them in float,
    the same numbers while they stay under 2^24, as they do in weights like these."""
    assert "avx2" in TARGETS or "avx2" not in kernels.runnable_isas()
    for target in set(TARGETS) - {"native"}:  # each runs its own instructions
        assert kernels.ops_for(target).quant_isa() == target
    rng = np.random.default_rng(4)
    gated = _gated(rng)[2]
    weights = [quant.pack(w) for w in _weights()]
    # this x gives one gated output below bf16's normal range: every target flushes it to
    # zero, as VCVTNEPS2BF16 does
    x = torch.randn(70, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    bias = torch.randn(96)

    def outputs(target: str) -> list[torch.Tensor]:
        ops = kernels.ops_for(target)
        plain = [ops.quant_linear(x, w, bias, True) for w in weights]
        plain += [ops.quant_linear(x[:3], w, None, False) for w in weights]
        return plain + [ops.quant_gated_linear(x, gated, None, gelu) for gelu in (0, 1)]

    first = outputs(TARGETS[0])
    for target in TARGETS[1:]:
        assert all(torch.equal(a, b) for a, b in zip(first, outputs(target), strict=True))


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q5_K, QT.Q6_K])
def test_amx_tiles_give_the_vector_tiles_bits(qtype: QT) -> None:
    """Where the CPU has AMX, K-quant calls of 32 rows or more (16 for 6-bit weights) run on
    its tiles (the weights scaled per span first): the same outputs as the AVX512 tiles,
    plain and gated."""
    ops = kernels.ops()
    if not ops.set_amx(True):
        pytest.skip("no AMX here (the CPU lacks it or Linux refused the tile state)")
    rng = np.random.default_rng(6)
    w = quant.from_gguf(qtype, _blocks(qtype, 64, 1024, rng), (64, 1024))
    assert w is not None
    packed = quant.pack(w)
    x, bias = torch.randn(300, 1024).bfloat16(), torch.randn(64)

    def outputs() -> list[torch.Tensor]:
        return [ops.quant_linear(x[:n], packed, bias, True) for n in (16, 21, 32, 47, 300)] + [
            ops.quant_gated_linear(x[:40], packed, None, gelu) for gelu in (0, 1)
        ]

    tiles = outputs()
    try:
        ops.set_amx(False)
        vectors = outputs()
    finally:
        ops.set_amx(True)
    assert all(torch.equal(a, b) for a, b in zip(tiles, vectors, strict=True))
    expected = _reference(x, w) + bias
    torch.testing.assert_close(tiles[4], expected, atol=2e-5 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize(
    ("qtype", "stored"), [(QT.Q4_K, 0), (QT.Q5_K, 0), (QT.Q6_K, 1), (QT.Q4_0, 2), (QT.Q8_0, 2)]
)
def test_scales_that_repeat_are_not_stored(qtype: QT, stored: int) -> None:
    """Q6_K's offset is its scale, and the legacy types' scale and offset are 1: the packed
    weight leaves out what repeats, so a token reads fewer bytes. (Q6_K adds a constant per
    column and superblock that only calls of several rows read.)"""
    n, k = 32, 512
    kept = quant.from_gguf(qtype, _blocks(qtype, n, k, np.random.default_rng(5)), (n, k))
    assert kept is not None
    assert quant.stored_scales(kept) == stored
    sup = n * k // (kept.group * kept.supers_every) * 4
    both = 128 + n * k * kept.bits // 8 + n * k // kept.group * 2 + sup
    fold = sup + 64 if qtype == QT.Q6_K else 0  # int32 as D and M take 2 x fp16, aligned
    assert quant.pack(kept).numel() <= both - n * k // kept.group * stored + 128 + fold


@each_target
def test_a_rows_output_does_not_depend_on_the_other_rows(target: str) -> None:
    """A row gets the same bits alone, among a few (up to 4 rows read the weights in another
    order: twins far apart on Intel, one stream on AMD, one row there in 256-bit halves) and
    among 70, plain and gated. (Q6_K's calls of several rows sum other integers to the same
    totals, see quant_linear.cpp's kSpanFold: the same bits while they stay under 2^24.)"""
    ops = kernels.ops_for(target)
    for i, w in enumerate(_weights()):
        packed = quant.pack(w)
        x = torch.randn(70, 512).bfloat16()
        bias = torch.randn(96) if i % 2 else None
        together = ops.quant_linear(x, packed, bias, True)
        for r, n in ((0, 1), (5, 3), (66, 4), (69, 1)):
            alone = ops.quant_linear(x[r : r + n], packed, bias, True)
            assert torch.equal(alone, together[r : r + n])
    x = torch.randn(37, 512).bfloat16()
    for qtype, bias, gelu in (
        (QT.Q4_K, None, False),
        (QT.Q4_K, torch.randn(128), True),
        (QT.Q6_K, torch.randn(128), False),
    ):
        gated = _gated(np.random.default_rng(7), qtype)[2]
        together = ops.quant_gated_linear(x, gated, bias, gelu)
        for r, n in ((0, 1), (3, 2), (33, 4), (36, 1)):
            alone = ops.quant_gated_linear(x[r : r + n], gated, bias, gelu)
            assert torch.equal(alone, together[r : r + n])


@each_target
@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q6_K])
def test_gated_quant_linear_is_act_gate_times_up(target: str, qtype: QT) -> None:
    """Over 9 rows: a tile of 8 (Q6_K's, gate then up) or of 4, and one of a row."""
    gate, up, packed = _gated(np.random.default_rng(2), qtype)
    x = torch.randn(9, 512).bfloat16()
    for gelu, act in ((False, torch.nn.functional.silu), (True, None)):
        out = kernels.ops_for(target).quant_gated_linear(x, packed, None, gelu).float()
        g, u = _reference(x, gate), _reference(x, up)
        g = act(g) if act else torch.nn.functional.gelu(g, approximate="tanh")
        expected = g * u
        torch.testing.assert_close(out, expected, atol=1e-2 * expected.abs().max().item(), rtol=0)


@pytest.mark.parametrize(
    "types", [(QT.Q4_K, QT.Q6_K), (QT.Q4_K, QT.Q8_0), (QT.Q5_0, QT.Q4_K, QT.Q6_K)], ids=str
)
def test_q_k_and_v_of_different_types_concatenate_exactly(types: tuple[QT, ...]) -> None:
    """Q4_K_M files hold q and k in Q4_K and v in Q6_K: one projection holds all three."""
    rng = np.random.default_rng(3)
    parts = [quant.from_gguf(t, _blocks(t, 16, 512, rng), (16, 512)) for t in types]
    assert all(p is not None for p in parts)
    both = quant.concat(parts)  # type: ignore[arg-type]
    expected = torch.cat([p.dequantize() for p in parts])  # type: ignore[union-attr]
    assert torch.equal(both.dequantize(), expected)
    if kernels.has_quant():
        x = torch.randn(3, 512).bfloat16()
        out = kernels.ops().quant_linear(x, quant.pack(both), None, True)
        expected = _reference(x, both)
        torch.testing.assert_close(out, expected, atol=2e-5 * expected.abs().max().item(), rtol=0)


@each_target
@pytest.mark.parametrize(
    "types", [(QT.Q4_K, QT.Q4_K, QT.Q6_K), (QT.Q5_0, QT.Q4_K, QT.Q6_K)], ids=str
)
def test_q_k_and_v_of_different_layouts_are_read_each_at_its_own_bits(
    target: str, types: tuple[QT, ...]
) -> None:
    """A projection over q, k and v whose layouts differ keeps each layout a part (Q4_K_M's
    q and k in Q4_K, v in Q6_K: two; three where all differ), read part after part at its
    own bits into one output: each part's columns are its own call's, bit for bit, at 1 to
    9 rows, a row gets the same bits alone as among others, and the weight is smaller than
    all of it widened to the most bits."""
    rng = np.random.default_rng(5)
    ops = kernels.ops_for(target)
    shapes = (32, 16, 16)
    linears = []
    for qtype, n in zip(types, shapes, strict=True):
        w = quant.from_gguf(qtype, _blocks(qtype, n, 512, rng), (n, 512))
        assert w is not None
        linears.append(QuantLinear(w, torch.randn(n)))
    fused = QuantLinear.concat(linears)
    layouts = [lin.quantized().layout for lin in linears]
    groups = [layouts[0]] + [b for a, b in zip(layouts, layouts[1:], strict=False) if b != a]
    assert fused.parts is not None and [p.layout for p in fused.parts] == groups
    assert fused.out_features == sum(shapes) and fused.in_features == 512
    # the widened whole, for a CPU that dequantizes: the same numbers
    expected = torch.cat([lin.quantized().dequantize() for lin in linears])
    assert torch.equal(fused.quantized().dequantize(), expected)
    widened = quant.pack(fused.quantized())
    bias = torch.cat([lin.bias.detach() for lin in linears])  # type: ignore[union-attr]
    parts, fused_bias = fused.parts, bias
    fused.pack()
    packed = fused.packed
    assert packed is not None and fused.parts is None
    assert int(packed[:8].view(torch.int64)) == quant.PARTS_MAGIC
    assert packed.numel() < widened.numel()
    x = torch.randn(9, 512).bfloat16()
    for rows in (9, 1):
        out = ops.quant_linear(x[:rows], packed, fused_bias, True)
        apart, col = [], 0
        for part in parts:
            n = part.shape[0]
            apart.append(ops.quant_linear(x[:rows], quant.pack(part), bias[col : col + n], True))
            col += n
        assert torch.equal(out, torch.cat(apart, -1))
        reference = torch.cat([_reference(x[:rows], p) for p in parts], -1) + bias
        torch.testing.assert_close(out, reference, atol=2e-5 * reference.abs().max().item(), rtol=0)
    together = ops.quant_linear(x, packed, None, False)
    assert together.dtype == torch.bfloat16 and together.shape == (9, sum(shapes))
    for r, n in ((0, 1), (4, 3), (8, 1)):
        assert torch.equal(ops.quant_linear(x[r : r + n], packed, None, False), together[r : r + n])


def test_a_weight_of_parts_that_does_not_hold_them_is_refused() -> None:
    """A parts header pointing past the tensor's end, or a gated call over parts: an error,
    not a read out of bounds."""
    if not kernels.has_quant():
        pytest.skip("this CPU has no quantized kernel")
    rng = np.random.default_rng(6)
    parts = [quant.from_gguf(t, _blocks(t, 16, 512, rng), (16, 512)) for t in (QT.Q4_K, QT.Q6_K)]
    packed = quant.pack_parts(parts)  # type: ignore[arg-type]
    x = torch.randn(2, 512).bfloat16()
    assert kernels.ops().quant_linear(x, packed, None, True).shape == (2, 32)
    with pytest.raises(RuntimeError, match="truncated"):
        kernels.ops().quant_linear(x, packed[: packed.numel() // 2].clone(), None, True)
    with pytest.raises(RuntimeError, match="one part"):
        kernels.ops().quant_gated_linear(x, packed, None, False)


def test_quantize_at_load_is_close_to_the_weight() -> None:
    w = torch.randn(64, 256)
    for bits, tol in ((8, 0.01), (4, 0.2)):
        q = quant.quantize(w, bits)
        err = (q.dequantize() - w).abs().max() / w.abs().max()
        assert err < tol, (bits, err)


@pytest.mark.parametrize("qtype", quant.GGUF_TYPES, ids=lambda t: t.name)
def test_a_quantized_embedding_looks_up_the_dequantized_tables_rows(qtype: QT) -> None:
    """Token rows of a table kept quantized (as a GGUF embedding is) are the rows of the
    dequantized table, bit for bit, in bf16 and float32, on every target; an id outside the
    table is refused."""
    table = quant.from_gguf(qtype, _blocks(qtype, 40, 512, np.random.default_rng(5)), (40, 512))
    assert table is not None
    ids = torch.tensor([[3, 0, 39], [3, 17, 8]])
    for dtype in (torch.bfloat16, torch.float32):
        embedding = QuantEmbedding(table, dtype)
        expected = table.dequantize(dtype)[ids]
        assert torch.equal(embedding(ids), expected)
        fields = (embedding.u, embedding.scale, embedding.offset, embedding.d, embedding.m)
        for target in TARGETS:
            rows = kernels.ops_for(target).quant_embedding(
                ids.reshape(-1), *fields, *embedding.layout, dtype
            )
            assert torch.equal(rows.view(2, 3, -1), expected)
    with pytest.raises(RuntimeError, match="outside the table"):
        embedding(torch.tensor([40]))
