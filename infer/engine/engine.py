"""The engine: requests in, one batched step at a time, token outputs out.

Synchronous and single-threaded: the server calls every method from its one engine thread.
``step()`` reads as three calls: schedule, run, process outputs.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import random
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from infer.engine.block_manager import BlockManager
from infer.engine.config import DTYPES, MAX_SEQ_LEN_FLAG, EngineConfig
from infer.engine.detokenizer import IncrementalDetokenizer
from infer.engine.logit_processors import process_logits
from infer.engine.params import SamplingParams
from infer.engine.prompts import encode_prompt
from infer.engine.request import (
    Failure,
    FinishReason,
    Logprobs,
    PromptLogprob,
    Refusal,
    Request,
    RequestError,
    RequestStatus,
    StepOutput,
    TraceSpec,
)
from infer.engine.runner import ModelRunner, PromptRows, RunnerOutput
from infer.engine.sampler import make_generator, ranked_logprobs, sample, token_logprobs
from infer.engine.scheduler import Clock, Scheduler, SchedulerOutput, make_scheduler
from infer.engine.speculative import DraftModel
from infer.models.base import CausalLM
from infer.models.context import AttnCapture
from infer.models.errors import LoadError
from infer.models.kv_cache import PagedKVCache

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
        self.blocks = BlockManager(size.num_blocks, config.block_size, config.prefix_caching)
        self.scheduler: Scheduler = make_scheduler(config, self.blocks, clock)
        self.runner = ModelRunner(model, config, self.blocks)
        self.draft_model: DraftModel | None = None
        if draft_model is not None:
            self.draft_model = DraftModel(
                draft_model, self.blocks.num_blocks, config.block_size, config.prefill_token_budget
            )
            # A one-row step reads the weights: the draft model's step costs their ratio.
            share = _weight_bytes(draft_model) / _weight_bytes(model)
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
        where = (dtype, config.device, config.weights)
        loaded = load_model(config.model, *where, kind=ModelKind.GENERATE)
        draft = None
        if config.draft_model is not None:
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
        return cls(config, model, tokenizer, eos)

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
        request = Request(request_id or f"req-{next(self._ids)}", ids, params, trace=trace)
        request.drafts.prediction = prediction
        seed = params.seed
        if seed is None and self._seeds is not None:
            seed = self._seeds.getrandbits(63)
        request.generator = make_generator(seed, self.model.device)
        request.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop)
        self.scheduler.add_request(request)
        return request

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
        return self._output(req, None, "")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def has_prompts(self) -> bool:
        """Whether the next step has prompt tokens to prefill (a prompt waits or is part-way)."""
        return self.scheduler.has_prompts()

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
        return self._process(result)

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

    def _process(self, result: RunnerOutput) -> list[StepOutput]:
        outputs = self._score_prompts(result.prompt_rows)
        if result.logits is None:
            return outputs
        plain: list[tuple[Request, int]] = []  # each request without a draft, and its row
        verify: list[tuple[Request, int]] = []  # each with one, and its first row
        row = 0
        for req in result.requests:
            first, row = row, row + 1 + len(req.draft)
            if req.is_finished:  # its prompt scoring failed
                continue
            if not req.params.max_new_tokens:  # it only scored its prompt
                outputs.append(self._end_scored(req))
            elif req.draft:
                verify.append((req, first))
            else:
                plain.append((req, first))
        outputs += self._sample(result, plain)
        for req, first in verify:
            outputs += self._verify(result, req, first)
        return outputs

    def _score_prompts(self, rows: list[PromptRows]) -> list[StepOutput]:
        """Add this step's prompt scores to the requests that score their prompts."""
        failed: list[StepOutput] = []
        for part in rows:
            req = part.request
            if req.is_finished:
                continue
            targets = req.prompt_ids[part.start + 1 : part.start + 1 + part.logits.shape[0]]
            try:
                scores = ranked_logprobs(part.logits, targets, req.params.prompt_logprobs or 0)
            except Exception as e:  # noqa: BLE001 - one request's failure ends only it
                failed += self._fail_requests([req], e)
                continue
            req.prompt_scores += [
                PromptLogprob(t, lp, rank, top)
                for t, (lp, rank, top) in zip(targets, scores, strict=True)
            ]
        return failed

    def _end_scored(self, req: Request) -> StepOutput:
        """End a request whose prompt was all it asked for (``max_new_tokens`` 0)."""
        req.finish(RequestStatus.FINISHED, FinishReason.LENGTH)
        self._release(req)
        return self._output(req, None, "")

    def _sample(self, result: RunnerOutput, plain: list[tuple[Request, int]]) -> list[StepOutput]:
        """The next token of each request of ``plain`` (one row each), with its logprobs and
        trace when asked: the whole batch at once."""
        if not plain:
            return []
        requests = [req for req, _ in plain]
        rows = [row for _, row in plain]
        assert result.logits is not None
        logits = result.logits if len(rows) == result.logits.shape[0] else result.logits[rows]
        try:
            penalized = any(r.params.repetition_penalty != 1.0 for r in requests)
            tokens = sample(
                process_logits(logits, requests),  # bias, penalties, grammar; logprobs stay raw
                [r.params for r in requests],
                [r.generator for r in requests],
                [r.history if penalized else () for r in requests],
            )
            lps = self._logprobs(requests, logits, tokens)
        except Exception as e:  # noqa: BLE001 - a batch-wide failure fails the batch
            return self._fail_requests(requests, e)
        outputs = []
        for i, (req, token) in enumerate(zip(requests, tokens, strict=True)):
            try:
                lp = lps[i] if lps else None
                out = self._emit(req, token, logits[i], lp, result.attn[rows[i]])
            except Exception as e:  # noqa: BLE001 - one request's failure ends only it
                out = self._fail_requests([req], e)[0]
            outputs.append(out)
        return outputs

    def _verify(self, result: RunnerOutput, req: Request, first: int) -> list[StepOutput]:
        """Sample a request's tokens from its rows in turn while they agree with its draft.

        Row ``j`` holds the distribution after draft token ``j - 1``; it is sampled as a
        plain step would sample it (same rules, same generator), and the draft goes on
        only while the sampled token is its next token. So a greedy request keeps the
        draft while it is the argmax, and a sampled one keeps draft token ``x`` with
        probability ``p(x)`` and otherwise draws from ``p`` without ``x``: the rule
        ``min(1, p/q)`` with its residual, for a draft that is one certain token. The
        output is token for token the one a request without drafts would produce.
        """
        assert result.logits is not None
        draft, kept, outputs = req.draft, 0, []
        for j in range(len(draft) + 1):
            if j:  # draft token j - 1 was kept: its key and value stay in the cache
                req.num_cached += 1
            row = result.logits[first + j : first + j + 1]
            try:
                history = req.history if req.params.repetition_penalty != 1.0 else ()
                processed = process_logits(row, [req])
                token = sample(processed, [req.params], [req.generator], [history])[0]
                lps = self._logprobs([req], row, [token])
                lp = lps[0] if lps else None
                out = self._emit(req, token, row[0], lp, result.attn[first + j])
            except Exception as e:  # noqa: BLE001 - one request's failure ends only it
                outputs += self._fail_requests([req], e)
                break
            out.drafted = j < len(draft) and token == draft[j]
            if out.trace is not None:
                out.trace["drafted"] = out.drafted
            kept += out.drafted
            outputs.append(out)
            if req.is_finished or not out.drafted:
                break
        req.drafts.record(len(draft), kept)
        self.scheduler.speculator.record(len(draft), kept)
        for out in outputs:
            out.accepted_prediction_tokens = req.drafts.accepted_prediction
            out.rejected_prediction_tokens = req.drafts.rejected_prediction
        if not req.is_finished:
            self.blocks.commit(req.request_id, req.token_ids, req.num_cached)
            self.blocks.trim(req.request_id, req.num_cached + 1)
        req.draft = []
        return outputs

    def _logprobs(
        self, requests: list[Request], logits: torch.Tensor, tokens: list[int]
    ) -> list[tuple[float, list[tuple[int, float]]]] | None:
        """The chosen tokens' logprobs and top alternatives, when a request asks for them."""
        if not any(r.params.logprobs or r.trace for r in requests):
            return None
        top_k = max(max(r.params.logprobs, r.trace.top_k if r.trace else 0) for r in requests)
        return token_logprobs(logits, tokens, top_k)

    def _emit(
        self,
        req: Request,
        token: int,
        logits: torch.Tensor,
        lp: tuple[float, list[tuple[int, float]]] | None,
        attn: torch.Tensor | None,
    ) -> StepOutput:
        """Append a sampled token to its request; its output, with logprobs and trace."""
        out = self._append_token(req, token)
        if lp is not None:
            chosen, top = lp
            if req.params.logprobs:
                out.logprobs = Logprobs(
                    self._text(token),
                    chosen,
                    [(self._text(t), p) for t, p in top[: req.params.logprobs]],
                )
            if req.trace is not None:
                out.trace = self._trace(req.trace, logits, chosen, top, attn)
        return out

    def _append_token(self, req: Request, token: int) -> StepOutput:
        if req.status == RequestStatus.PREFILL:
            req.status = RequestStatus.DECODE
        req.output_ids.append(token)
        detok = req.detokenizer
        assert detok is not None  # set in add_request
        reason: FinishReason | None = None
        if token in self.eos_token_ids and not req.params.ignore_eos:
            delta, reason = detok.finish(), FinishReason.EOS
        else:
            delta = detok.add(token)
            if detok.stopped:
                reason = FinishReason.STOP
            elif len(req.output_ids) >= req.params.max_new_tokens:
                delta, reason = delta + detok.finish(drop_partial=True), FinishReason.LENGTH
        if reason is not None:
            req.finish(RequestStatus.FINISHED, reason)
            self._release(req)
        out = self._output(req, token, delta)
        req.text_len += len(delta)
        return out

    def _trace(
        self,
        spec: TraceSpec,
        logits: torch.Tensor,
        chosen: float,
        top: list[tuple[int, float]],
        attn: torch.Tensor | None,
    ) -> dict[str, Any]:
        """Entropy (nats), the chosen token's probability and the top-k of the raw next-token
        distribution, plus attention."""
        logp = torch.log_softmax(logits, dim=-1)
        entropy = float(-(logp.exp() * logp).sum())
        return {
            "entropy": entropy,
            "prob": math.exp(chosen),
            "topk": [
                {"token_id": t, "token": self._text(t), "prob": math.exp(lp)}
                for t, lp in top[: spec.top_k]
            ],
            "attn": attn.tolist() if attn is not None else None,
            "drafted": False,  # a draft token the model agreed with (set by _verify)
        }

    def _text(self, token: int) -> str:
        return str(self.tokenizer.decode([token]))

    def _fail(self, plan: SchedulerOutput, error: Exception) -> list[StepOutput]:
        return self._fail_requests([c.request for c in plan.prefill] + plan.decode, error)

    def _fail_requests(self, requests: list[Request], error: Exception) -> list[StepOutput]:
        """End ``requests`` with an error output (also one already finished this step).

        The exception is logged here; the output carries only its code, whose message is
        safe to show (an exception's text may name files, weights or internals).
        """
        oom = isinstance(error, (torch.OutOfMemoryError, MemoryError))
        code = Failure.OUT_OF_MEMORY if oom else Failure.INFERENCE_FAILED
        log.error("%s for %s", code.name, ", ".join(r.request_id for r in requests), exc_info=error)
        outputs = []
        for req in requests:
            req.finish(RequestStatus.FAILED, code)
            self._release(req)
            outputs.append(self._output(req, None, ""))
        return outputs

    def _release(self, req: Request) -> None:
        self.scheduler.remove(req)
        if self.draft_model is not None:
            self.draft_model.free(req.request_id)

    def _output(self, req: Request, token: int | None, delta: str) -> StepOutput:
        out = StepOutput(
            request_id=req.request_id,
            token_id=token,
            text_delta=delta,
            outcome=req.outcome,
            prompt_tokens=req.prompt_len,
            completion_tokens=len(req.output_ids),
            num_tokens=int(token is not None),
            text_offset=req.text_len,
            cached_tokens=req.cached_tokens or 0,
            accepted_prediction_tokens=req.drafts.accepted_prediction,
            rejected_prediction_tokens=req.drafts.rejected_prediction,
        )
        scored = req.scores_prompt and len(req.prompt_scores) == req.prompt_len - 1
        if scored and not req.prompt_reported:  # the first output once the prompt is scored
            out.prompt_logprobs, req.prompt_reported = req.prompt_scores, True
        return out


def _weight_bytes(model: CausalLM) -> int:
    """Bytes of a model's weights (what a one-row step reads): its parameters and buffers,
    and the tensors its layers hold packed for the kernels."""
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, torch.Tensor):
                tensors[id(value)] = value
    return sum(t.numel() * t.element_size() for t in tensors.values())
