"""A batched KV cache: one row per running request, written at each row's own positions."""

from __future__ import annotations

import torch

from infer.models.config import ModelConfig


class KVCache:
    """Plain key/value buffers for every layer.

    ``k`` and ``v`` are ``[layers, rows, kv_heads, max_seq_len + 1, head_dim]``. Row ``r``
    holds one request; its token at position ``p`` lives at ``[:, r, :, p]``. The extra last
    position is scratch: padded tokens of a ragged batch write there, and no query ever reads
    it (queries see only positions up to their own, which are below ``max_seq_len``).

    Head-major rows are what attention reads (``[B, K, S, D]`` slices, contiguous per head).
    Writes use one ``index_copy_`` over the flat ``(row, head, position)`` index: indexing
    rows and positions as two tensors with heads in between cost 50x more on this CPU.
    """

    def __init__(
        self,
        config: ModelConfig,
        max_batch_size: int,
        max_seq_len: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if max_batch_size < 1 or max_seq_len < 1:
            raise ValueError("KVCache needs max_batch_size >= 1 and max_seq_len >= 1")
        shape = (
            config.num_hidden_layers,
            max_batch_size,
            config.num_key_value_heads,
            max_seq_len + 1,
            config.head_dim,
        )
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len

    @property
    def scratch_pos(self) -> int:
        return self.max_seq_len

    def flat_index(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat ``(row, head, position)`` index ``[B * T * K]`` for rows ``[B, 1]`` and
        positions ``[B, T]``, in the order of ``k.reshape(-1, head_dim)`` for k ``[B, T, K, D]``.
        """
        heads, span = self.k.shape[2], self.k.shape[3]
        head = torch.arange(heads, device=rows.device)
        row_head = rows.unsqueeze(-1) * heads + head  # [B, 1, K]
        return (row_head * span + positions.unsqueeze(-1)).flatten()

    def write(self, layer: int, flat_index: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[B, T, K, D]`` at ``flat_index`` (see :meth:`flat_index`)."""
        dim = self.k.shape[-1]
        self.k[layer].view(-1, dim).index_copy_(0, flat_index, k.reshape(-1, dim))
        self.v[layer].view(-1, dim).index_copy_(0, flat_index, v.reshape(-1, dim))

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

    def copy_row(self, src: int, dst: int, length: int) -> None:
        """Copy the first ``length`` positions of row ``src`` into row ``dst`` (compaction)."""
        if src != dst and length > 0:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]

    def swap_rows(self, a: int, b: int, len_a: int, len_b: int) -> None:
        """Exchange the first ``len_a`` positions of row ``a`` with ``len_b`` of row ``b``."""
        if a == b:
            return
        keep_k, keep_v = self.k[:, a, :, :len_a].clone(), self.v[:, a, :, :len_a].clone()
        self.copy_row(b, a, len_b)
        self.k[:, b, :, :len_a] = keep_k
        self.v[:, b, :, :len_a] = keep_v
