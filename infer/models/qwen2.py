"""Qwen2 and Qwen2.5: the Llama block with biases on the q, k and v projections."""

from __future__ import annotations

from torch import nn

from infer.models.base import CausalLM
from infer.models.layers import DecoderLayer


class Qwen2ForCausalLM(CausalLM):
    """Llama-shaped decoder; ``config.qkv_bias`` gives q/k/v (not o) their biases."""

    def make_layer(self, layer_idx: int) -> nn.Module:
        return DecoderLayer(self.config, layer_idx)
