"""Qwen3: the Llama block plus per-head RMSNorm on queries and keys before rotary."""

from __future__ import annotations

from torch import nn

from infer.models.base import CausalLM
from infer.models.layers import DecoderLayer


class Qwen3ForCausalLM(CausalLM):
    """Llama-shaped decoder whose attention normalizes q and k per head (``q_norm``, ``k_norm``)."""

    def make_layer(self, layer_idx: int) -> nn.Module:
        return DecoderLayer(self.config, layer_idx, qk_norm=True)
