"""Gemma3 (text): sandwich norms, (1 + w) RMSNorm, scaled embeddings, local/global layers.

Sliding-window layers and global layers each have their own rotary base (and scaling); the
per-layer-type cos/sin and masks are built once per forward in :class:`CausalLM`.
Attention scale is ``query_pre_attn_scalar ** -0.5``; the final logit soft cap applies when
configured. ``attn_logit_softcapping`` is ignored, as in transformers' Gemma3 (it was Gemma2's,
and Gemma3 checkpoints set it to null).
"""

from __future__ import annotations

from torch import Tensor, nn

from infer.models.base import CausalLM
from infer.models.config import ModelConfig
from infer.models.context import ForwardContext, PagedContext
from infer.models.layers import Attention, GatedMLP, RMSNorm, kept_rows

GEMMA_NORM_OFFSET = 1.0


class Gemma3DecoderLayer(nn.Module):
    """Norms before and after both the attention and the MLP."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, eps, off = config.hidden_size, config.rms_norm_eps, GEMMA_NORM_OFFSET
        self.input_layernorm = RMSNorm(h, eps, off)
        self.self_attn = Attention(config, layer_idx, qk_norm=True, norm_offset=off)
        self.post_attention_layernorm = RMSNorm(h, eps, off)
        self.pre_feedforward_layernorm = RMSNorm(h, eps, off)
        self.mlp = GatedMLP(config)
        self.post_feedforward_layernorm = RMSNorm(h, eps, off)

    def stack_norms(self) -> tuple[RMSNorm, RMSNorm | None, RMSNorm, RMSNorm | None]:
        """Its norms as :class:`~infer.models.layers.DecodeStack` runs them (see
        :meth:`DecoderLayer.stack_norms`): each of the four."""
        return (
            self.input_layernorm,
            self.post_attention_layernorm,
            self.pre_feedforward_layernorm,
            self.post_feedforward_layernorm,
        )

    def forward(
        self, x: Tensor, residual: Tensor | None, ctx: ForwardContext | PagedContext
    ) -> tuple[Tensor, Tensor]:
        """The hidden state is ``x + residual``, as in :class:`DecoderLayer`."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm.add_forward(x, residual)
        attn = self.post_attention_layernorm(self.self_attn(h, ctx))
        h, residual = self.pre_feedforward_layernorm.add_forward(
            attn, kept_rows(residual, self.self_attn.layer_idx, ctx)
        )
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(CausalLM):
    """Gemma3 text decoder."""

    norm_offset = GEMMA_NORM_OFFSET
    embed_scale = True

    def make_layer(self, layer_idx: int) -> nn.Module:
        return Gemma3DecoderLayer(self.config, layer_idx)
