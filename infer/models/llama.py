"""Llama (incl. Llama 3.x rope scaling; SmolLM2 is a Llama)."""

from __future__ import annotations

from torch import nn

from infer.models.base import CausalLM
from infer.models.layers import DecoderLayer


class LlamaForCausalLM(CausalLM):
    """Pre-norm decoder with SiLU-gated MLP and grouped-query attention."""

    def make_layer(self, layer_idx: int) -> nn.Module:
        return DecoderLayer(self.config, layer_idx)
