"""Packed weights on 2 MB pages (infer/models/huge_pages.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from infer.models import huge_pages, quant
from infer.models.linear import Bf16GatedLinear, Bf16Linear, QuantGatedLinear, QuantLinear
from infer.models.loader import LoadedModel
from infer.models.quant import QuantTensor


def _mapping(address: int) -> dict[str, str] | None:
    """The /proc/self/smaps fields of the mapping that holds ``address``, if one does."""
    fields: dict[str, str] | None = None
    found: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if head.endswith(":"):
                if fields is not None:
                    fields[head[:-1]] = line.split()[1]
                continue
            lo, hi = (int(end, 16) for end in head.split("-"))
            fields = {} if lo <= address < hi else None
            if fields is not None:
                found = fields
    return found


def test_the_bytes_handed_out_are_zeroed_aligned_and_apart() -> None:
    sizes = [1, 100, 5000, 3 << 20, 70 << 20, 64]  # one larger than a chunk
    got = [huge_pages.empty(n) for n in sizes]
    for t, n in zip(got, sizes, strict=True):
        assert t.dtype == torch.uint8 and t.numel() == n
        assert t.data_ptr() % 64 == 0
        assert int(t.count_nonzero()) == 0
    for i, t in enumerate(got):
        t.fill_(i + 1)
    for i, t in enumerate(got):
        assert bool((t == i + 1).all()), f"allocation {i} was overwritten"


def test_a_copy_keeps_the_values_dtype_and_shape() -> None:
    t = torch.randn(37, 129).bfloat16()
    copy = huge_pages.adopt(t)
    assert copy.dtype == t.dtype and copy.shape == t.shape and torch.equal(copy, t)


@pytest.mark.skipif(not huge_pages.available(), reason="this kernel gives no huge pages")
def test_memory_goes_back_when_its_tensors_are_gone() -> None:
    first = huge_pages.empty(80 << 20)  # a chunk of its own
    address = first.data_ptr()
    huge_pages.empty(80 << 20)  # the next chunk: the arena lets go of the first
    assert _mapping(address) is not None
    del first
    gc.collect()
    assert _mapping(address) is None, "a chunk no tensor uses is still mapped"


@pytest.mark.skipif(not huge_pages.available(), reason="this kernel gives no huge pages")
def test_packed_weights_lie_on_memory_advised_for_huge_pages(default_model: LoadedModel) -> None:
    n, k = 64, 256
    weight = QuantTensor(
        torch.randint(0, 16, (n, k), dtype=torch.uint8),
        torch.randint(0, 64, (n, k // 32), dtype=torch.int8),
        torch.randint(0, 64, (n, k // 32), dtype=torch.int8),
        torch.rand(n, 1).half(),
        torch.rand(n, 1).half(),
        4,
        32,
        8,
    )
    packed = [quant.pack(weight)]
    ours = (Bf16Linear, Bf16GatedLinear, QuantLinear, QuantGatedLinear)  # not oneDNN's
    packed += [m.packed for m in default_model.model.modules() if isinstance(m, ours)]
    for t in packed:
        fields = _mapping(t.data_ptr())
        assert fields is not None and fields.get("THPeligible") == "1", fields


@pytest.mark.skipif(not huge_pages.available(), reason="no transparent huge pages: torch.zeros")
def test_a_chunk_mapped_under_inference_mode_serves_later_loads() -> None:
    """A load inside ``torch.inference_mode`` maps a chunk that loads after it take bytes
    from: those must be normal tensors, which a load writes into."""
    with torch.inference_mode():
        huge_pages.empty(huge_pages._CHUNK - 4096)  # a fresh chunk, its last 4 KB left
    later = huge_pages.empty(64)
    later.fill_(1)  # an inference tensor would refuse this outside inference mode
    assert not later.is_inference() and bool((later == 1).all())
