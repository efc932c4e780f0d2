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
    """Key/value blocks of every layer.

    ``v`` is ``[layers, num_blocks, kv_heads, block_size, head_dim]`` and ``k`` the same
    with the last two axes swapped (``head_dim, block_size``): the decode kernel scores a
    whole block of keys with FMAs across its positions. A token at position ``p`` of a
    sequence lives in block ``table[p // block_size]`` at offset ``p % block_size``.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("PagedKVCache needs num_blocks >= 1 and block_size >= 1")
        shape = (
            config.num_hidden_layers,
            num_blocks,
            config.num_key_value_heads,
            block_size,
            config.head_dim,
        )
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.k = torch.zeros(shape[:3] + (shape[4], shape[3]), dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

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
        size = self.block_size
        blocks, offsets = slots // size, slots % size
        self.k[layer][blocks, :, :, offsets] = k
        self.v[layer][blocks, :, offsets] = v

    def gather(self, layer: int, blocks: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """The first ``length`` keys and values of a sequence, ``[K, length, D]`` each."""
        heads, dim = self.v.shape[2], self.v.shape[4]
        keys = self.k[layer].index_select(0, blocks).permute(1, 0, 3, 2)  # [K, n, block, D]
        values = self.v[layer].index_select(0, blocks).transpose(0, 1)  # [K, n, block, D]
        return (keys.reshape(heads, -1, dim)[:, :length],
                values.reshape(heads, -1, dim)[:, :length])
