"""Quantized weights kept quantized: GGUF blocks in three packed layouts, read by one kernel.

Every GGUF type we keep is one formula, ``w = D*s*u - M*o``, with the file's own numbers:

- ``u``: an unsigned 4-, 6- or 8-bit value per weight;
- ``s``, ``o``: int8 scale and offset per group of ``G`` weights (32, or 16 for Q6_K);
- ``D``, ``M``: float16 per superblock of ``S`` groups (one group for the legacy types).

So Q4_0 is ``d*u - 8d`` (s = o = 1, M = 8d), Q4_1 ``d*u + m``, Q5_0/Q5_1 the same with 5-bit
``u`` held in 6 bits, Q8_0 ``d*(u - 128)``, Q4_K/Q5_K ``d*sc*u - dmin*m`` with their 6-bit
sub-block scales and minimums, and Q6_K ``d*sc*(u - 32)`` (o = s, M = 32d). Each product is
exact in float32, so :func:`dequantize` gives back what ``gguf`` dequantizes, bit for bit.

:class:`QuantTensor` holds the unpacked arrays while a model is built (q/k/v and gate/up
concatenate along the output axis when their layouts agree); :func:`pack` writes the one
uint8 tensor that ``quant_linear.cpp`` reads, leaving out s and o where they repeat (Q6_K's
o is its s; the legacy types' are 1). Where they do not agree (Q4_K_M's Q4_K q and k beside
a Q6_K v), :func:`pack_parts` puts each layout's packed weight in one tensor, which the kernel
reads part after part, each at its own bits.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf.quants import Q4_K

from infer.models import huge_pages

MAGIC = 0x32544E4951  # "QINT2", the kernel checks it
PARTS_MAGIC = 0x5354524150494E51  # "QNIPARTS": a weight of parts (pack_parts)
_HEADER = 128
LANES = 16  # output columns per packed block


@dataclass
class QuantTensor:
    """A ``[N, K]`` weight as ``w = D*s*u - M*o`` (see the module docstring)."""

    u: torch.Tensor  # uint8 [N, K]
    scale: torch.Tensor  # int8 [N, K / group]
    offset: torch.Tensor  # int8 [N, K / group]
    d: torch.Tensor  # float16 [N, supers]
    m: torch.Tensor  # float16 [N, supers]
    bits: int  # 4, 6 or 8: how u is stored
    group: int  # 16 or 32
    supers_every: int  # groups per superblock

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.u.shape[0]), int(self.u.shape[1])

    @property
    def layout(self) -> tuple[int, int, int]:
        return self.bits, self.group, self.supers_every

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[N, K]``: ``(D*s)*u - (M*o)`` in float32, as ``gguf`` computes it."""
        n, k = self.shape
        g, s = self.group, self.supers_every
        d = self.d.float().repeat_interleave(s, dim=1)[:, : k // g]
        m = self.m.float().repeat_interleave(s, dim=1)[:, : k // g]
        scale = (d * self.scale.float())[:, :, None]  # per group, broadcast over its weights
        offset = (m * self.offset.float())[:, :, None]
        out = torch.empty(n, k, dtype=dtype)
        step = max(1, _CHUNK // k)  # a few MB of rows at a time: the temporaries stay in cache
        for r in range(0, n, step):
            u = self.u[r : r + step].view(-1, k // g, g).float()
            out[r : r + step] = (scale[r : r + step] * u - offset[r : r + step]).view(-1, k)
        return out


def concat(parts: list[QuantTensor]) -> QuantTensor:
    """The rows of ``parts`` in one tensor, in a layout that holds each exactly (see
    :func:`widen`): Q4_K's q and k beside Q6_K's v become one 6-bit, 16-group tensor. (The
    kernel reads such neighbours as parts instead, each at its own bits: :func:`pack_parts`.)"""
    if any(p.shape[1] != parts[0].shape[1] for p in parts):
        raise ValueError("parts to concatenate must have the same input features")
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    span = min(p.group * p.supers_every for p in parts)
    parts = [widen(p, bits, group, span // group) for p in parts]
    return QuantTensor(
        torch.cat([p.u for p in parts]),
        torch.cat([p.scale for p in parts]),
        torch.cat([p.offset for p in parts]),
        torch.cat([p.d for p in parts]),
        torch.cat([p.m for p in parts]),
        bits,
        group,
        span // group,
    )


def widen(t: QuantTensor, bits: int, group: int, supers_every: int) -> QuantTensor:
    """``t`` in a layout with as many or more bits, the same or smaller groups and
    superblocks: the same numbers (u unchanged, s and o repeated over split groups, D and M
    over split superblocks)."""
    if t.layout == (bits, group, supers_every):
        return t
    span, old_span = group * supers_every, t.group * t.supers_every
    if bits < t.bits or t.group % group or old_span % span:
        raise ValueError(f"cannot hold layout {t.layout} as {(bits, group, supers_every)}")
    split, super_split = t.group // group, old_span // span
    return QuantTensor(
        t.u,
        t.scale.repeat_interleave(split, dim=1),
        t.offset.repeat_interleave(split, dim=1),
        t.d.repeat_interleave(super_split, dim=1),
        t.m.repeat_interleave(super_split, dim=1),
        bits,
        group,
        supers_every,
    )


def rows(t: QuantTensor, index: torch.Tensor) -> QuantTensor:
    """The rows ``index`` of ``t`` (output features), e.g. to interleave gate and up."""
    return QuantTensor(
        t.u[index], t.scale[index], t.offset[index], t.d[index], t.m[index], *t.layout
    )


def pack(t: QuantTensor, empty: Callable[[int], torch.Tensor] = huge_pages.empty) -> torch.Tensor:
    """The uint8 tensor ``quant_linear.cpp`` reads: header, then u, the scales that do not
    repeat (s and o, s alone, or none: :func:`stored_scales`), (D, M) per 16 output columns
    and, where every weight is D s (u - 32), each column's constant C per superblock. The
    bytes come from ``empty`` (zeroed): 2 MB pages, which are never given back piecemeal."""
    n, k = t.shape
    if n % LANES or k % 32:
        raise ValueError(f"a quantized linear needs N % 16 == 0 and K % 32 == 0, got {n}x{k}")
    if int(t.u.max()) >> t.bits:
        raise ValueError(f"values do not fit the {t.bits}-bit layout")
    blocks = n // LANES
    groups, supers = k // t.group, t.d.shape[1]
    stored = stored_scales(t)
    kept = [[t.scale, t.offset], [t.scale], []][stored]
    # bytes per 16-column block: u, the kept scales, fp16 D and M per superblock
    q_block, sc_block = k * LANES * t.bits // 8, groups * LANES * len(kept)
    sup_block = supers * 2 * 2 * LANES
    off_sc = _align(_HEADER + blocks * q_block)
    off_sup = _align(off_sc + blocks * sc_block)
    # 1 where every weight is D s (u - 32), as Q6_K's are (o = s, M = 32 D): the kernels then
    # take 32 s off each s u instead of summing the offsets apart
    folded = int(stored == 1 and torch.equal(t.m.float(), t.d.float() * 32))
    # and there C = 128 * sum over the superblock's k's of s (u - 32), per column: tiles of
    # several rows take x + 128 as unsigned and u - 32 as signed, and C off each sum
    cc_block = supers * LANES * 4 if folded else 0
    off_cc = _align(off_sup + blocks * sup_block) if folded else 0
    out = empty(max(off_sup + blocks * sup_block, off_cc + blocks * cc_block))  # zeroed
    _write_header(
        out, [MAGIC, t.bits, t.group, t.supers_every, n, k, off_sc, off_sup, stored, folded, off_cc]
    )
    # a few MB at a time (see from_gguf); every part is laid out block after block
    step = max(1, _CHUNK // (LANES * k))
    for b0 in range(0, blocks, step):
        b1 = min(blocks, b0 + step)
        rows = slice(b0 * LANES, b1 * LANES)
        q = _pack_values(t.u[rows], t.bits)
        out[_HEADER + b0 * q_block : _HEADER + b1 * q_block] = q
        if kept:
            sc = torch.stack([s[rows] for s in kept], dim=1)
            sc = sc.view(b1 - b0, LANES, len(kept), groups).permute(0, 3, 2, 1).reshape(-1)
            out[off_sc + b0 * sc_block : off_sc + b1 * sc_block] = sc.view(torch.uint8)
        sup = torch.stack([t.d[rows], t.m[rows]], dim=1)  # [rows, 2, supers]
        sup = sup.view(b1 - b0, LANES, 2, supers).permute(0, 3, 2, 1).contiguous()
        out[off_sup + b0 * sup_block : off_sup + b1 * sup_block] = sup.view(torch.uint8).view(-1)
        if folded:
            cc = _fold_constants(t, rows).view(b1 - b0, LANES, supers).transpose(1, 2)
            cc = cc.contiguous().view(torch.uint8).view(-1)  # [blocks, supers, 16] int32
            out[off_cc + b0 * cc_block : off_cc + b1 * cc_block] = cc
    return out


def pack_parts(parts: list[QuantTensor]) -> torch.Tensor:
    """``parts`` (the output rows of one linear, in order) in one uint8 tensor: a header of
    :data:`PARTS_MAGIC`, the count and where each part starts, then each part as :func:`pack`
    writes it. The kernel reads each at its own layout, into its columns of one output."""
    if not 1 <= len(parts) <= _HEADER // 8 - 2:
        raise ValueError(f"a weight of parts has 1 to {_HEADER // 8 - 2} parts")
    # each part packed in torch's memory first, which goes back (the pages' arena keeps all)
    packed = [pack(p, lambda n: torch.zeros(n, dtype=torch.uint8)) for p in parts]
    starts, at = [], _HEADER
    for one in packed:
        starts.append(at)
        at = _align(at + one.numel())
    out = huge_pages.empty(starts[-1] + packed[-1].numel())
    _write_header(out, [PARTS_MAGIC, len(parts), *starts])
    for start, one in zip(starts, packed, strict=True):
        out[start : start + one.numel()] = one
    return out


def _write_header(out: torch.Tensor, fields: list[int]) -> None:
    """``fields`` as int64 at the start of ``out``, zeros after them to :data:`_HEADER` bytes."""
    header = torch.tensor(fields + [0] * (_HEADER // 8 - len(fields)), dtype=torch.int64)
    out[:_HEADER] = header.view(torch.uint8)


def _fold_constants(t: QuantTensor, rows: slice) -> torch.Tensor:
    """128 * sum_k s (u - 32) per row of ``rows`` and superblock (int32; at most 128 * 256 *
    128 * 32 = 2^27 in magnitude)."""
    u = t.u[rows].to(torch.int32) - 32
    n, k = u.shape
    per_group = u.view(n, k // t.group, t.group).sum(-1) * t.scale[rows].to(torch.int32)
    supers = t.d.shape[1]
    padded = torch.zeros(n, supers * t.supers_every, dtype=torch.int32)
    padded[:, : per_group.shape[1]] = per_group
    return (padded.view(n, supers, t.supers_every).sum(-1) * 128).to(torch.int32)


def _pack_values(u: torch.Tensor, bits: int) -> torch.Tensor:
    """``u`` (``[16 * blocks, K]``) in the kernel's order for ``bits`` (see ``pack``).

    Four k's of a column are one int32, and the nibble work is bytewise on int32 lanes
    (values under 16 shift within their byte): a quarter of the elements to move.
    """
    n, k = u.shape
    blocks = n // LANES
    steps = u.contiguous().view(torch.int32).view(blocks, LANES, k // 4).transpose(1, 2)
    steps = steps.contiguous()  # [B, K/4, 16]: four k's of 16 columns per step
    if bits == 4:
        pairs = steps.view(blocks, k // 8, 2, LANES)  # steps 2j (low nibble) and 2j+1 (high)
        steps = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
    elif bits == 6:
        # Per four steps: their low nibbles as in the 4-bit layout (two vectors), then one
        # vector of their high two bits (step j's in bits 2j, 2j + 1).
        quad = steps.view(blocks, k // 16, 4, LANES)
        lo, hi = quad & 0x0F0F0F0F, (quad >> 4) & 0x03030303
        nibbles = lo[:, :, 0::2] | (lo[:, :, 1::2] << 4)
        tops = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
        steps = torch.cat([nibbles, tops.unsqueeze(2)], dim=2)
    return steps.contiguous().view(torch.uint8).reshape(-1)


def stored_scales(t: QuantTensor) -> int:
    """Which of ``s`` and ``o`` a packed weight holds: 0 both, 1 ``s`` alone (every ``o`` is
    its ``s``: Q6_K), 2 neither (``s = o = 1``: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0). Half a bit a
    weight fewer to read for Q6_K, and for the legacy types half a bit and the scale work."""
    if not torch.equal(t.offset, t.scale):
        return 0
    return 2 if bool((t.scale == 1).all()) else 1


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


# --- from GGUF blocks ----------------------------------------------------------------------

# The types kept quantized, and the layouts they land in.
GGUF_TYPES = (QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K)


def from_gguf(qtype: QT, data: np.ndarray, shape: tuple[int, ...]) -> QuantTensor | None:
    """A ``[N, K]`` GGUF tensor's blocks (``data``: its raw bytes) as a :class:`QuantTensor`,
    or ``None`` for a type not in :data:`GGUF_TYPES`."""
    if qtype not in GGUF_TYPES or len(shape) != 2:
        return None
    n, k = shape
    bits, group, every = _LAYOUT[qtype]
    out = QuantTensor(
        torch.empty(n, k, dtype=torch.uint8),
        torch.empty(n, k // group, dtype=torch.int8),
        torch.empty(n, k // group, dtype=torch.int8),
        torch.empty(n, k // (group * every), dtype=torch.float16),
        torch.empty(n, k // (group * every), dtype=torch.float16),
        bits,
        group,
        every,
    )
    blocks = np.ascontiguousarray(data).view(np.uint8).reshape(n, k // _BLOCK[qtype], -1)
    # A few MB of rows at a time, on every core (numpy lets go of the GIL): the decoders'
    # temporaries stay in cache instead of being paged in afresh for every step.
    step = max(1, _CHUNK // k)

    def decode(r0: int) -> None:
        r1 = min(n, r0 + step)
        values = _DECODE[qtype](blocks[r0:r1].reshape(-1, blocks.shape[-1]))
        for field, value in zip((out.u, out.scale, out.offset, out.d, out.m), values, strict=True):
            view = field[r0:r1].numpy()
            view[...] = value.reshape(view.shape)

    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        list(pool.map(decode, range(0, n, step)))
    return out


_CHUNK = 1 << 20  # weights decoded at a time
# bits of u, group, groups per superblock
_LAYOUT = {QT.Q4_0: (4, 32, 1), QT.Q4_1: (4, 32, 1), QT.Q5_0: (6, 32, 1), QT.Q5_1: (6, 32, 1)}
_LAYOUT |= {QT.Q8_0: (8, 32, 1), QT.Q4_K: (4, 32, 8), QT.Q5_K: (6, 32, 8), QT.Q6_K: (6, 16, 16)}


_BLOCK = {QT.Q4_0: 32, QT.Q4_1: 32, QT.Q5_0: 32, QT.Q5_1: 32, QT.Q8_0: 32}
_BLOCK |= {QT.Q4_K: 256, QT.Q5_K: 256, QT.Q6_K: 256}
Decoded = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # u, s, o, D, M


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).reshape(-1)


# The bit work runs on 8 bytes at a time: a uint64 lane shifts and masks its bytes together
# (the masks drop what crosses from a neighbouring byte).
_LOW4, _LOW2, _LOW1 = (np.uint64(m * 0x0101010101010101) for m in (0x0F, 0x03, 0x01))


def _lanes(b: np.ndarray, chunks: int) -> np.ndarray:
    """Each row of bytes ``b`` as ``chunks`` equal runs of uint64 lanes: ``[rows, chunks, 1,
    lanes]``, ready to stack what each run decodes to along axis 2."""
    return np.ascontiguousarray(b).view(np.uint64).reshape(len(b), chunks, 1, -1)


def _split(q: np.ndarray, shifts: tuple[int, ...], mask: np.uint64) -> np.ndarray:
    """``(q >> s) & mask`` for each shift, stacked along axis 2."""
    return np.concatenate([(q >> np.uint64(s)) & mask for s in shifts], axis=2)


def _bytes(u: np.ndarray) -> np.ndarray:
    """uint64 lanes back to a row of bytes."""
    return u.reshape(len(u), -1).view(np.uint8)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Legacy blocks' 16 bytes: low nibbles are weights 0-15, high nibbles 16-31."""
    return _bytes(_split(_lanes(qs, 1), (0, 4), _LOW4))


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits (a little-endian uint32) as 0 or 16 per weight."""
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little") << 4


def _ones(nb: int) -> np.ndarray:
    return np.ones(nb, dtype=np.int8)


def _q4_0(b: np.ndarray) -> Decoded:
    d = _f16(b[:, :2])
    return _nibbles(b[:, 2:]), _ones(len(b)), _ones(len(b)), d, d * np.float16(8)


def _q4_1(b: np.ndarray) -> Decoded:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:]), _ones(len(b)), _ones(len(b)), d, -m


def _q5_0(b: np.ndarray) -> Decoded:
    d = _f16(b[:, :2])
    u = _nibbles(b[:, 6:]) | _high_bits(b[:, 2:6])
    return u, _ones(len(b)), _ones(len(b)), d, d * np.float16(16)


def _q5_1(b: np.ndarray) -> Decoded:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    u = _nibbles(b[:, 8:]) | _high_bits(b[:, 4:8])
    return u, _ones(len(b)), _ones(len(b)), d, -m


def _q8_0(b: np.ndarray) -> Decoded:
    d = _f16(b[:, :2])
    u = (b[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
    return u, _ones(len(b)), _ones(len(b)), d, d * np.float16(128)


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = Q4_K.get_scale_min(b[:, 4:16])
    return d, dmin, sc.astype(np.int8), mn.astype(np.int8)


def _q4_k(b: np.ndarray) -> Decoded:
    """Four runs of 32 bytes: low nibbles weights 0-31 of the run's 64, high nibbles 32-63."""
    d, dmin, sc, mn = _k_scales(b)
    return _bytes(_split(_lanes(b[:, 16:], 4), (0, 4), _LOW4)), sc, mn, d, dmin


def _q5_k(b: np.ndarray) -> Decoded:
    """Q4_K's nibbles, and bit j of the 32 high-bit bytes is the fifth bit of weights
    32j to 32j + 31."""
    d, dmin, sc, mn = _k_scales(b)
    low = _split(_lanes(b[:, 48:], 4), (0, 4), _LOW4).reshape(len(b), 8, -1)
    high = _split(_lanes(b[:, 16:48], 1), tuple(range(8)), _LOW1).reshape(len(b), 8, -1)
    return _bytes(low | (high << np.uint64(4))), sc, mn, d, dmin


def _q6_k(b: np.ndarray) -> Decoded:
    """Per half of 128 weights: 64 bytes of low nibbles (weights 0-63 low, 64-127 high) and
    32 bytes whose bit pairs 0-1, 2-3, 4-5, 6-7 are the top bits of weights 0-31 ... 96-127."""
    scales, d = b[:, 192:208], _f16(b[:, 208:210])
    low = _split(_lanes(b[:, :128], 2), (0, 4), _LOW4).reshape(len(b), 8, -1)
    high = _split(_lanes(b[:, 128:192], 2), (0, 2, 4, 6), _LOW2).reshape(len(b), 8, -1)
    sc = np.ascontiguousarray(scales).view(np.int8)
    return _bytes(low | (high << np.uint64(4))), sc, sc, d, d * np.float16(32)


_DECODE = {
    QT.Q4_0: _q4_0,
    QT.Q4_1: _q4_1,
    QT.Q5_0: _q5_0,
    QT.Q5_1: _q5_1,
    QT.Q8_0: _q8_0,
    QT.Q4_K: _q4_k,
    QT.Q5_K: _q5_k,
    QT.Q6_K: _q6_k,
}


# --- from float weights (--weights int8 / int4) ----------------------------------------------


def quantize(w: torch.Tensor, bits: int) -> QuantTensor:
    """A float ``[N, K]`` weight quantized per group of 32: 8-bit symmetric (Q8_0's rule) or
    4-bit with a minimum (Q4_1's rule)."""
    n, k = w.shape
    g = w.float().reshape(n, k // 32, 32)
    if bits == 8:
        d = (g.abs().amax(-1) / 127).half()
        inv = torch.where(d == 0, 0, 1 / d.float())
        q = torch.round(g * inv.unsqueeze(-1)).clamp(-127, 127)
        u = (q + 128).to(torch.uint8)
        m = d * 128
    else:
        lo, hi = g.amin(-1), g.amax(-1)
        d = ((hi - lo) / 15).half()
        inv = torch.where(d == 0, 0, 1 / d.float())
        u = torch.round((g - lo.unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
        m = (-lo).half()
    ones = torch.ones(n, k // 32, dtype=torch.int8)
    return QuantTensor(u.reshape(n, k), ones, ones.clone(), d, m, bits, 32, 1)
