"""The C++ kernels against their torch references."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch

from infer import kernels
from infer.models.layers import decode_attention_torch


@pytest.fixture(params=kernels.runnable_isas())
def ops(request: pytest.FixtureRequest) -> ModuleType:
    """The kernels built for each target this CPU runs: its own, and the AVX2 ones that
    laptops run (their attention, norms and rope take the portable paths)."""
    return kernels.ops_for(request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "head_dim,block,window,groups",
    [
        (64, 16, 0, 3),
        (64, 16, 20, 3),
        (16, 4, 0, 3),
        (128, 16, 0, 3),
        (24, 8, 5, 3),
        (64, 16, 0, 1),
        (64, 16, 0, 5),
        (128, 16, 0, 4),
        (256, 16, 0, 4),
        (64, 16, 7, 8),
        (128, 16, 0, 6),
        (128, 16, 9, 7),
    ],
)
def test_kernel_matches_reference(
    ops: ModuleType, dtype, head_dim: int, block: int, window: int, groups: int
) -> None:
    """Every query-head grouping (GQA 1, 3, 4, 5, 6, 7, 8) and head size, with and without
    windows."""
    gen = torch.Generator().manual_seed(head_dim + block + window + groups)
    lens = [1, 2, block, block + 1, 3 * block - 1, 5 * block, 37]
    _check_decode(ops, gen, lens, 3, groups, head_dim, block, window, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,groups,window", [(128, 6, 0), (64, 3, 1500), (256, 4, 0)])
def test_long_sequences_match_reference(ops: ModuleType, dtype, head_dim, groups, window) -> None:
    """Sequences past a thousand positions, whose values the kernel sums in chunks of
    positions and slices of the head, one sequence alone (its KV heads split over the
    threads) and several together."""
    gen = torch.Generator().manual_seed(head_dim + groups)
    for lens in ([2100], [1500, 37, 1040]):
        _check_decode(ops, gen, lens, 2, groups, head_dim, 16, window, dtype)


def _check_decode(
    ops: ModuleType,
    gen: torch.Generator,
    lens: list[int],
    kv: int,
    groups: int,
    head_dim: int,
    block: int,
    window: int,
    dtype: torch.dtype,
) -> None:
    """The kernel against the torch reference for sequences of ``lens`` positions, each
    owning its own blocks, scattered over a pool with a few spare."""
    n = len(lens)
    max_blocks = -(-max(lens) // block)
    pool = n * max_blocks + 3
    k_cache = torch.randn(pool, kv, head_dim // 2, block, 2, generator=gen).to(dtype)
    v_cache = torch.randn(pool, kv, block // 2, head_dim, 2, generator=gen).to(dtype)
    tables = torch.randperm(pool, generator=gen)[: n * max_blocks].view(n, max_blocks)
    tables = tables.to(torch.int32).contiguous()
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(n, kv * groups, head_dim, generator=gen).to(dtype)
    got = ops.paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.3, window)
    want = decode_attention_torch(
        q.float(), k_cache.float(), v_cache.float(), tables, seq_lens, 0.3, window
    )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 5])
def test_stale_cache_entries_never_reach_an_output(ops: ModuleType, dtype, window: int) -> None:
    """Positions of a sequence's blocks it does not attend (past its length, before its
    window) may hold another sequence's leftovers, even NaN: its output is unchanged."""
    gen = torch.Generator().manual_seed(window)
    n, kv, groups, dim, block = 4, 3, 3, 64, 16
    lens = torch.tensor([1, 7, 18, 33], dtype=torch.int32)
    tables = torch.arange(n * 3, dtype=torch.int32).view(n, 3)
    k_cache = torch.randn(n * 3, kv, dim // 2, block, 2, generator=gen).to(dtype)
    v_cache = torch.randn(n * 3, kv, block // 2, dim, 2, generator=gen).to(dtype)
    q = torch.randn(n, kv * groups, dim, generator=gen).to(dtype)
    want = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125, window)
    stale_k, stale_v = k_cache.clone(), v_cache.clone()
    for seq, length in enumerate(lens.tolist()):
        first = max(0, length - window) if window else 0
        for pos in [*range(first), *range(length, 3 * block)]:
            b, off = tables[seq, pos // block], pos % block
            stale_k[b, :, :, off] = float("nan")
            stale_v[b, :, off // 2, :, off % 2] = float("nan")
    got = ops.paged_decode_attention(q, stale_k, stale_v, tables, lens, 0.125, window)
    assert torch.equal(got, want)


def test_kernel_refuses_mismatched_shapes(ops: ModuleType) -> None:
    q = torch.randn(2, 6, 16)
    k = torch.randn(4, 3, 8, 4, 2)
    v = torch.randn(4, 3, 2, 32, 2)  # head dim differs from q's
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="head dims differ|must be"):
        ops.paged_decode_attention(q, k, v, tables, lens, 1.0, 0)


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same cache ``[blocks, kv_heads, ...]`` with each head's blocks together in memory,
    as :class:`~infer.models.kv_cache.PagedKVCache` lays it out."""
    return cache.transpose(0, 1).contiguous().transpose(0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_major_caches_give_the_same_bits(ops: ModuleType, dtype) -> None:
    """Decode attention and the rotary cache write read and write a head-major pool where a
    block-major one has the same numbers: the same outputs, bit for bit."""
    from infer.models.config import ModelConfig
    from infer.models.kv_cache import PagedKVCache

    gen = torch.Generator().manual_seed(3)
    n, kv, groups, dim, block, blocks = 3, 2, 6, 128, 16, 40
    k_cache = torch.randn(blocks, kv, dim // 2, block, 2, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, kv, block // 2, dim, 2, generator=gen).to(dtype)
    tables = torch.randperm(blocks, generator=gen)[: n * 12].view(n, 12).to(torch.int32)
    lens = torch.tensor([190, 1, 77], dtype=torch.int32)
    q = torch.randn(n, kv * groups, dim, generator=gen).to(dtype)
    want = ops.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.09, 0)
    hk, hv = _head_major(k_cache), _head_major(v_cache)
    assert not hk.is_contiguous()
    assert torch.equal(ops.paged_decode_attention(q, hk, hv, tables, lens, 0.09, 0), want)

    qkv = torch.randn(4, (kv * groups + 2 * kv) * dim, generator=gen).to(dtype)
    angles = torch.rand(4, dim // 2, generator=gen)
    slots = torch.tensor([0, 17, 5 * block + 3, 39 * block + 15])
    stored = []
    for caches in (
        (k_cache.clone(), v_cache.clone()),
        (_head_major(k_cache), _head_major(v_cache)),
    ):
        x = qkv.clone()
        ops.rope_and_cache(x, angles.cos(), angles.sin(), kv * groups, kv, *caches, slots)
        stored.append((x, *caches))
    for a, b in zip(*stored, strict=True):
        assert torch.equal(a, b)

    # the pool the engine allocates is head-major, and the kernels take its layer views
    config = ModelConfig("Qwen2ForCausalLM", 64, kv * groups * dim, 64, 2, kv * groups, kv, dim)
    pool = PagedKVCache(config, blocks, block, dtype)
    layer_k, layer_v = pool.layers[1]
    layer_k.copy_(k_cache)
    layer_v.copy_(v_cache)
    assert torch.equal(ops.paged_decode_attention(q, layer_k, layer_v, tables, lens, 0.09, 0), want)


def test_kernels_refuse_overlapping_cache_layouts(ops: ModuleType) -> None:
    """A cache whose (block, head) slabs are not each contiguous, or whose keys and values
    lie differently, is refused with a message, never read out of place."""
    q = torch.randn(1, 4, 16)
    k = torch.randn(3, 2, 8, 4, 2)
    v = torch.randn(3, 2, 2, 16, 2)
    tables = torch.zeros(1, 3, dtype=torch.int32)
    lens = torch.ones(1, dtype=torch.int32)
    strided = torch.randn(3, 2, 4, 8, 2).transpose(2, 3)  # keys' inner rows out of order
    for kc, vc in ((strided, v), (_head_major(k), v), (k[:, :1].expand(3, 2, 8, 4, 2), v)):
        with pytest.raises(RuntimeError, match="contiguously"):
            ops.paged_decode_attention(q, kc, vc, tables, lens, 1.0, 0)


needs_bf16 = pytest.mark.skipif(not kernels.has_bf16(), reason="this CPU has no AVX512-BF16")


@pytest.fixture(params=["avx512", "amx"])
def tile_kernel(request: pytest.FixtureRequest) -> Iterator[str]:
    """The bf16 linears' two kernels: AVX512-BF16 everywhere, AMX tiles where the CPU has them
    (the default there). Each must pass the same tests on its own."""
    amx = request.param == "amx"
    if kernels.ops().set_amx(amx) != amx:
        kernels.ops().set_amx(True)
        pytest.skip(
            "no AMX-BF16 here (the CPU lacks it or Linux refused the tile state); "
            "the AVX512 run of this test covers this machine"
        )
    try:
        yield request.param
    finally:
        kernels.ops().set_amx(True)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 3, 4, 17, 64, 130, 300])
@pytest.mark.parametrize(
    "out_features,in_features,bias",
    [
        (960, 576, False),
        (100, 576, True),
        (49, 576, False),
        (70, 80, True),
        (64, 1536, True),
        (40, 1184, False),
    ],
)
def test_bf16_linear_matches_float_matmul(
    tile_kernel: str, rows: int, out_features: int, in_features: int, bias: bool
) -> None:
    """Every row count and ragged column tails (and a K the AMX tiles do not divide, which
    takes the AVX512 kernel; Ks that AMX runs in equal and unequal chunks); the same row
    gives the same output in any batch."""
    gen = torch.Generator().manual_seed(rows * out_features)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    packed = kernels.ops().pack_bf16_linear(w)
    got = kernels.ops().bf16_linear(x, packed, out_features, b, True)
    want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(got, want, atol=2e-3 * want.abs().max().item(), rtol=1e-3)
    rounded = kernels.ops().bf16_linear(x, packed, out_features, b, False)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.bfloat16())
    for row in (0, rows - 1):  # batch invariant (rows 0-31 of 64+ run in the 2 x 2 tiles)
        alone = kernels.ops().bf16_linear(x[row : row + 1], packed, out_features, b, True)
        assert torch.equal(alone[0], got[row])


@needs_bf16
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("out_features", [1000, 960])
def test_bf16_linear_is_the_same_on_any_number_of_threads(
    tile_kernel: str, threads: int, out_features: int
) -> None:
    """Each thread takes its own share of column groups, then the others' leftovers (more
    threads than cores here, so shares are taken over): every output comes out the same.
    With two threads, the AVX512 kernel splits the last of an odd number of groups (960
    columns: 15) in two."""
    gen = torch.Generator().manual_seed(threads)
    w = torch.randn(out_features, 576, generator=gen).bfloat16()
    x = torch.randn(150, 576, generator=gen).bfloat16()
    packed = kernels.ops().pack_bf16_linear(w)
    want = torch.cat(
        [
            kernels.ops().bf16_linear(x[i : i + 1], packed, out_features, None, True)
            for i in range(len(x))
        ]
    )  # row by row, on this machine's threads
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(20):
            got = kernels.ops().bf16_linear(x, packed, out_features, None, True)
            assert torch.equal(got, want)
    finally:
        torch.set_num_threads(before)


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 64, 130, 300])
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_gated_linear_matches_torch(
    tile_kernel: str, rows: int, gelu: bool, bias: bool
) -> None:
    """One call projects and gates: act(gate(x)) * up(x), as GatedMLP computes it unfused,
    rounded to bf16 once; the same row gives the same output in any batch."""
    from infer.models.linear import Bf16GatedLinear

    gen = torch.Generator().manual_seed(rows)
    proj = torch.nn.Linear(576, 2 * 192, bias=bias).bfloat16()
    with torch.no_grad():
        proj.weight.copy_(torch.randn(proj.weight.shape, generator=gen) / 24)
        if bias:
            proj.bias.copy_(torch.randn(proj.bias.shape, generator=gen))
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    f = torch.nn.functional
    b = None if proj.bias is None else proj.bias.float()
    gate, up = f.linear(x.float(), proj.weight.float(), b).chunk(2, dim=-1)
    want = (f.gelu(gate, approximate="tanh") if gelu else f.silu(gate)) * up
    fused = Bf16GatedLinear(proj, gelu)
    got = fused(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
    torch.testing.assert_close(got.float(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)
    assert torch.equal(fused(x[-1:])[0], got[-1])  # batch invariant


def _attention_reference(q, k, v, scale: float, start: int, window: int) -> torch.Tensor:
    t, h, _ = q.shape
    kv, s, _ = k.shape
    q_pos = torch.arange(start, start + t)[:, None]
    k_pos = torch.arange(s)[None]
    mask = k_pos <= q_pos
    if window:
        mask &= k_pos > q_pos - window
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(0, 1),
        k.float().repeat_interleave(h // kv, 0),
        v.float().repeat_interleave(h // kv, 0),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)


@needs_bf16
@pytest.mark.parametrize(
    "heads,kv,dim,window", [(9, 3, 64, 0), (4, 1, 256, 20), (8, 8, 128, 0), (6, 2, 64, 7)]
)
def test_paged_prefill_attention_matches_reference(
    tile_kernel: str, heads, kv, dim, window
) -> None:
    """Spans of a packed batch, with and without a cached prefix, over scattered blocks:
    causal, windowed, any GQA grouping; stale (NaN) cache entries past a span never leak; a
    head-major cache gives the same bits."""
    from infer.models.kv_cache import keys_of, values_of

    gen = torch.Generator().manual_seed(heads + dim + window)
    spans = [(5, 37, 0), (42, 16, 34), (58, 1, 32), (59, 70, 20)]  # (offset, length, start)
    rows, max_blocks = 129, 6
    pool = torch.randperm(len(spans) * max_blocks + 2, generator=gen)
    tables = pool[: len(spans) * max_blocks].view(len(spans), max_blocks).to(torch.int32)
    k_cache = torch.randn(len(pool), kv, dim // 2, 16, 2, generator=gen).bfloat16()
    v_cache = torch.randn(len(pool), kv, 8, dim, 2, generator=gen).bfloat16()
    for table, (_, length, start) in zip(tables.tolist(), spans, strict=True):
        for pos in range(start + length, 16 * max_blocks):  # not this sequence's (yet)
            k_cache[table[pos // 16], :, :, pos % 16] = float("nan")
            v_cache[table[pos // 16], :, pos % 16 // 2, :, pos % 2] = float("nan")
    qkv = torch.randn(rows, heads + 2 * kv, dim, generator=gen).bfloat16()
    q = qkv[:, :heads]  # a strided view, as the model passes it
    out = torch.zeros(rows, heads, dim, dtype=torch.bfloat16)
    info = torch.tensor(spans, dtype=torch.int32)
    kernels.ops().paged_prefill_attention(q, k_cache, v_cache, tables, info, dim**-0.5, window, out)
    head_major = torch.zeros_like(out)
    kernels.ops().paged_prefill_attention(
        q, _head_major(k_cache), _head_major(v_cache), tables, info, dim**-0.5, window, head_major
    )
    assert torch.equal(head_major, out)  # the engine's layout, the same bits
    for table, (offset, length, start) in zip(tables.long(), spans, strict=True):
        keys = keys_of(k_cache[table])[:, : start + length]
        values = values_of(v_cache[table])[:, : start + length]
        want = _attention_reference(
            q[offset : offset + length], keys, values, dim**-0.5, start, window
        )
        torch.testing.assert_close(
            out[offset : offset + length].float(), want, atol=3e-2, rtol=3e-2
        )
    assert not out[:5].any() and not out[offset + length :].any()  # other rows untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_norm_kernels_match_torch(ops: ModuleType, dtype, offset: float) -> None:
    from infer.models.layers import RMSNorm

    gen = torch.Generator().manual_seed(int(offset))
    norm = RMSNorm(96, 1e-6, offset)
    norm.weight.data = torch.randn(96, generator=gen)
    norm = norm.to(dtype)
    x = torch.randn(5, 96, generator=gen).to(dtype)
    residual = torch.randn(5, 96, generator=gen).to(dtype)
    want = norm(x.transpose(0, 1).contiguous().transpose(0, 1))  # strided: the torch path
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(ops.rms_norm(x, norm.weight, 1e-6, offset), want, **tol)
    summed = residual + x
    normed, new_residual = norm.add_forward(x.clone(), residual.clone())
    assert torch.equal(new_residual, summed)
    torch.testing.assert_close(
        normed, norm(summed.transpose(0, 1).contiguous().transpose(0, 1)), **tol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gelu", [False, True])
def test_gated_activation_matches_torch(ops: ModuleType, dtype, gelu: bool) -> None:
    x = torch.randn(7, 2 * 83, generator=torch.Generator().manual_seed(1)).to(dtype) * 4
    gate, up = x.float().chunk(2, dim=-1)
    f = torch.nn.functional
    act = f.gelu(gate, approximate="tanh") if gelu else f.silu(gate)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(ops.gated_activation(x, gelu).float(), act * up, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_rotates_and_stores(ops: ModuleType, dtype) -> None:
    """q and k heads rotated in place like apply_rope; k and v land in their slots; -1 skips."""
    from infer.models.layers import apply_rope

    heads, kv, dim, block, n = 4, 2, 16, 4, 6
    gen = torch.Generator().manual_seed(2)
    qkv = torch.randn(n, (heads + 2 * kv) * dim, generator=gen).to(dtype)
    positions = torch.tensor([0, 1, 5, 9, 3, 7])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = positions.float()[:, None] * inv_freq
    k_cache = torch.zeros(5, kv, dim // 2, block, 2, dtype=dtype)
    v_cache = torch.zeros(5, kv, block // 2, dim, 2, dtype=dtype)
    slots = torch.tensor([4, 5, 6, 17, -1, 0])
    before = qkv.view(n, -1, dim).float().clone()
    ops.rope_and_cache(qkv, freqs.cos(), freqs.sin(), heads, kv, k_cache, v_cache, slots)
    cos = torch.cat((freqs.cos(), freqs.cos()), -1)[:, None]
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)[:, None]
    rotated = apply_rope(before[:, : heads + kv], cos, sin)
    after = qkv.view(n, -1, dim).float()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=1e-2)
    torch.testing.assert_close(after[:, : heads + kv], rotated, **tol)
    assert torch.equal(after[:, heads + kv :], before[:, heads + kv :])  # values untouched
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, off = divmod(slot, block)
        stored = qkv.view(n, -1, dim)[i]
        assert torch.equal(k_cache[b, :, :, off].reshape(kv, dim), stored[heads : heads + kv])
        assert torch.equal(v_cache[b, :, off // 2, :, off % 2], stored[heads + kv :])
    assert int((k_cache != 0).any(dim=(1, 2, 4)).sum()) == 5  # the five stored slots, no others
    assert int((v_cache != 0).any(dim=(1, 3)).sum()) == 5


@pytest.mark.parametrize("width", [1, 15, 16, 17, 49152])
def test_argmax_rows_matches_torch(ops: ModuleType, width: int) -> None:
    g = torch.Generator().manual_seed(width)
    x = torch.randn(9, width, generator=g)
    x[1] = 0.5  # all tied: the first index
    x[2, width // 2 :] = float("nan")  # NaN is the largest, the first NaN wins
    x[3] = float("-inf")
    x[4, -1] = 1e30  # the very last lane (the masked tail when width % 16)
    x[5, width // 3] = x[5].max() + 1
    x[5, -1] = x[5, width // 3]  # a tie far apart
    for rows in (x, torch.cat([x, x], dim=1)[:, :width]):  # contiguous, then strided rows
        assert torch.equal(ops.argmax_rows(rows), torch.argmax(rows, dim=-1))
    with pytest.raises(RuntimeError, match="float32"):
        ops.argmax_rows(x.double())
