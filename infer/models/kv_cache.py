"""A paged KV cache: fixed-size blocks in one pool, each sequence owning a list of blocks.

Memory follows the tokens in use: a sequence of ``n`` tokens holds ``ceil(n / block_size)``
blocks, wherever they are in the pool (who owns which block is the engine's business, see
:mod:`infer.engine.block_manager`). The model only needs, per step, where each new key goes
(a flat slot index) and, per sequence, its block table.
"""

from __future__ import annotations

import torch
from torch import Tensor

from infer.models.config import ModelConfig


class PagedKVCache:
    """Key/value blocks of every layer.

    ``k`` and ``v`` are ``[layers, num_blocks, kv_heads, block_size, head_dim]``: within a
    block, each head's positions are contiguous, which is what attention reads. A key at
    position ``p`` of a sequence lives in block ``table[p // block_size]`` at offset
    ``p % block_size``. New keys go in with one ``index_copy_`` over the flat
    ``(block, head, offset)`` row index (see :meth:`slot_index`).
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
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks = num_blocks
        self.block_size = block_size

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block takes across all layers, keys and values."""
        per_token = config.num_hidden_layers * config.num_key_value_heads * config.head_dim
        return 2 * per_token * block_size * torch.empty((), dtype=dtype).element_size()

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def slot_index(self, blocks: Tensor, offsets: Tensor) -> Tensor:
        """Flat ``(block, head, offset)`` rows ``[N * K]`` for tokens at ``blocks[i]``,
        ``offsets[i]`` (both ``[N]``), in the order of ``k.reshape(-1, head_dim)`` for
        keys ``[N, K, D]``.
        """
        heads, size = self.k.shape[2], self.k.shape[3]
        head = torch.arange(heads, device=blocks.device)
        return ((blocks.unsqueeze(-1) * heads + head) * size + offsets.unsqueeze(-1)).flatten()

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """Store keys and values ``[N, K, D]`` at ``slots`` (see :meth:`slot_index`)."""
        dim = self.k.shape[-1]
        self.k[layer].view(-1, dim).index_copy_(0, slots, k.reshape(-1, dim))
        self.v[layer].view(-1, dim).index_copy_(0, slots, v.reshape(-1, dim))

    def gather(self, layer: int, blocks: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """The first ``length`` keys and values of a sequence, ``[K, length, D]`` each."""
        heads, dim = self.k.shape[2], self.k.shape[4]

        def read(pool: Tensor) -> Tensor:
            picked = pool[layer].index_select(0, blocks)  # [n, K, block, D]
            return picked.transpose(0, 1).reshape(heads, -1, dim)[:, :length]

        return read(self.k), read(self.v)

    def copy_blocks(self, src: Tensor, dst: Tensor) -> None:
        """Copy whole blocks ``src[i]`` onto ``dst[i]`` in every layer."""
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]
