"""A paged KV cache: fixed-size blocks in one pool, each sequence owning a list of blocks.

Memory follows the tokens in use: a sequence of ``n`` tokens holds ``ceil(n / block_size)``
blocks, wherever they are in the pool (who owns which block is the engine's business, see
:mod:`infer.engine.block_manager`). The model only needs, per step, where each new key goes
(a flat slot, ``block * block_size + offset``) and, per sequence, its block table.
"""

from __future__ import annotations

import torch
from torch import Tensor

from infer.models.config import ModelConfig


class PagedKVCache:
    """Key/value blocks of every layer, laid out for the CPU kernels' pair instructions.

    Inside a block, keys are ``[kv_heads, head_dim / 2, block_size, 2]``: two neighbouring
    dimensions of one position side by side, positions along the row, so that one
    AVX512-BF16 ``vdpbf16ps`` scores a query against 16 positions, two dimensions at a time.
    Values are ``[kv_heads, block_size / 2, head_dim, 2]``: two neighbouring positions side by
    side, so that ``vdpbf16ps`` adds two positions' weighted values at once. Hence ``k`` is
    ``[layers, num_blocks, kv_heads, head_dim / 2, block_size, 2]`` and ``v`` is
    ``[layers, num_blocks, kv_heads, block_size / 2, head_dim, 2]``; ``block_size`` and
    ``head_dim`` must be even. A token at position ``p`` of a sequence lives in block
    ``table[p // block_size]`` at offset ``p % block_size``.

    In memory each layer keeps one head's blocks together (``k`` and ``v`` are views of
    ``[layers, kv_heads, num_blocks, ...]``): the blocks a sequence takes in order lie one
    after another, so that the attention kernels read one head's keys as one stream, which
    the CPU's prefetchers follow, instead of a block here and the next a head further on.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 2 or block_size % 2:
            raise ValueError("PagedKVCache needs num_blocks >= 1 and an even block_size")
        if config.head_dim % 2:
            raise ValueError(f"head_dim must be even, got {config.head_dim}")
        layers, kv, dim = config.num_hidden_layers, config.num_key_value_heads, config.head_dim
        shape = (layers, kv, num_blocks, dim * block_size)
        pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)]
        self.k = pools[0].view(layers, kv, num_blocks, dim // 2, block_size, 2).transpose(1, 2)
        self.v = pools[1].view(layers, kv, num_blocks, block_size // 2, dim, 2).transpose(1, 2)
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Each layer's (k, v) views, made once: indexing makes a new view every call, and a
        # decode step asks for them four times per layer.
        self.layers = list(zip(self.k.unbind(0), self.v.unbind(0), strict=True))

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, keys and values."""
        per_token = config.num_hidden_layers * config.num_key_value_heads * config.head_dim
        return 2 * per_token * block_size * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store keys and values ``[N, K, D]`` at flat ``slots`` ``[N]`` (block * size + offset).

        The torch path (other devices, tests); on CPU the rotary kernel writes the cache.
        """
        n, kv, dim = k.shape
        blocks, offsets = slots // self.block_size, slots % self.block_size
        self.k[layer][blocks, :, :, offsets] = k.reshape(n, kv, dim // 2, 2)
        self.v[layer][blocks, :, offsets // 2, :, offsets % 2] = v

    def gather(self, layer: int, blocks: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """The first ``length`` keys and values of a sequence, ``[K, length, D]`` each."""
        return (
            keys_of(self.k[layer][blocks])[:, :length],
            values_of(self.v[layer][blocks])[:, :length],
        )


def keys_of(blocks: Tensor) -> Tensor:
    """Keys ``[..., n, K, D/2, block, 2]`` of ``n`` blocks as ``[..., K, n * block, D]``."""
    *lead, n, kv, half, size, _ = blocks.shape
    k = len(lead)
    order = (*range(k), k + 1, k, k + 3, k + 2, k + 4)  # [..., K, n, block, D/2, 2]
    return blocks.permute(order).reshape(*lead, kv, n * size, 2 * half)


def values_of(blocks: Tensor) -> Tensor:
    """Values ``[..., n, K, block/2, D, 2]`` of ``n`` blocks as ``[..., K, n * block, D]``."""
    *lead, n, kv, pairs, dim, _ = blocks.shape
    k = len(lead)
    order = (*range(k), k + 1, k, k + 2, k + 4, k + 3)  # [..., K, n, block/2, 2, D]
    return blocks.permute(order).reshape(*lead, kv, n * pairs * 2, dim)
