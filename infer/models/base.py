"""The causal-LM shell every family shares: embed → layers → norm → logits."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infer.models.config import ModelConfig
from infer.models.kv_cache import KVCache
from infer.models.layers import (
    AttnCapture,
    ForwardContext,
    PackedLinear,
    RMSNorm,
    build_mask,
    can_pack,
    pack_linears,
    rope_cos_sin,
    rope_inv_freq,
)


@dataclass
class ForwardOutput:
    """``logits`` is float32 ``[B, V]`` with ``logits_index``, else ``[B, T, V]``."""

    logits: Tensor
    attn: dict[int, Tensor] | None = None  # layer → [B, H, T, S] float32, when captured


class DecoderStack(nn.Module):
    """Holds the ``model.*`` weights: ``embed_tokens``, ``layers``, ``norm``."""

    def __init__(self, config: ModelConfig, layers: list[nn.Module], norm_offset: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, norm_offset)


class CausalLM(nn.Module, ABC):
    """Base class: a family overrides ``make_layer`` and, if it needs to, the class knobs.

    The forward serves every caller: a plain prefill (no cache), a ragged batch of prefill
    chunks or decode tokens over a :class:`KVCache`, and attention inspection.
    """

    norm_offset: float = 0.0  # Gemma stores norm weights as (w - 1)
    embed_scale: bool = False  # Gemma multiplies embeddings by sqrt(hidden)

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
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def lm_weight(self) -> Tensor:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight
        return self.lm_head.weight

    def pack(self) -> None:
        """Pre-pack every linear weight for oneDNN (CPU bf16/fp32; see :class:`PackedLinear`).

        A tied head gets a packed copy of the embedding (the lookup needs the plain one).
        """
        pack_linears(self)
        if self.config.tie_word_embeddings and can_pack(self.lm_weight()):
            self.packed_head = PackedLinear(self.lm_weight(), None)

    def logits(self, hidden: Tensor) -> Tensor:
        """Float32 next-token logits of final hidden states."""
        head = getattr(self, "packed_head", None)
        if head is not None:
            logits = head(hidden)
        elif self.config.tie_word_embeddings:
            logits = F.linear(hidden, self.lm_weight())
        else:
            logits = self.lm_head(hidden)
        logits = logits.float()
        if self.config.final_logit_softcapping is not None:
            cap = self.config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        cache: KVCache | None = None,
        rows: list[int] | None = None,
        logits_index: Tensor | None = None,
        capture: AttnCapture | None = None,
        kv_len: int | None = None,
    ) -> ForwardOutput:
        """Run new tokens through the model, reading and extending the KV cache.

        Args:
            input_ids: ``[B, T]`` token ids (right-padded rows use any id).
            positions: ``[B, T]`` position of each token in its sequence; -1 marks padding.
            cache: KV cache to write into and attend over; ``None`` attends only to these
                tokens (a whole sequence from position 0).
            rows: Cache row of each batch row (default ``0..B-1``).
            logits_index: ``[B]`` index into T of the one token per row to return logits for
                (each row's last real token); ``None`` returns logits for every token.
            capture: Return the attention probabilities of some layers.
            kv_len: Attended length (``max(positions) + 1``) if the caller knows it.

        Returns:
            The logits and, when ``capture`` was given, those layers' attention probabilities.
        """
        ctx = self._context(positions, cache, rows, capture, kv_len)
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale:
            x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        for layer in self.model.layers:
            x = layer(x, ctx)
        if logits_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), logits_index]  # [B, hidden]
        logits = self.logits(self.model.norm(x))
        return ForwardOutput(logits, capture.probs if capture else None)

    def _context(
        self,
        positions: Tensor,
        cache: KVCache | None,
        rows: list[int] | None,
        capture: AttnCapture | None,
        kv_len: int | None,
    ) -> ForwardContext:
        b = positions.shape[0]
        rows = list(range(b)) if rows is None else rows
        valid = positions >= 0
        row_index = torch.tensor(rows, device=positions.device).unsqueeze(1)
        if cache is None:
            k_pos, k_valid, kv_len = positions, valid, positions.shape[1]
            flat_index = positions.flatten()  # unused without a cache
        else:
            kv_len = kv_len if kv_len is not None else int(positions.max()) + 1
            k_pos = torch.arange(kv_len, device=positions.device).unsqueeze(0)
            k_valid = None
            write_pos = torch.where(valid, positions, cache.scratch_pos)
            flat_index = cache.flat_index(row_index, write_pos)
        ctx = ForwardContext(
            positions=positions,
            cache=cache,
            row_slice=_as_slice(rows),
            row_index=row_index,
            flat_index=flat_index,
            kv_len=kv_len,
            capture=capture,
        )
        rope_pos = positions.clamp(min=0)
        window = self.config.sliding_window
        for kind in set(self.config.layer_types):
            inv_freq = getattr(self, f"inv_freq_{kind}")
            ctx.rope[kind] = rope_cos_sin(inv_freq, rope_pos, self.dtype)
            kind_window = window if kind == "sliding" else None
            ctx.masks[kind] = build_mask(positions, k_pos, k_valid, kind_window)
        return ctx


def _as_slice(rows: list[int]) -> slice | None:
    """``rows`` as a slice if they are consecutive, else ``None``."""
    consecutive = slice(rows[0], rows[0] + len(rows))
    return consecutive if rows == list(range(consecutive.start, consecutive.stop)) else None
