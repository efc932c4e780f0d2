"""Engine configuration, validated once at construction."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

# The dtypes a model may run in, by the name every flag and variable uses.
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
BATCHING_MODES = ("static", "continuous")
# How linear weights are held: as the checkpoint has them (a GGUF file's quantization, a
# safetensors file's dtype), dense in ``dtype``, or quantized at load to 8 or 4 bits.
WEIGHT_MODES = ("auto", "bf16", "int8", "int4")
MAX_DRAFT_TOKENS = 64
MAX_SEQ_LEN_FLAG = "--max-seq-len"
DEFAULT_KV_CACHE_GB = 0.75  # 32k tokens of the default model, 26k of Qwen2.5-1.5B, in bf16


class CacheSize(NamedTuple):
    """The KV cache's blocks and the longest request (see :meth:`EngineConfig.cache_size`)."""

    num_blocks: int
    max_seq_len: int
    bound: str  # what set max_seq_len: MAX_SEQ_LEN_FLAG, the model's context or the KV cache
    note: str = ""  # more on it, for the log line at start


@dataclass
class EngineConfig:
    """How the engine loads its model and schedules requests.

    Args:
        model: A Hugging Face directory, a ``.gguf`` file, a hub id, or ``"default"``
            (the embedded SmolLM2-135M-Instruct).
        dtype: Weight and activation dtype: ``bfloat16`` (default on CPU), ``float16``
            or ``float32``.
        weights: Linear weights ``auto`` (a GGUF file's quantization kept, a safetensors
            model's dtype), ``bf16`` (dequantized to ``dtype``), or ``int8``/``int4``
            (quantized at load in groups of 32). Quantized weights need AVX2; elsewhere they
            are dequantized.
        device: Torch device string.
        max_seq_len: Longest prompt + completion a request may have (``None``: the
            model's context, or what the KV cache holds where that is less). A longer one
            than the model's context is honoured, with a warning at start.
        max_batch_size: Most requests that run together in one forward.
        max_waiting_requests: Requests the server lets wait to run before it refuses more (503).
        batching_mode: ``"continuous"`` (admit and retire every step) or ``"static"``
            (a batch runs to completion before the next is formed).
        batch_wait_timeout_s: Static mode: how long to wait for a batch to fill.
        prefill_token_budget: Prompt tokens prefilled per step; longer prompts are
            chunked across steps so running streams keep decoding.
        block_size: Tokens per block of the paged KV cache (even).
        kv_cache_gb: KV cache budget in GB (``None``: 0.75 GB, or less when
            ``max_batch_size`` requests of ``max_seq_len`` tokens need less). When it is
            full, new requests wait and running ones may be preempted (recomputed later).
        prefix_caching: Reuse the KV blocks of prompt prefixes seen before.
        draft_tokens: Most draft tokens a decoding request verifies per step (speculative
            decoding from its ``prediction`` and its own prompt; 0 turns it off). The output
            is the same either way; fewer are verified where they are unlikely to pay.
        draft_model: A smaller model with the same tokenizer that drafts where no text
            matches (opt-in; the same sources as ``model``).
        draft_row_cost: What verifying one more token costs, as a share of a one-token
            step (``bench/offline.py steps`` measures it: the step time's growth per row
            over the one-row time).
        seed: Seed for requests that set none (``None``: nondeterministic).
        num_threads: Torch intra-op threads for the engine thread (``None``: torch default).

    Raises:
        ValueError: A field is out of range; the message names the field.
    """

    model: str = "default"
    dtype: str = field(default="bfloat16", metadata={"choices": tuple(DTYPES)})
    weights: str = field(default="auto", metadata={"choices": WEIGHT_MODES})
    device: str = "cpu"
    max_seq_len: int | None = None
    max_batch_size: int = 64
    max_waiting_requests: int = 64
    batching_mode: str = field(default="continuous", metadata={"choices": BATCHING_MODES})
    batch_wait_timeout_s: float = 0.05
    prefill_token_budget: int = 1024
    block_size: int = 16
    kv_cache_gb: float | None = None
    prefix_caching: bool = True
    draft_tokens: int = 16
    draft_model: str | None = None
    draft_row_cost: float = 0.18
    seed: int | None = None
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}")
        if self.batching_mode not in BATCHING_MODES:
            raise ValueError(
                f"batching_mode must be one of {BATCHING_MODES}, got {self.batching_mode!r}"
            )
        for name in ("max_seq_len", "max_batch_size", "prefill_token_budget", "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.block_size % 2:  # the cache keeps pairs of positions together
            raise ValueError(f"block_size must be even, got {self.block_size}")
        if self.max_waiting_requests < 1:  # 0 would refuse every request
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.batch_wait_timeout_s < 0:
            raise ValueError(f"batch_wait_timeout_s must be >= 0, got {self.batch_wait_timeout_s}")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise ValueError(f"kv_cache_gb must be > 0, got {self.kv_cache_gb}")
        if not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(
                f"draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {self.draft_tokens}"
            )
        if not self.draft_row_cost > 0:
            raise ValueError(f"draft_row_cost must be > 0, got {self.draft_row_cost}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")

    def cache_size(self, bytes_per_block: int, context: int) -> CacheSize:
        """Size the KV cache for a model of ``context`` tokens whose blocks take
        ``bytes_per_block``, and settle ``max_seq_len``: as set, else the model's context,
        else (when the cache holds fewer tokens) what the cache holds.

        Raises:
            ValueError: The budget cannot hold a set ``max_seq_len``, or not even one block.
        """
        seq_len = self.max_seq_len or context
        per_seq = -(-seq_len // self.block_size)
        budget = int((self.kv_cache_gb or DEFAULT_KV_CACHE_GB) * 1e9) // bytes_per_block
        if self.kv_cache_gb is None:  # then the budget is a cap: no more than the batch needs
            budget = min(budget, per_seq * self.max_batch_size)
        held = budget * self.block_size
        if budget < (1 if self.max_seq_len is None else per_seq):
            raise ValueError(
                f"kv_cache_gb: the KV cache holds {held} tokens, fewer "
                f"than one request of max_seq_len ({seq_len}) needs"
            )
        if self.max_seq_len is not None:
            beyond = f", beyond the model's context of {context}" if seq_len > context else ""
            return CacheSize(budget, seq_len, MAX_SEQ_LEN_FLAG, beyond)
        if held < context:
            gb = self.kv_cache_gb or DEFAULT_KV_CACHE_GB
            note = f" of {gb:g} GB; the model's context is {context}, --kv-cache-gb raises it"
            return CacheSize(budget, held, "the KV cache budget", note)
        return CacheSize(budget, context, "the model's context")
