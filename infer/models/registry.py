"""From ``config.architectures`` to a model class, and from named weights to a live model."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

from infer import kernels
from infer.models.base import CausalLM
from infer.models.bert import BertConfig, BertModel
from infer.models.config import ModelConfig
from infer.models.gemma3 import Gemma3ForCausalLM
from infer.models.layers import Attention, GatedMLP
from infer.models.linear import QuantEmbedding, QuantLinear
from infer.models.llama import LlamaForCausalLM
from infer.models.quant import QuantTensor
from infer.models.qwen2 import Qwen2ForCausalLM
from infer.models.qwen3 import Qwen3ForCausalLM

log = logging.getLogger(__name__)

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}

# Encoders that embed text: built by create_encoder, never by create_model.
ENCODER_CLASSES: dict[str, type[BertModel]] = {"BertModel": BertModel}
# What an encoder checkpoint holds that embedding does not use: the pooler (a next-sentence
# head sentence-transformers never calls) and the position ids buffer.
_ENCODER_UNUSED = ("pooler.", "embeddings.position_ids")

# Checkpoints name the same weights in more than one way; map them to ours.
_PREFIX_ALIASES = (("language_model.model.", "model."), ("model.language_model.", "model."))


def model_class(architecture: str) -> type[CausalLM]:
    """The class for an architecture name.

    Raises:
        ValueError: The architecture is not supported.
    """
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(MODEL_CLASSES)}"
        ) from None


def create_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor | QuantTensor]],
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> CausalLM:
    """Build a model without allocating it, then assign checkpoint tensors one at a time.

    Each tensor is converted to ``dtype`` as it arrives, so at no point are there two full
    copies of the weights in memory. A :class:`QuantTensor` stays quantized where it is a
    linear's weight (its module becomes a :class:`QuantLinear`) and the CPU runs the quantized
    kernel; anywhere else it is dequantized (the embedding lookup, which keeps its quantized
    form for a tied head). Then q/k/v and gate/up are fused into single projections, one layer
    at a time, and every linear weight is packed.

    Raises:
        ValueError: A weight is missing, unexpected, or has the wrong shape.
    """
    with torch.device("meta"):
        model = model_class(config.architecture)(config)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    keep = kernels.has_quant() and str(device) == "cpu"
    warned = False
    for raw_name, tensor in weights:
        name = _canonical(raw_name)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: the embedding is the head
        if name.endswith("rotary_emb.inv_freq"):
            continue
        _check_weight(config, params, name, raw_name, tensor)
        seen.add(name)
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if isinstance(tensor, QuantTensor):
            if keep and _keep_quantized(model, config, name, tensor, dtype):
                continue
            if not keep and not warned and str(device) == "cpu":
                log.warning(
                    "this CPU has no AVX2: quantized weights are dequantized to %s "
                    "(about 3.5x the bytes read per token)",
                    str(dtype).removeprefix("torch."),
                )
                warned = True
            tensor = tensor.dequantize()
        value = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
        setattr(module, attr, value)
    _finish(model, sorted(set(params) - seen), device)
    return model.eval()


def _check_weight(
    config: ModelConfig,
    params: dict[str, nn.Parameter],
    name: str,
    raw_name: str,
    tensor: torch.Tensor | QuantTensor,
) -> None:
    if name not in params:
        raise ValueError(f"unexpected weight {raw_name!r} for {config.architecture}")
    if tuple(tensor.shape) != tuple(params[name].shape):
        raise ValueError(
            f"weight {raw_name!r} has shape {tuple(tensor.shape)}, "
            f"expected {tuple(params[name].shape)}"
        )


def _keep_quantized(
    model: CausalLM, config: ModelConfig, name: str, tensor: QuantTensor, dtype: torch.dtype
) -> bool:
    """Put a quantized tensor in place as it is where the kernels read it so (a linear's
    weight, the embedding); ``False`` where it must be dequantized."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, nn.Linear | QuantLinear) and attr == "weight":
        _set_quantized(model, module_name, module, tensor, dtype)
        return True
    if name == "model.embed_tokens.weight":
        if config.tie_word_embeddings:
            model.quant_head = tensor  # the tied head reads it quantized
        model.model.embed_tokens = QuantEmbedding(tensor, dtype)
        return True
    return False


def _finish(model: CausalLM, missing: list[str], device: str | torch.device) -> None:
    """Refuse a checkpoint with ``missing`` weights; place the buffers, fuse and pack."""
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:3])}{more}")
    for name, buf in list(model.named_buffers()):
        module_name, _, attr = name.rpartition(".")
        model.get_submodule(module_name).register_buffer(attr, buf.to(device), persistent=False)
    for module in model.modules():
        if isinstance(module, Attention | GatedMLP):
            module.fuse()
    model.pack()


def _set_quantized(
    model: nn.Module, name: str, module: nn.Module, weight: QuantTensor, dtype: torch.dtype
) -> None:
    """Make ``name`` a :class:`QuantLinear` of ``weight``, keeping a bias already loaded."""
    bias: torch.Tensor | None = getattr(module, "bias", None)
    quantized = QuantLinear(weight, dtype=dtype)
    if bias is not None:  # a bias not loaded yet (on meta) is set on the new module later
        quantized.bias = nn.Parameter(bias.detach(), requires_grad=False)
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent), attr, quantized)


def _canonical(name: str) -> str:
    for old, new in _PREFIX_ALIASES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def create_encoder(
    config: BertConfig,
    weights: Iterable[tuple[str, torch.Tensor | QuantTensor]],
    dtype: torch.dtype = torch.float32,
) -> BertModel:
    """Build an encoder on its checkpoint's weights, then freeze its linears in ``dtype``.

    Raises:
        ValueError: A weight is missing, unexpected, quantized or has the wrong shape.
    """
    with torch.device("meta"):
        model = ENCODER_CLASSES[config.architecture](config)
    params = dict(model.named_parameters())
    state: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.startswith(_ENCODER_UNUSED):
            continue
        if name not in params:
            raise ValueError(f"unexpected weight {name!r} for {config.architecture}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"weight {name!r} is quantized: encoders load float weights")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(params[name].shape)}"
            )
        state[name] = tensor.float()
    missing = sorted(set(params) - set(state))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:3])}{more}")
    model.load_state_dict(state, assign=True)
    model.prepare(dtype)
    return model.eval()
