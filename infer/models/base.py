"""The causal-LM shell every family shares: embed → layers → norm → logits."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infer.models.config import ModelConfig
from infer.models.context import AttnCapture, ForwardContext, PagedContext, build_mask
from infer.models.decode_stack import DecodeStack
from infer.models.layers import GatedMLP, RMSNorm, rope_angles, rope_cos_sin, rope_inv_freq
from infer.models.linear import Bf16Linear, QuantLinear, pack_linear, pack_linears
from infer.models.quant import QuantTensor


@dataclass
class ForwardOutput:
    """``logits`` is float32 ``[B, V]`` with ``logits_index``, else ``[B, T, V]``."""

    logits: Tensor
    # layer → [B, H, T, S] float32 when captured; from forward_paged, each sequence's [H, S]
    attn: dict[int, Any] | None = None


class DecoderStack(nn.Module):
    """Holds the ``model.*`` weights: ``embed_tokens``, ``layers``, ``norm``."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module], norm_offset: float) -> None:
        super().__init__()
        # nn.Embedding, or QuantEmbedding when a GGUF table is kept quantized
        # no random init: it is overwritten, and on meta its first call imports torch._refs
        vocab, hidden = config.vocab_size, config.hidden_size
        table = torch.empty(vocab, hidden)
        self.embed_tokens: nn.Module = nn.Embedding(vocab, hidden, _weight=table)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_offset)


class CausalLM(nn.Module, ABC):
    """Base class: a family overrides ``make_layer`` and, if it needs to, the class knobs.

    The forward serves every caller: a plain prefill (no cache), a ragged batch of prefill
    chunks or decode tokens over a :class:`PagedKVCache`, and attention inspection.
    """

    norm_offset: float = 0.0  # Gemma stores norm weights as (w - 1)
    embed_scale: bool = False  # Gemma multiplies embeddings by sqrt(hidden)
    decode_stack: DecodeStack | None = None  # decode steps in one kernel call, once packed
    quant_head: QuantTensor | None = None  # a tied head's quantized embedding, until packed

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        layers = [self.make_layer(i) for i in range(config.num_hidden_layers)]
        self.model = DecoderStack(config, layers, self.norm_offset)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for kind, rope in config.rope.items():
            self.register_buffer(f"inv_freq_{kind}", rope_inv_freq(rope, config.head_dim), False)

    @abstractmethod
    def make_layer(self, layer_idx: int) -> nn.Module:
        """Build decoder layer ``layer_idx`` of this family."""

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype  # the embedding may be kept quantized

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def lm_weight(self) -> Tensor:
        """The dense head weight (a kept-quantized head is ``packed_head`` or ``lm_head``)."""
        module = self.model.embed_tokens if self.config.tie_word_embeddings else self.lm_head
        assert isinstance(module, nn.Embedding | nn.Linear), "no dense head weight"
        return module.weight

    def pack(self) -> None:
        """Freeze every linear weight in its fastest packed form (see :func:`pack_linear`).

        A tied head gets a packed copy of the embedding (the lookup needs the plain one).
        """
        for module in self.modules():
            if isinstance(module, GatedMLP):
                module.pack_gated()
        pack_linears(self)
        self.decode_stack = DecodeStack.of(list(self.model.layers), self.config)
        if self.config.tie_word_embeddings:
            head: nn.Module | None
            if self.quant_head is not None:
                quantized = QuantLinear(self.quant_head, dtype=self.dtype)
                quantized.pack()
                head, self.quant_head = quantized, None
            else:
                head = pack_linear(self.lm_weight(), None)
            if head is not None:
                self.packed_head = head

    def logits(self, hidden: Tensor) -> Tensor:
        """Float32 next-token logits of final hidden states."""
        tied = self.config.tie_word_embeddings
        head = getattr(self, "packed_head", None) if tied else self.lm_head
        if isinstance(head, Bf16Linear | QuantLinear):
            logits = head(hidden, out_float=True)  # float32 straight from the accumulators
        elif head is not None:
            logits = head(hidden)
        else:
            logits = F.linear(hidden, self.lm_weight())
        logits = logits.float()
        if self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        logits_index: Tensor | None = None,
        capture: AttnCapture | None = None,
    ) -> ForwardOutput:
        """Run whole sequences through the model, without a KV cache.

        This is the reference path (tests, attention inspection); serving runs
        :meth:`forward_paged`.

        Args:
            input_ids: ``[B, T]`` token ids (right-padded rows use any id).
            positions: ``[B, T]`` position of each token, from 0; -1 marks padding.
            logits_index: ``[B]`` index into T of the one token per row to return logits for
                (each row's last real token); ``None`` returns logits for every token.
            capture: Return the attention probabilities ``[B, H, T, T]`` of some layers.

        Returns:
            The logits and, when ``capture`` was given, those layers' probabilities.
        """
        ctx = ForwardContext(positions=positions, capture=capture)
        valid = positions >= 0
        for kind in set(self.config.layer_types):
            ctx.rope[kind] = self._rope(kind, positions.clamp(min=0))
            ctx.masks[kind] = build_mask(positions, positions, valid, self._window(kind))
        x, residual = self._layers(self.model.embed_tokens(input_ids), ctx)
        if logits_index is not None:
            rows = torch.arange(x.shape[0], device=x.device)
            x, residual = x[rows, logits_index], residual[rows, logits_index]  # [B, hidden]
        hidden, _ = self.model.norm.add_forward(x, residual)
        return ForwardOutput(self.logits(hidden), capture.probs if capture else None)

    def forward_paged(
        self, input_ids: Tensor, positions: Tensor, ctx: PagedContext, logits_index: Tensor
    ) -> ForwardOutput:
        """Run a packed batch of new tokens over the paged KV cache.

        Args:
            input_ids: ``[N]`` token ids: decode tokens first, then prefill spans.
            positions: ``[N]`` their positions in their sequences.
            ctx: Where the keys go and what each sequence attends to; its ``rope`` is
                filled here.
            logits_index: ``[R]`` the tokens to return logits for.

        Returns:
            ``[R, V]`` float32 logits; with ``ctx.capture``, each sequence's last-token
            attention row per captured layer.
        """
        for kind in set(self.config.layer_types):
            ctx.rope[kind] = rope_angles(getattr(self, f"inv_freq_{kind}"), positions)
            ctx.windows[kind] = self._window(kind) or 0
        if ctx.spans and logits_index.numel():
            # Past its keys and values, the last layer only matters for the rows that get
            # logits: the others' attention, o projection and MLP are skipped (a thirtieth
            # of a prompt's work at 30 layers, less the keys and values). Whenever a step
            # has prompt spans, even when every row gets logits: a prompt's last token then
            # always meets the same kernels, whatever else shares its step (batch invariance).
            ctx.keep, ctx.keep_layer = logits_index, self.config.num_hidden_layers - 1
        x, residual = self._layers(self.model.embed_tokens(input_ids), ctx)  # [N or R, hidden]
        if ctx.keep is None:
            x, residual = x.index_select(0, logits_index), residual.index_select(0, logits_index)
        hidden, _ = self.model.norm.add_forward(x, residual)
        return ForwardOutput(self.logits(hidden), ctx.capture.probs if ctx.capture else None)

    def _layers(self, x: Tensor, ctx: ForwardContext | PagedContext) -> tuple[Tensor, Tensor]:
        """Every layer; the hidden state is the sum of the two returned tensors."""
        if self.embed_scale:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        if self.decode_stack is not None and self.decode_stack.runs(x, ctx):
            return self.decode_stack(x, ctx)  # type: ignore[arg-type]
        residual = None
        for layer in self.model.layers:
            x, residual = layer(x, residual, ctx)
        assert residual is not None, "a model has at least one layer"
        return x, residual

    def _rope(self, kind: str, positions: Tensor) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(getattr(self, f"inv_freq_{kind}"), positions, self.dtype)

    def _window(self, kind: str) -> int | None:
        return self.config.sliding_window if kind == "sliding" else None
