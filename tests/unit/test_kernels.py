"""The C++ paged decode-attention kernel against its torch reference."""

from __future__ import annotations

import pytest
import torch

from infer import kernels
from infer.models.layers import paged_decode_attention_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,block,window,groups", [
    (64, 16, 0, 3), (64, 16, 20, 3), (16, 4, 0, 3), (128, 16, 0, 3), (24, 8, 5, 3),
    (64, 16, 0, 1), (64, 16, 0, 5), (128, 16, 0, 4), (256, 16, 0, 4), (64, 16, 7, 8)])
def test_kernel_matches_reference(dtype, head_dim: int, block: int, window: int,
                                  groups: int) -> None:
    """Every query-head grouping (GQA 1, 3, 4, 5, 8) and head size, with and without windows."""
    gen = torch.Generator().manual_seed(head_dim + block + window + groups)
    n, kv = 7, 3
    lens = torch.tensor([1, 2, block, block + 1, 3 * block - 1, 5 * block, 37], dtype=torch.int32)
    max_blocks = int(-(-lens.max() // block))
    pool = n * max_blocks + 3
    k_cache = torch.randn(pool, kv, head_dim, block, generator=gen).to(dtype)
    v_cache = torch.randn(pool, kv, block, head_dim, generator=gen).to(dtype)
    # Every sequence owns its own blocks, scattered over the pool.
    tables = torch.randperm(pool, generator=gen)[: n * max_blocks].view(n, max_blocks)
    tables = tables.to(torch.int32).contiguous()
    q = torch.randn(n, kv * groups, head_dim, generator=gen).to(dtype)
    got = kernels.ops().paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.3, window)
    want = paged_decode_attention_reference(q.float(), k_cache.float(), v_cache.float(),
                                            tables, lens, 0.3, window)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_kernel_refuses_mismatched_shapes() -> None:
    q = torch.randn(2, 6, 16)
    k = torch.randn(4, 3, 16, 4)
    v = torch.randn(4, 3, 4, 32)  # head dim differs from q's
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.ones(2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="head dims differ|must be"):
        kernels.ops().paged_decode_attention(q, k, v, tables, lens, 1.0, 0)
