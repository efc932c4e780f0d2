"""What a step's logits become: each request's next tokens, checked against its stops, and
its outputs (text, log-probabilities, traces, prompt scores).

:class:`OutputProcessor` is the third call of :meth:`Engine.step <infer.engine.engine.Engine.step>`:
it samples every plain row of the batch at once, verifies each drafted request's rows in
turn, and ends requests (a stop, EOS, the token limit, or a failure) as it goes.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from infer.engine.block_manager import BlockManager
from infer.engine.healing import Vocabulary, advance, heal_logits
from infer.engine.logit_processors import process_logits
from infer.engine.request import (
    Failure,
    FinishReason,
    Logprobs,
    PromptLogprob,
    Request,
    RequestStatus,
    StepOutput,
    TraceSpec,
)
from infer.engine.runner import PromptRows, RunnerOutput
from infer.engine.sampler import ranked_logprobs, sample, token_logprobs
from infer.engine.speculative import Speculator

log = logging.getLogger("infer.engine")


class OutputProcessor:
    """Turns a step's logits into tokens and outputs.

    Args:
        tokenizer: Names tokens (log-probabilities, traces).
        eos_token_ids: Tokens that end a request (unless it ignores EOS).
        blocks: The KV cache's blocks (a verified draft commits what it kept).
        speculator: Counts drafted and accepted tokens.
        release: Frees a request that ended.
        clock: The engine's clock (a code completion's time budget).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        eos_token_ids: Iterable[int],
        blocks: BlockManager,
        speculator: Speculator,
        release: Callable[[Request], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.blocks = blocks
        self.speculator = speculator
        self.release = release
        self.clock = clock
        self.vocabulary: Vocabulary | None = None  # token healing's, made when first needed

    def process(self, result: RunnerOutput) -> list[StepOutput]:
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
                failed += self.fail([req], e)
                continue
            req.prompt_scores += [
                PromptLogprob(t, lp, rank, top)
                for t, (lp, rank, top) in zip(targets, scores, strict=True)
            ]
        return failed

    def _end_scored(self, req: Request) -> StepOutput:
        """End a request whose prompt was all it asked for (``max_new_tokens`` 0)."""
        req.finish(RequestStatus.FINISHED, FinishReason.LENGTH)
        self.release(req)
        return step_output(req, None, "")

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
                self._heal(process_logits(logits, requests), requests),  # logprobs stay raw
                [r.params for r in requests],
                [r.generator for r in requests],
                [r.history if penalized else () for r in requests],
            )
            lps = self._logprobs(requests, logits, tokens)
        except Exception as e:  # noqa: BLE001 - a batch-wide failure fails the batch
            return self.fail(requests, e)
        outputs = []
        for i, (req, token) in enumerate(zip(requests, tokens, strict=True)):
            try:
                lp = lps[i] if lps else None
                out = self._emit(req, token, logits[i], lp, result.attn[rows[i]])
            except Exception as e:  # noqa: BLE001 - one request's failure ends only it
                out = self.fail([req], e)[0]
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
                processed = self._heal(process_logits(row, [req]), [req])
                token = sample(processed, [req.params], [req.generator], [history])[0]
                lps = self._logprobs([req], row, [token])
                lp = lps[0] if lps else None
                out = self._emit(req, token, row[0], lp, result.attn[first + j])
            except Exception as e:  # noqa: BLE001 - one request's failure ends only it
                outputs += self.fail([req], e)
                break
            out.drafted = j < len(draft) and token == draft[j]
            if out.trace is not None:
                out.trace["drafted"] = out.drafted
            kept += out.drafted
            outputs.append(out)
            if req.is_finished or not out.drafted:
                break
        req.drafts.record(len(draft), kept)
        self.speculator.record(len(draft), kept)
        for out in outputs:
            out.accepted_prediction_tokens = req.drafts.accepted_prediction
            out.rejected_prediction_tokens = req.drafts.rejected_prediction
        if not req.is_finished:
            self.blocks.commit(req.request_id, req.token_ids, req.num_cached)
            self.blocks.trim(req.request_id, req.num_cached + 1)
        req.draft = []
        return outputs

    def _heal(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Mask what the rows that heal their prompt's end may not take (the vocabulary's
        texts are read at the first such request)."""
        if not any(r.heal_left for r in requests):
            return logits
        if self.vocabulary is None:
            self.vocabulary = Vocabulary(self.tokenizer, logits.shape[-1])
        return heal_logits(logits, requests, self.vocabulary)

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
        out = self.append_token(req, token)
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

    def append_token(self, req: Request, token: int) -> StepOutput:
        """Append a token to its request and end the request where it stops: EOS or a stop
        token, a stop string or a code completion's line stop, its token limit or time
        budget (every stop condition is decided here)."""
        if req.status == RequestStatus.PREFILL:
            req.status = RequestStatus.DECODE
        req.output_ids.append(token)
        if req.heal_left:
            advance(req, self._text(token))
        if req.first_token_at is None:
            req.first_token_at = self.clock()
        detok = req.detokenizer
        assert detok is not None  # set in add_request
        params = req.params
        reason: FinishReason | None = None
        ends = token in self.eos_token_ids or token in params.stop_token_ids
        if ends and not params.ignore_eos:
            delta, reason = detok.finish(), FinishReason.EOS
        else:
            delta = detok.add(token)
            if detok.stopped:
                reason = FinishReason.STOP
            elif len(req.output_ids) >= params.max_new_tokens or self._out_of_time(req, token):
                delta, reason = delta + detok.finish(drop_partial=True), FinishReason.LENGTH
        if reason is not None:
            req.finish(RequestStatus.FINISHED, reason)
            self.release(req)
        out = step_output(req, token, delta)
        req.text_len += len(delta)
        return out

    def _out_of_time(self, req: Request, token: int) -> bool:
        """Whether a code completion spent its time budget: checked at each token that ends
        a line, so the completion ends with whole lines (as llama.cpp's does)."""
        editor = req.params.editor
        if editor is None or editor.time_budget_s is None or req.first_token_at is None:
            return False
        spent = self.clock() - req.first_token_at
        return spent >= editor.time_budget_s and "\n" in self._text(token)

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

    def fail(self, requests: list[Request], error: Exception) -> list[StepOutput]:
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
            self.release(req)
            outputs.append(step_output(req, None, ""))
        return outputs


def step_output(req: Request, token: int | None, delta: str) -> StepOutput:
    """The output of one step for ``req``: its new token and text, or its end."""
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
    if req.outcome is FinishReason.STOP and req.detokenizer is not None:
        out.stop = req.detokenizer.matched
    scored = req.scores_prompt and len(req.prompt_scores) == req.prompt_len - 1
    if scored and not req.prompt_reported:  # the first output once the prompt is scored
        out.prompt_logprobs, req.prompt_reported = req.prompt_scores, True
    return out
