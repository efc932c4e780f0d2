"""BERT encoders (all-MiniLM-L6-v2 and its kin): embeddings → post-LN layers → hidden states.

Attribute names equal transformers' ``BertModel`` checkpoint keys (``encoder.layer.0.attention
.self.query``...), so weights load by name; :meth:`BertModel.prepare` then fuses q/k/v into one
projection and packs every linear for this CPU. Shapes: B = rows, T = tokens per row (padded
to the longest), C = hidden size, H = heads, D = head dim.

Precision: weights and matmul inputs in ``dtype`` (bf16 halves the matmuls' cost on a CPU
with AVX512-BF16), everything else in float32: the residual stream, LayerNorm, the GELU and
the attention's scores and softmax. The linears accumulate in float32 and hand float32 out
(q/k/v: bf16, which is what attention reads), so a layer rounds only what a matmul reads.

Attention: in bf16 on a CPU with AVX512-BF16, our kernel (``encoder_attention.cpp``) reads the
fused q/k/v rows as they come out of the projection and writes the o projection's input, at a
third of the time of torch's flash kernel at MiniLM's head size (32); elsewhere torch's SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infer import kernels
from infer.models.linear import Bf16Linear, PackedLinear, bf16_kernels, can_pack

ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class BertConfig:
    """What :class:`BertModel` needs from a ``config.json`` of ``model_type: bert``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, d: dict[str, Any]) -> BertConfig:
        """Build from a Hugging Face ``config.json`` dict.

        Raises:
            ValueError: A field is missing, or names a variant this code does not run.
        """
        try:
            config = cls(
                architecture="BertModel",
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                intermediate_size=d["intermediate_size"],
                max_position_embeddings=d.get("max_position_embeddings", 512),
                type_vocab_size=d.get("type_vocab_size", 2),
                layer_norm_eps=d.get("layer_norm_eps", 1e-12),
                hidden_act=d.get("hidden_act", "gelu"),
                pad_token_id=d.get("pad_token_id") or 0,
            )
        except KeyError as e:
            raise ValueError(f"config.json is missing field {e.args[0]!r}") from None
        position = d.get("position_embedding_type", "absolute")
        if position != "absolute":
            raise ValueError(f"unsupported position_embedding_type {position!r}")
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {config.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}"
            )
        if config.hidden_size % config.num_attention_heads:
            raise ValueError("hidden_size is not a multiple of num_attention_heads")
        return config


@dataclass
class Padding:
    """Which tokens of a right-padded batch are real, in the forms attention reads."""

    lengths: Tensor  # [B] int32: each row's real tokens come first
    mask: Tensor | None  # [B, 1, 1, T] bool, True where a key is real; None without padding
    kernel: bool  # whether attention runs in encoder_attention.cpp


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        c = config.hidden_size
        self.word_embeddings = _table(config.vocab_size, c)
        self.position_embeddings = _table(config.max_position_embeddings, c)
        self.token_type_embeddings = _table(config.type_vocab_size, c)
        self.LayerNorm = nn.LayerNorm(c, eps=config.layer_norm_eps)

    def forward(self, input_ids: Tensor) -> Tensor:
        """``[B, T]`` ids → ``[B, T, C]`` float32; every token is of segment 0 (one text)."""
        t = input_ids.shape[1]
        # position and segment rows are the same for every row of the batch: add them once
        extra = self.position_embeddings.weight[:t] + self.token_type_embeddings.weight[0]
        x = self.word_embeddings(input_ids).float() + extra.float()
        return _add_norm(x, None, self.LayerNorm)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        c = config.hidden_size
        self.query = nn.Linear(c, c)
        self.key = nn.Linear(c, c)
        self.value = nn.Linear(c, c)


class BertSelfOutput(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)


class BertOutput(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class BertLayer(nn.Module):
    """Post-LN: ``x = LN(x + attn(x))``, then ``x = LN(x + out(act(inter(x))))``."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)
        self.qkv: nn.Module | None = None  # q, k and v in one projection, once fused

    def fuse(self) -> None:
        """Replace q, k and v by one projection (one matmul reads the input once)."""
        s = self.attention.self
        fused = nn.Linear(s.query.in_features, 3 * s.query.out_features, device="meta")
        fused.weight = nn.Parameter(torch.cat([s.query.weight, s.key.weight, s.value.weight]))
        fused.bias = nn.Parameter(torch.cat([s.query.bias, s.key.bias, s.value.bias]))
        self.qkv = fused
        del s.query, s.key, s.value

    def forward(self, x: Tensor, pad: Padding, dtype: torch.dtype) -> Tensor:
        """``x``: ``[B, T, C]`` float32 → the same."""
        assert self.qkv is not None, "fuse() first"
        qkv = _linear(self.qkv, x.to(dtype), out_float=False)  # [B, T, 3C]
        attn = self._attention(qkv, pad)  # [B, T, C]
        out = self.attention.output
        x = _add_norm(_linear(out.dense, attn), x, out.LayerNorm)
        hidden = self._intermediate(x.to(dtype))
        return _add_norm(_linear(self.output.dense, hidden), x, self.output.LayerNorm)

    def _intermediate(self, x: Tensor) -> Tensor:
        """``act(x @ W.T + b)`` in ``x``'s dtype, the activation in float32."""
        linear, act = self.intermediate.dense, self.config.hidden_act
        if isinstance(linear, Bf16Linear) and act == "gelu":
            # the GELU on the kernel's float accumulators: no float32 [N, I] written and reread
            return kernels.ops().bf16_gelu_linear(
                x, linear.packed, linear.out_features, linear.bias
            )
        return _activation(_linear(linear, x), act).to(x.dtype)

    def _attention(self, qkv: Tensor, pad: Padding) -> Tensor:
        h, d = self.config.num_attention_heads, self.config.head_dim
        if pad.kernel:
            return kernels.ops().encoder_attention(qkv, pad.lengths, h, d**-0.5)
        b, t, c3 = qkv.shape
        q, k, v = qkv.view(b, t, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, T, D]
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=pad.mask)
        return attn.transpose(1, 2).reshape(b, t, c3 // 3)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """The encoder; :meth:`forward` returns the last hidden states (pooling is the caller's)."""

    def __init__(self, config: BertConfig) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.dtype = torch.float32  # of the linears' weights and inputs, set by prepare()
        self.attention_kernel = False  # whether attention runs in our bf16 kernel

    def prepare(self, dtype: torch.dtype) -> None:
        """Fuse q/k/v and freeze every linear in ``dtype``, packed for this CPU when it can.

        The embedding tables, LayerNorms and biases stay float32: they cost nothing next
        to the matmuls and keep the residual stream exact.
        """
        self.dtype = dtype
        self.attention_kernel = (
            dtype == torch.bfloat16 and kernels.has_bf16() and self.config.head_dim in (32, 64, 128)
        )
        self.float()
        for layer in self.encoder.layer:
            assert isinstance(layer, BertLayer)
            layer.fuse()
            for parent, name in _linears(layer):
                linear = getattr(parent, name)
                setattr(parent, name, _frozen(linear.weight.to(dtype), linear.bias))
        self.requires_grad_(False)

    def forward(self, input_ids: Tensor, lengths: Tensor) -> Tensor:
        """Encode right-padded rows.

        Args:
            input_ids: ``[B, T]`` token ids; padding may be any id.
            lengths: ``[B]`` each row's real tokens (1 to T), which come first.

        Returns:
            ``[B, T, C]`` float32 last hidden states (padding rows hold garbage).
        """
        x = self.embeddings(input_ids)
        t = input_ids.shape[1]
        lengths = lengths.to(torch.int32)
        mask = None  # keys that are padding get no attention; without padding, no mask
        if not self.attention_kernel and bool((lengths < t).any()):
            mask = (torch.arange(t) < lengths[:, None])[:, None, None, :]
        pad = Padding(lengths, mask, self.attention_kernel)
        for layer in self.encoder.layer:
            x = layer(x, pad, self.dtype)
        return x


def _table(rows: int, dim: int) -> nn.Embedding:
    # no random init: it is overwritten, and on meta its first call imports torch._refs
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


def _linears(layer: BertLayer) -> list[tuple[nn.Module, str]]:
    return [
        (layer, "qkv"),
        (layer.attention.output, "dense"),
        (layer.intermediate, "dense"),
        (layer.output, "dense"),
    ]


def _frozen(weight: Tensor, bias: Tensor) -> nn.Module:
    """The fastest frozen form of a linear: our bf16 kernel, oneDNN's packed one, or plain."""
    bias = bias.detach().float()  # the kernel adds a float32 bias to its accumulators
    if bf16_kernels(weight) and weight.shape[1] % 2 == 0:
        return Bf16Linear(weight, bias)
    if can_pack(weight):
        return PackedLinear(weight, bias.to(weight.dtype))
    linear = nn.Linear(weight.shape[1], weight.shape[0], device="meta")
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    linear.bias = nn.Parameter(bias.to(weight.dtype), requires_grad=False)
    return linear


def _linear(linear: nn.Module, x: Tensor, out_float: bool = True) -> Tensor:
    """``x @ W.T + b``, in float32 (straight from the accumulators where the kernel allows) or
    in the weights' dtype."""
    if isinstance(linear, Bf16Linear):
        return linear(x, out_float=out_float)
    out = linear(x)
    return out.float() if out_float else out.to(x.dtype)


def _add_norm(x: Tensor, residual: Tensor | None, norm: nn.LayerNorm) -> Tensor:
    """``LayerNorm(x + residual)`` in float32."""
    if residual is not None:
        x = x + residual
    return F.layer_norm(x, x.shape[-1:], norm.weight, norm.bias, norm.eps)


def _activation(x: Tensor, name: str) -> Tensor:
    if name == "gelu":
        return F.gelu(x)  # BERT's exact (erf) GELU
    if name == "relu":
        return F.relu(x)
    return F.gelu(x, approximate="tanh")
