"""The engine: requests in, one batched step at a time, token outputs out.

Synchronous and single-threaded: the server calls every method from its one engine thread.
``step()`` reads as three calls: schedule, run, process outputs (:mod:`infer.engine.outputs`).
This module holds the step loop and each request's lifecycle: check, queue, abort, release.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import random
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from infer.engine.block_manager import BlockManager
from infer.engine.config import DTYPES, MAX_SEQ_LEN_FLAG, EngineConfig
from infer.engine.detokenizer import IncrementalDetokenizer
from infer.engine.outputs import OutputProcessor, step_output
from infer.engine.params import SamplingParams
from infer.engine.prompts import encode_prompt
from infer.engine.request import (
    Failure,
    Refusal,
    Request,
    RequestError,
    RequestStatus,
    StepOutput,
    TraceSpec,
)
from infer.engine.runner import ModelRunner
from infer.engine.sampler import make_generator
from infer.engine.scheduler import Clock, Scheduler, SchedulerOutput, make_scheduler
from infer.engine.speculative import DraftModel
from infer.models.base import CausalLM
from infer.models.context import AttnCapture
from infer.models.errors import LoadError
from infer.models.fim import FimTokens, find_fim_tokens
from infer.models.footprint import weight_bytes
from infer.models.kv_cache import PagedKVCache

if TYPE_CHECKING:
    from infer.models.loader import LoadedModel

log = logging.getLogger("infer.engine")


class Engine:
    """Continuous or static batching over one model and one KV cache."""

    def __init__(
        self,
        config: EngineConfig,
        model: CausalLM,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: Sequence[int] = (),
        model_name: str = "model",
        clock: Clock = time.monotonic,
        draft_model: CausalLM | None = None,
        fim: FimTokens | None = None,
    ) -> None:
        block_bytes = PagedKVCache.bytes_per_block(model.config, config.block_size, model.dtype)
        size = config.cache_size(block_bytes, model.config.max_position_embeddings)
        # The config from here on has max_seq_len set; `cache_size` says what set it.
        config = dataclasses.replace(config, max_seq_len=size.max_seq_len)
        self.config = config
        self.cache_size = size
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.model_name = model_name
        self.fim = fim  # the model's fill-in-the-middle tokens, if it has them
        self.loaded_at = time.time()  # wall-clock time its model was ready to serve
        self._special_ids = _special_tokens(tokenizer)
        self.blocks = BlockManager(size.num_blocks, config.block_size, config.prefix_caching)
        self.scheduler: Scheduler = make_scheduler(config, self.blocks, clock)
        self.runner = ModelRunner(model, config, self.blocks)
        speculator = self.scheduler.speculator
        self.outputs = OutputProcessor(
            tokenizer, eos_token_ids, self.blocks, speculator, self._release, clock
        )
        self.draft_model: DraftModel | None = None
        if draft_model is not None:
            self.draft_model = DraftModel(
                draft_model, self.blocks.num_blocks, config.block_size, config.prefill_token_budget
            )
            # A one-row step reads the weights: the draft model's step costs their ratio.
            share = weight_bytes(draft_model) / weight_bytes(model)
            self.scheduler.draft_price = 1 + share / config.draft_row_cost
        self._ids = itertools.count()
        # With an engine seed, requests that bring none still sample reproducibly.
        self._seeds = random.Random(config.seed) if config.seed is not None else None

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Load ``config.model`` and build an engine on it.

        Raises:
            LoadError: The model cannot be loaded.
        """
        from infer.models.config import ModelKind
        from infer.models.loader import load_model

        dtype = DTYPES[config.dtype]
        loaded = load_model(
            config.model, dtype, config.device, config.weights, kind=ModelKind.GENERATE
        )
        return cls.from_loaded(config, loaded)

    @classmethod
    def from_loaded(cls, config: EngineConfig, loaded: LoadedModel) -> Engine:
        """Build an engine on a loaded model, loading ``config.draft_model`` if it names one.

        Raises:
            LoadError: The draft model cannot be loaded, or its tokenizer differs.
        """
        from infer.models.config import ModelKind
        from infer.models.loader import load_model

        draft = None
        if config.draft_model is not None:
            where = (DTYPES[config.dtype], config.device, config.weights)
            drafter = load_model(config.draft_model, *where, kind=ModelKind.GENERATE)
            try:
                DraftModel.check_tokenizer(loaded.tokenizer, drafter.tokenizer)
            except ValueError as e:
                raise LoadError(f"--draft-model {config.draft_model}: {e}") from None
            draft = drafter.model
        return cls(
            config,
            loaded.model,
            loaded.tokenizer,
            loaded.eos_token_ids,
            loaded.name,
            draft_model=draft,
            fim=loaded.fim,
        )

    @classmethod
    def from_components(
        cls,
        config: EngineConfig,
        model: CausalLM,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: Sequence[int] | None = None,
    ) -> Engine:
        """Build on a model already in memory (tests, tiny or mock models)."""
        eos = eos_token_ids
        if eos is None:
            eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        return cls(config, model, tokenizer, eos, fim=find_fim_tokens(tokenizer))

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        trace: TraceSpec | None = None,
        prediction: str | Sequence[int] | None = None,
    ) -> Request:
        """Encode (text), check and queue a request (``prediction``: see :meth:`queue`).

        Raises:
            RequestError: The prompt is empty or has ids outside the vocabulary, or
                :meth:`check` refuses it.
        """
        ids = encode_prompt(self.tokenizer, self.model.config.vocab_size, prompt)
        self.check(len(ids), params.max_new_tokens, trace)
        predicted = None
        if prediction is not None:
            predicted = self.encode_prediction(prediction)
        return self.queue(ids, params, request_id, trace, predicted)

    def encode_prediction(self, prediction: str | Sequence[int]) -> list[int]:
        """A prediction's token ids (text is encoded without special tokens)."""
        if isinstance(prediction, str):
            return list(self.tokenizer.encode(prediction, add_special_tokens=False))
        return list(prediction)

    @functools.cached_property
    def model_bytes(self) -> int:
        """Bytes of the model's weights as held (read once: it walks every layer)."""
        return weight_bytes(self.model)

    @property
    def max_seq_len(self) -> int:
        """Longest prompt + completion a request may have (what ``cache_size`` settled)."""
        return self.cache_size.max_seq_len

    @property
    def seq_len_source(self) -> str:
        """Where ``max_seq_len`` comes from, for people: the flag, and what set it here."""
        bound = self.cache_size.bound
        return bound if bound == MAX_SEQ_LEN_FLAG else f"{MAX_SEQ_LEN_FLAG}; here {bound}"

    def check(self, prompt_len: int, max_new_tokens: int, trace: TraceSpec | None) -> None:
        """Refuse a request that cannot fit in ``max_seq_len`` or traces a missing layer.

        The one length check of every route (the server's admission calls it too).

        Raises:
            RequestError: ``CONTEXT_LENGTH_EXCEEDED`` or ``INVALID_VALUE``.
        """
        if prompt_len + max_new_tokens > self.max_seq_len:
            raise RequestError(
                Refusal.CONTEXT_LENGTH_EXCEEDED,
                f"prompt ({prompt_len} tokens) + max_tokens ({max_new_tokens}) exceeds the "
                f"max sequence length, {self.max_seq_len} tokens ({self.seq_len_source})",
            )
        layers = self.model.config.num_hidden_layers
        if trace is not None and trace.layer is not None and not 0 <= trace.layer < layers:
            raise RequestError(
                Refusal.INVALID_VALUE,
                f"trace.layer must be in [0, {layers - 1}], got {trace.layer}",
            )

    def queue(
        self,
        ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        trace: TraceSpec | None = None,
        prediction: list[int] | None = None,
    ) -> Request:
        """Queue a request whose ids and limits were checked (:meth:`check`).

        Args:
            ids: The prompt's token ids.
            params: How it samples and stops.
            request_id: Its id (default: a fresh one).
            trace: The per-token trace it asks for.
            prediction: Token ids its answer is expected to repeat (drafts come from them
                first).
        """
        params = self._special_stops(params)
        request = Request(request_id or f"req-{next(self._ids)}", ids, params, trace=trace)
        request.drafts.prediction = prediction
        seed = params.seed
        if seed is None and self._seeds is not None:
            seed = self._seeds.getrandbits(63)
        request.generator = make_generator(seed, self.model.device)
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer, ids, stop=params.stop, lines=params.editor, skip=params.healing
        )
        request.heal_left = params.healing
        self.scheduler.add_request(request)
        return request

    def _special_stops(self, params: SamplingParams) -> SamplingParams:
        """A stop string that is a special token's text (``<|im_end|>``) stops on that token:
        special tokens never show in the text, where the string could never match."""
        ids = {self._special_ids[s] for s in params.stop if s in self._special_ids}
        if not ids:
            return params
        stop = [s for s in params.stop if s not in self._special_ids]
        return dataclasses.replace(params, stop=stop, stop_token_ids=params.stop_token_ids | ids)

    def abort(self, request_id: str, why: Failure = Failure.CANCELLED) -> StepOutput | None:
        """End a request now and free its slot; its last output says ``why``.

        Returns:
            That output; ``None`` for an unknown or finished id.
        """
        req = self.scheduler.find(request_id)
        if req is None or req.is_finished:
            return None
        req.finish(RequestStatus.ABORTED, why)
        self._release(req)
        return step_output(req, None, "")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def has_prompts(self) -> bool:
        """Whether the next step has prompt tokens to prefill (a prompt waits or is part-way)."""
        return self.scheduler.has_prompts()

    def has_latency_work(self) -> bool:
        """Whether someone waits on the next step itself: a prompt for its first token, or a
        code completion (an editor shows it as soon as it ends) for any token."""
        running = self.scheduler.running
        return self.has_prompts() or any(r.params.editor is not None for r in running)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def attention_matrix(self, ids: Sequence[int], layer: int, head: int) -> torch.Tensor:
        """One head's attention probabilities over a whole prompt (no KV cache is touched).

        Returns:
            ``[T, T]`` float32: row i is query token i's weights over keys ``0..T-1`` (zero
            above the diagonal).
        """
        model = self.model
        with torch.inference_mode():
            input_ids = torch.tensor([list(ids)], device=model.device)
            positions = torch.arange(len(ids), device=model.device).unsqueeze(0)  # [1, T]
            out = model(input_ids, positions, capture=AttnCapture(frozenset({layer})))
        assert out.attn is not None  # a capture was given
        return out.attn[layer][0, head].float().cpu()

    @property
    def memory_bytes(self) -> int:
        """Bytes it holds: its weights (and its draft model's) and its KV caches."""
        held = weight_bytes(self.model) + self.runner.cache.nbytes()
        if self.draft_model is not None:
            held += weight_bytes(self.draft_model.model) + self.draft_model.cache.nbytes()
        return held

    def cache_stats(self) -> dict[str, int]:
        """KV cache and draft counters for ``/metrics`` (plain ints: safe to read from
        another thread)."""
        spec = self.scheduler.speculator
        return {
            "infer_draft_tokens_total": spec.drafted,
            "infer_draft_tokens_accepted_total": spec.accepted,
            "infer_kv_blocks_used": self.blocks.num_used,
            "infer_kv_blocks_total": self.blocks.num_blocks,
            "infer_prefix_cache_hits_total": self.blocks.hits,
            "infer_prefix_cache_queries_total": self.blocks.queries,
            "infer_preemptions_total": self.scheduler.preemptions,
        }

    def step(self) -> list[StepOutput]:
        """Schedule, run one batched forward (decode + prefill), and turn logits into outputs."""
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return []
        if self.draft_model is not None:
            self._model_drafts(plan.decode)
        try:
            result = self.runner.run(plan)
        except Exception as e:  # noqa: BLE001 - any forward failure fails this step's requests
            return self._fail(plan, e)
        return self.outputs.process(result)

    def _model_drafts(self, decode: list[Request]) -> None:
        """Let the draft model write the drafts the plan gave it (none if it fails)."""
        assert self.draft_model is not None
        wanted = [(r.request_id, r.token_ids, r.model_draft) for r in decode if r.model_draft]
        if not wanted:
            return
        try:
            drafts = self.draft_model.draft(wanted)
        except Exception:  # noqa: BLE001 - no draft is a slower step, not a failed one
            log.exception("the draft model failed; this step runs without its drafts")
            drafts = {}
        for req in decode:
            if req.model_draft:
                req.draft, req.model_draft = drafts.get(req.request_id, []), 0
                if req.draft:
                    req.drafts.source = "model"

    def _fail(self, plan: SchedulerOutput, error: Exception) -> list[StepOutput]:
        return self.outputs.fail([c.request for c in plan.prefill] + plan.decode, error)

    def _release(self, req: Request) -> None:
        self.scheduler.remove(req)
        if self.draft_model is not None:
            self.draft_model.free(req.request_id)


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """The text of each special token, and its id."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {token.content: i for i, token in added.items() if token.special}
