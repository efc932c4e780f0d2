"""Packed weights on 2 MB pages.

A decode step reads every packed weight once, front to back. On 4 KB pages that stream crosses
a page every 4 KB: a TLB miss each time, and a point where the hardware prefetchers stop. On
Linux's transparent huge pages (asked for with ``madvise(MADV_HUGEPAGE)`` before the memory is
first touched, so the page faults take 2 MB pages) it crosses one every 2 MB. A batch-1 decode
step of the 1.5B ran 8-10% faster so (figures in bench/results/LOG.md).

:func:`empty` hands out zeroed bytes from chunks of anonymous memory so advised, one after the
other. A chunk is unmapped when the last tensor in it is gone. Where the kernel offers no huge
pages (``transparent_hugepage`` set to ``never``, or not Linux) it falls back to ``torch.zeros``.
"""

from __future__ import annotations

import mmap
import threading
from functools import cache

import torch

HUGE_PAGE = 2 << 20
_CHUNK = 64 << 20  # bytes mapped at a time; only the pages touched take memory
_ALIGN = 64


@cache
def available() -> bool:
    """Whether this kernel gives 2 MB pages to memory that asks for them."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode and hasattr(mmap, "MADV_HUGEPAGE")


class _Arena:
    """Bytes handed out in order from the current chunk; a new chunk when one is full."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk = torch.empty(0, dtype=torch.uint8)
        self._used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            if self._used + nbytes > self._chunk.numel():
                self._chunk, self._used = self._map(max(_CHUNK, nbytes)), 0
            out = self._chunk[self._used : self._used + nbytes]
            self._used = -(-(self._used + nbytes) // _ALIGN) * _ALIGN
            return out

    @staticmethod
    def _map(nbytes: int) -> torch.Tensor:
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        # one page more, to start on a 2 MB boundary wherever the mapping lands
        region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            region.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # refused (a sandbox's seccomp, say): the memory serves on 4 KB pages
            pass
        # never an inference tensor, even when a load runs under inference_mode: the chunk
        # serves later loads too, and they write into it
        with torch.inference_mode(False):
            whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` mapped
        start = -whole.data_ptr() % HUGE_PAGE
        return whole[start : start + size]


_arena = _Arena()


def empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` zeroed bytes (uint8, 64-byte aligned) on 2 MB pages where there are any."""
    if not available():
        return torch.zeros(nbytes, dtype=torch.uint8)
    return _arena.take(nbytes)  # fresh anonymous memory: zero


def adopt(t: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous ``t`` on 2 MB pages (``t`` itself where there are none)."""
    if not available():
        return t
    nbytes = t.numel() * t.element_size()
    out = empty(nbytes).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
