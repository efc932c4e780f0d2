"""Load a model and its tokenizer from a Hugging Face directory, a GGUF file or the hub.

Every path ends in :func:`infer.models.registry.create_model`, which takes the weights one
tensor at a time by their Hugging Face names: safetensors files are read tensor by tensor,
GGUF tensors are dequantized one by one, so there is never a second full copy in memory.

An encoder's directory (``architectures: [BertModel]``, all-MiniLM-L6-v2) loads instead as a
:class:`LoadedEmbeddingModel`, through :func:`infer.models.registry.create_encoder`, with its
pooling and normalisation read from the folder. Each loaded model says what it is in
``kind``; ``load_model(..., kind=...)`` refuses a model of the other kind before reading its
weights.
"""

from __future__ import annotations

import ctypes
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, overload

import torch
from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
)
from safetensors import SafetensorError, safe_open
from transformers import PreTrainedTokenizerBase

from infer import kernels
from infer.models.base import CausalLM
from infer.models.bert import BertConfig, BertModel
from infer.models.config import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    WEIGHTS_NAME,
    ModelConfig,
    ModelKind,
    eos_token_ids,
    model_kind,
)
from infer.models.default import DEFAULT_MODEL_NAME, ensure_default_model
from infer.models.errors import LoadError, WrongKindError
from infer.models.fim import GGUF_KEYS, FimTokens, find_fim_tokens
from infer.models.gguf_checkpoint import GGUFCheckpoint
from infer.models.packaged import PACKAGED_FOLDERS, PACKAGED_MODELS, assemble, extract
from infer.models.pooling import SentenceConfig, read_sentence_config
from infer.models.quant import QuantTensor, quantize
from infer.models.registry import create_encoder, create_model
from infer.models.tokenizer import load_tokenizer

DEFAULT_SOURCE = "default"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
# What a hub download fetches: config, safetensors weights and tokenizer files, nothing else.
HUB_ALLOW_PATTERNS = [
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    "*.safetensors",
    WEIGHTS_INDEX_NAME,
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "*.model",
    "chat_template.*",
]
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


@dataclass
class LoadedModel:
    """A model ready to run, with what a server needs to talk to it."""

    model: CausalLM
    tokenizer: PreTrainedTokenizerBase
    config: ModelConfig
    name: str  # the id users see: "SmolLM2-135M-Instruct", a dir or file name, a hub id
    eos_token_ids: list[int]
    chat_template: bool
    fim: FimTokens | None = None  # the model fills in the middle with these
    kind: ClassVar[ModelKind] = ModelKind.GENERATE


@dataclass
class LoadedEmbeddingModel:
    """An encoder ready to embed text (:class:`infer.engine.embed.Embedder` runs it)."""

    model: BertModel
    tokenizer: PreTrainedTokenizerBase
    config: BertConfig
    sentence: SentenceConfig  # pooling, normalisation, the longest input
    name: str
    kind: ClassVar[ModelKind] = ModelKind.EMBED

    @property
    def dimensions(self) -> int:
        """The length of the vectors it returns."""
        return self.config.hidden_size * len(self.sentence.pooling)


Loaded = LoadedModel | LoadedEmbeddingModel
_CANNOT = {
    ModelKind.GENERATE: "a text-generation model: it cannot compute embeddings",
    ModelKind.EMBED: "an embedding model: it cannot generate text",
}


@overload
def load_model(
    source: str,
    dtype: torch.dtype = ...,
    device: str = ...,
    weights: str = ...,
    *,
    kind: Literal[ModelKind.GENERATE],
) -> LoadedModel: ...
@overload
def load_model(
    source: str,
    dtype: torch.dtype = ...,
    device: str = ...,
    weights: str = ...,
    *,
    kind: Literal[ModelKind.EMBED],
) -> LoadedEmbeddingModel: ...
@overload
def load_model(
    source: str,
    dtype: torch.dtype = ...,
    device: str = ...,
    weights: str = ...,
    *,
    kind: None = None,
) -> Loaded: ...
def load_model(
    source: str,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    weights: str = "auto",
    *,
    kind: ModelKind | None = None,
) -> Loaded:
    """Load a model and its tokenizer.

    Args:
        source: ``"default"`` (the embedded SmolLM2-135M-Instruct), a packaged model by
            name (``qwen2.5-coder-0.5b``, ``qwen2.5-coder-1.5b``, ``all-minilm-l6-v2``), a
            Hugging Face directory (config.json, safetensors, tokenizer files), a ``.gguf``
            file, or a hub id ``org/name`` (downloaded when the hub is reachable).
        dtype: Dtype of the weights and activations (an encoder's: see
            :func:`load_hf_dir`).
        device: Torch device string.
        weights: ``auto`` keeps a GGUF file's quantization (and a safetensors model's
            dtype); ``bf16`` dequantizes; ``int8``/``int4`` quantize every linear at load.
        kind: The kind of model the caller needs; ``None`` takes either (look at the
            result's ``kind``).

    Raises:
        LoadError: The source is missing, corrupt, unsupported, of another ``kind``, or
            cannot be downloaded.
    """
    if source == DEFAULT_SOURCE:
        directory = ensure_default_model()
        return load_hf_dir(directory, dtype, device, weights, name=DEFAULT_MODEL_NAME, kind=kind)
    if source in PACKAGED_MODELS:
        _check_kind(source, ModelKind.GENERATE, kind)
        return load_gguf(assemble(source), dtype, device, weights, name=source)
    if source in PACKAGED_FOLDERS:
        return load_hf_dir(extract(source), dtype, device, weights, name=source, kind=kind)
    path = Path(source).expanduser()
    if path.is_dir():
        return load_hf_dir(path, dtype, device, weights, kind=kind)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            _check_kind(path.name, ModelKind.GENERATE, kind)
            return load_gguf(path, dtype, device, weights)
        raise LoadError(f"{source} is neither a model directory nor a .gguf file")
    if _HUB_ID.fullmatch(source) and not source.lower().endswith(".gguf"):
        directory = download_from_hub(source)
        return load_hf_dir(directory, dtype, device, weights, name=source, kind=kind)
    raise LoadError(f"model path does not exist: {source}")


def load_hf_dir(
    path: Path,
    dtype: torch.dtype,
    device: str,
    weights: str = "auto",
    name: str | None = None,
    kind: ModelKind | None = None,
) -> Loaded:
    """Load a Hugging Face model directory (config.json + safetensors + tokenizer files).

    An encoder's linears run in bf16 only where our AVX512-BF16 kernel runs them; elsewhere
    it stays float32 (bf16 matmuls without the instructions are no faster, and float32 is
    sentence-transformers' own precision).

    Raises:
        LoadError: See :func:`load_model`.
    """
    config_path = path / CONFIG_NAME
    if not config_path.is_file():
        raise LoadError(f"{path} has no {CONFIG_NAME}: not a Hugging Face model directory")
    config_dict = _read_json(config_path)
    found = model_kind(config_dict)
    _check_kind(name or path.resolve().name, found, kind)
    if found is ModelKind.EMBED:
        return _load_encoder_dir(path, config_dict, dtype, device, weights, name)
    config = _model_config(config_dict, path)
    files = _safetensors_files(path)
    tokenizer = _load_tokenizer(path)
    tensors = _quantized(_safetensors_weights(files), weights)
    model = _create(config, tensors, dtype, device, path)
    generation_path = path / GENERATION_CONFIG_NAME
    generation = _read_json(generation_path) if generation_path.is_file() else {}
    eos = eos_token_ids(
        generation.get("eos_token_id"), config_dict.get("eos_token_id"), tokenizer.eos_token_id
    )
    return LoadedModel(
        model,
        tokenizer,
        config,
        name or path.resolve().name,
        eos,
        tokenizer.chat_template is not None,
        find_fim_tokens(tokenizer),
    )


def load_gguf(
    path: Path,
    dtype: torch.dtype,
    device: str,
    weights: str = "auto",
    name: str | None = None,
) -> LoadedModel:
    """Load a ``.gguf`` file: weights (kept quantized with ``auto``), config and tokenizer
    from its metadata."""
    checkpoint = GGUFCheckpoint(path)
    config = _model_config(checkpoint.config, path)
    tokenizer = checkpoint.tokenizer()
    read = checkpoint.quantized_weights if weights == "auto" else checkpoint.weights
    tensors = _quantized(read(), weights)
    model = _create(config, tensors, dtype, device, path)
    eos = eos_token_ids(checkpoint.generation_config["eos_token_id"], tokenizer.eos_token_id)
    fim = find_fim_tokens(tokenizer, checkpoint.fields(GGUF_KEYS.values()))
    return LoadedModel(
        model, tokenizer, config, name or path.name, eos, tokenizer.chat_template is not None, fim
    )


def _load_encoder_dir(
    path: Path,
    config_dict: dict[str, Any],
    dtype: torch.dtype,
    device: str,
    weights: str,
    name: str | None,
) -> LoadedEmbeddingModel:
    if weights not in ("auto", "bf16"):
        raise LoadError(f"{path}: an embedding model takes weights auto or bf16, not {weights}")
    if device != "cpu":
        raise LoadError(f"{path}: embedding models run on the CPU, not {device}")
    try:
        config = BertConfig.from_hf(config_dict)
        sentence = read_sentence_config(path, config.max_position_embeddings)
    except ValueError as e:
        raise LoadError(f"{path}: {e}") from e
    if dtype == torch.bfloat16 and not kernels.has_bf16():
        dtype = torch.float32
    tokenizer = _load_tokenizer(path)
    weights_iter = _safetensors_weights(_safetensors_files(path))
    try:
        model = create_encoder(config, weights_iter, dtype)
    except ValueError as e:
        raise LoadError(f"{path}: {e}") from e
    return LoadedEmbeddingModel(model, tokenizer, config, sentence, name or path.resolve().name)


def _check_kind(name: str, found: ModelKind, wanted: ModelKind | None) -> None:
    if wanted is not None and found is not wanted:
        raise WrongKindError(f"{name} is {_CANNOT[found]}")


def download_from_hub(repo_id: str) -> Path:
    """Download a hub model's config, safetensors and tokenizer files (``HF_TOKEN`` honoured).

    Raises:
        LoadError: The hub is unreachable (or offline mode is on) and the files are not
            cached, or the repository does not exist or is gated.
    """
    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_ALLOW_PATTERNS))
    except LocalEntryNotFoundError as e:
        reason = "the hub is unreachable (or HF_HUB_OFFLINE is set) and it is not cached"
        raise LoadError(f"cannot download {repo_id!r}: {reason}") from e
    except GatedRepoError as e:
        reason = "it is gated: accept its terms on the hub and set HF_TOKEN"
        raise LoadError(f"cannot download {repo_id!r}: {reason}") from e
    except RepositoryNotFoundError as e:
        reason = "no such model on the hub (or it is private: set HF_TOKEN)"
        raise LoadError(f"cannot download {repo_id!r}: {reason}") from e
    except Exception as e:  # HTTP errors, a full disk...: say what happened, on one line
        raise LoadError.caused_by(f"cannot download {repo_id!r} from the hub", e) from e


def _model_config(config: dict[str, Any], where: Path) -> ModelConfig:
    try:
        return ModelConfig.from_hf(config)
    except ValueError as e:
        raise LoadError(f"{where}: {e}") from e


def _quantized(
    weights: Iterable[tuple[str, torch.Tensor | QuantTensor]], mode: str
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """``weights`` with every linear weight quantized for ``int8``/``int4`` (as they are
    otherwise): 2-D ``*_proj.weight`` and ``lm_head.weight`` tensors the kernel can hold."""
    bits = {"int8": 8, "int4": 4}.get(mode)
    for name, tensor in weights:
        if (
            bits is not None
            and isinstance(tensor, torch.Tensor)
            and tensor.dim() == 2
            and name.endswith(("_proj.weight", "lm_head.weight"))
            and tensor.shape[0] % 16 == 0
            and tensor.shape[1] % 32 == 0
        ):
            yield name, quantize(tensor, bits)
        else:
            yield name, tensor


def _create(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor | QuantTensor]],
    dtype: torch.dtype,
    device: str,
    where: Path,
) -> CausalLM:
    try:
        model = create_model(config, weights, dtype=dtype, device=device)
    except ValueError as e:
        raise LoadError(f"{where}: {e}") from e
    _release_freed_memory()
    return model


def _release_freed_memory() -> None:
    """Hand the load's freed transients (dequantized and unpacked copies) back to the OS.

    glibc otherwise keeps them, and the process stays that much larger after loading. A
    no-op where the C library is not glibc.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _safetensors_files(path: Path) -> list[Path]:
    """The weight files of a directory, each checked to have a readable header."""
    index = path / WEIGHTS_INDEX_NAME
    if (path / WEIGHTS_NAME).is_file():
        files = [path / WEIGHTS_NAME]
    elif index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise LoadError(f"{index} has no weight_map")
        files = [path / name for name in sorted(set(weight_map.values()))]
    else:
        raise LoadError(f"{path} has neither {WEIGHTS_NAME} nor {WEIGHTS_INDEX_NAME}")
    for file in files:
        if not file.is_file():
            raise LoadError(f"weight file listed in {WEIGHTS_INDEX_NAME} is missing: {file}")
        with _open_safetensors(file):
            pass  # opening parses the header and checks it against the file size
    return files


def _safetensors_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with _open_safetensors(file) as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                try:
                    tensor = f.get_tensor(name)
                except SafetensorError as e:
                    raise LoadError.caused_by(f"corrupt safetensors file {file}", e) from e
                yield name, tensor


def _open_safetensors(file: Path) -> Any:
    try:
        return safe_open(file, framework="pt", device="cpu")
    except SafetensorError as e:
        raise LoadError.caused_by(f"corrupt or truncated safetensors file {file}", e) from e


def _load_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    try:
        return load_tokenizer(path)
    except Exception as e:  # missing files, bad JSON, missing sentencepiece: all one story
        raise LoadError.caused_by(f"cannot load the tokenizer from {path}", e) from e


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoadError.caused_by(f"cannot read {path}", e) from e
    if not isinstance(data, dict):
        raise LoadError(f"{path} does not hold a JSON object")
    return data
