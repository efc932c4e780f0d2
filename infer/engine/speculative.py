"""Draft tokens for speculative decoding, and how many of them a step verifies.

A decoding request may verify a few guessed next tokens (a draft) in the step's one forward:
its last token and the draft run as ``1 + k`` rows, each one a decode row of its own (so
each row's logits are the bits a plain decode would give), and the sampler keeps the draft
while its tokens are the ones it samples. One forward then yields up to ``k + 1`` tokens for
little more than one read of the weights.

Drafts cost nothing to make here: they are copied from text the request already holds.

- **Prediction**: the request's ``prediction`` (OpenAI's Predicted Outputs), the text its
  answer is expected to repeat (the file an edit returns).
- **Prompt lookup**: the request's own prompt and output so far. Where its last tokens
  appeared before, the tokens that followed then are the guess (an edit copies its input, an
  agent repeats names and paths).

Each source is a :class:`Corpus`. It follows a match from step to step (a copy goes on where
the last one stopped), else it looks up the request's last 4, 3 or 2 tokens in an index of
its n-grams.

How many draft tokens run is the plan's business (:meth:`Speculator.plan`). A draft row is
worth running when the chance that its token is kept beats the batch's tokens per row of
cost. Each extra row costs ``row_cost`` of a one-row step (the bytes of the weights dominate
a small step, compute each row), and a request's chance of keeping its ``j``-th draft token
is ``a ** j`` for its recent acceptance rate ``a``. A lone stream that copies its input
runs long drafts; a batch that is already compute-bound runs none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from infer.engine.block_manager import BlockManager
from infer.models.base import CausalLM
from infer.models.context import SequenceSlice, paged_context
from infer.models.kv_cache import PagedKVCache

MAX_NGRAM = 4
MIN_NGRAM = 2
# The acceptance rate a request starts from (copied text may match by chance; a draft model
# of the same family mostly agrees), and how much weight that guess carries (in verified
# draft tokens) against what the request shows.
PRIOR_LOOKUP = 0.5
PRIOR_MODEL = 0.7
PRIOR_WEIGHT = 1.0
DECAY = 0.5  # per verify step: the last few steps count most (a copy ends abruptly)


class Corpus:
    """Tokens a draft may be copied from: a fixed text, or one that grows (the request's
    own prompt and output).

    Args:
        tokens: The text's ids; ``None``: the request's own tokens, as they grow.
    """

    def __init__(self, tokens: Sequence[int] | None = None) -> None:
        self.own = tokens is None
        self.tokens: Sequence[int] = tokens or []
        self._index: dict[tuple[int, ...], int] = {}  # n-gram → where its latest successor is
        self._indexed = 0  # n-grams ending before this position are in the index
        self._cursor = -1  # where the last draft was copied from
        self._anchor = 0  # the sequence length when it was

    def propose(self, sequence: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the end of ``sequence`` in this text.

        Args:
            sequence: The request's tokens so far (prompt, then output).
            k: Most tokens to return.
        """
        if self.own:
            self.tokens = sequence
        self._grow()
        start = self._follow(sequence)
        if start < 0:
            start = self._lookup(sequence)
        if start < 0:
            return []
        self._cursor, self._anchor = start, len(sequence)
        return list(self.tokens[start : start + k])

    def _follow(self, sequence: Sequence[int]) -> int:
        """Where the last copy goes on, if the tokens since agree with this text."""
        if self._cursor < 0:
            return -1
        at = self._cursor + len(sequence) - self._anchor
        n = min(MIN_NGRAM, len(sequence))
        if at < n or at >= len(self.tokens):
            return -1
        tail = sequence[len(sequence) - n :]
        return at if list(self.tokens[at - n : at]) == list(tail) else -1

    def _lookup(self, sequence: Sequence[int]) -> int:
        for n in range(min(MAX_NGRAM, len(sequence)), MIN_NGRAM - 1, -1):
            start = self._index.get(tuple(sequence[len(sequence) - n :]))
            if start is not None:
                return start
        return -1

    def _grow(self) -> None:
        """Index the n-grams whose successor is known (a text that grows gains some)."""
        tokens = self.tokens
        for end in range(max(self._indexed, MIN_NGRAM), len(tokens)):
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                self._index[tuple(tokens[end - n : end])] = end
        self._indexed = max(self._indexed, len(tokens))


@dataclass
class Acceptance:
    """How often a request's drafts from one kind of source were kept, recent steps first."""

    prior: float = PRIOR_LOOKUP
    kept: float = 0.0  # draft tokens kept, decayed
    missed: float = 0.0  # draft tokens rejected (at most one per step), decayed

    @property
    def rate(self) -> float:
        """The chance that the next draft token is kept, given the one before it was."""
        prior = self.prior * PRIOR_WEIGHT
        return (self.kept + prior) / (self.kept + self.missed + PRIOR_WEIGHT)

    def record(self, drafted: int, kept: int) -> None:
        self.kept = self.kept * DECAY + kept
        self.missed = self.missed * DECAY + int(kept < drafted)


@dataclass
class DraftState:
    """One request's draft sources and the acceptance it has shown.

    Args:
        prediction: The ids of the request's ``prediction``, if it sent one.
    """

    prediction: list[int] | None = None
    sources: list[Corpus] = field(default_factory=list)
    lookup: Acceptance = field(default_factory=Acceptance)  # drafts copied from text
    model: Acceptance = field(default_factory=lambda: Acceptance(PRIOR_MODEL))  # a model's
    source: str = ""  # this step's draft: "prediction", "prompt" or "model"
    accepted_prediction: int = 0  # prediction tokens the answer kept
    rejected_prediction: int = 0  # prediction tokens drafted and not kept

    @property
    def acceptance(self) -> float:
        """The acceptance of drafts copied from text."""
        return self.lookup.rate

    def propose(self, sequence: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens: from the prediction while it matches, else from the
        request's own tokens."""
        if not self.sources:
            if self.prediction:
                self.sources.append(Corpus(self.prediction))
            self.sources.append(Corpus())
        for i, source in enumerate(self.sources):
            draft = source.propose(sequence, k)
            if draft:
                self.source = "prediction" if self.prediction and i == 0 else "prompt"
                return draft
        return []

    def record(self, drafted: int, kept: int) -> None:
        """A verify step kept ``kept`` of its ``drafted`` draft tokens."""
        (self.model if self.source == "model" else self.lookup).record(drafted, kept)
        if self.source == "prediction":
            self.accepted_prediction += kept
            self.rejected_prediction += drafted - kept


@dataclass
class Speculator:
    """Plans each step's drafts.

    Args:
        max_tokens: Most draft tokens one request verifies in a step (0: no speculation).
        row_cost: What one more row costs, as a share of a one-row step.
    """

    max_tokens: int
    row_cost: float
    drafted: int = 0  # draft tokens verified, all requests (for /metrics)
    accepted: int = 0  # of which kept

    def plan(self, requests: Sequence[tuple[float, int, float]], rows: int) -> list[int]:
        """How many draft tokens each decoding request may verify this step.

        Draft tokens are given out in order of what they pay for what they cost: the
        ``j``-th draft token of a request with acceptance ``a`` is kept with chance
        ``a ** j``, and costs a row (plus, from a draft model, the model's step). One is
        worth taking while its chance per cost beats the step's expected tokens per cost
        so far.

        Args:
            requests: Each decoding request's acceptance rate, the most draft tokens it can
                use, and what each costs in rows (1 for a copied draft).
            rows: Rows the step runs already (decode tokens and prompt chunks).

        Returns:
            Draft tokens allowed, per request.
        """
        allowed = [0] * len(requests)
        if not self.max_tokens:
            return allowed
        offers = sorted(
            (
                (acceptance**j / price, acceptance**j, price, i)
                for i, (acceptance, most, price) in enumerate(requests)
                for j in range(1, min(self.max_tokens, most) + 1)
            ),
            reverse=True,
        )
        tokens, cost = float(len(requests)), 1.0 / self.row_cost + rows
        for worth, chance, price, i in offers:
            if worth <= tokens / cost:
                break
            allowed[i] += 1
            tokens, cost = tokens + chance, cost + price
        return allowed

    def record(self, drafted: int, kept: int) -> None:
        self.drafted += drafted
        self.accepted += kept


class DraftModel:
    """A smaller model with the same tokenizer that drafts greedily, on a KV cache of its own.

    Each request's draft cache holds the tokens the draft model has run for it. Before it
    drafts, it catches up on what the request gained since (its last token, the draft tokens
    the model kept, the one it chose itself); drafted tokens the model did not keep are
    overwritten then. Every step runs ``k`` small forwards: the catch-up with the first draft
    token's logits, then one per further token, every drafting request in each.

    It reads a request from where it first drafted for it, at most ``catch_up_budget``
    tokens back: a long prompt (an agent's tool schemas) would cost the draft model a
    prefill of its own, and the last thousand tokens are what a draft depends on.

    Args:
        model: The draft model.
        num_blocks: Blocks of its KV cache.
        block_size: Tokens per block.
        catch_up_budget: Most tokens it runs to catch up in one step, and how far back it
            reads a request it starts on.
    """

    def __init__(
        self, model: CausalLM, num_blocks: int, block_size: int, catch_up_budget: int
    ) -> None:
        self.model = model
        self.blocks = BlockManager(num_blocks, block_size, prefix_caching=False)
        self.cache = PagedKVCache(model.config, num_blocks, block_size, model.dtype, model.device)
        self.catch_up_budget = catch_up_budget
        self._held: dict[str, list[int]] = {}  # request → the tokens its draft cache holds
        self._offset: dict[str, int] = {}  # request → where the draft model's view starts

    @staticmethod
    def check_tokenizer(target: PreTrainedTokenizerBase, draft: PreTrainedTokenizerBase) -> None:
        """Refuse a draft model whose tokens are not the target's.

        Raises:
            ValueError: The vocabularies differ (the message says how).
        """
        ours, theirs = target.get_vocab(), draft.get_vocab()
        if ours != theirs:
            differ = sorted(set(ours.items()) ^ set(theirs.items()))[:3]
            raise ValueError(
                f"the draft model's tokenizer is not the model's ({len(theirs)} tokens against "
                f"{len(ours)}; first differences: {differ})"
            )

    def free(self, request_id: str) -> None:
        self._held.pop(request_id, None)
        self._offset.pop(request_id, None)
        self.blocks.free(request_id)

    @torch.inference_mode()
    def draft(self, wanted: Sequence[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        """Draft ``k`` tokens after each request's tokens.

        Args:
            wanted: ``(request id, its tokens so far, k)`` per request.

        Returns:
            Request id → its draft. A request with more to catch up on than the budget
            leaves catches up part of the way and gets none this step; so does one whose
            blocks ran out.
        """
        spans: list[tuple[str, list[int], int]] = []  # id, tokens to run, their start
        drafting: list[tuple[str, list[int], int]] = []  # id, tokens, k
        budget = self.catch_up_budget
        for request_id, sequence, k in wanted:
            window = len(sequence) - self.catch_up_budget
            tokens = sequence[self._offset.setdefault(request_id, max(0, window)) :]
            start = self._valid(request_id, tokens)
            end = min(len(tokens), start + budget)
            if end <= start or not self._room(request_id, max(end, len(tokens) + k - 1)):
                continue
            budget -= end - start
            spans.append((request_id, tokens[start:end], start))
            self._held[request_id] = list(tokens[:end])
            if end == len(tokens):
                drafting.append((request_id, tokens, k))
        if not spans:
            return {}
        first = dict(zip((rid for rid, _, _ in spans), self._forward(spans), strict=True))
        drafts = {rid: [first[rid]] for rid, _, _ in drafting}
        for j in range(1, max((k for *_, k in drafting), default=0)):
            going = [(rid, len(tokens)) for rid, tokens, k in drafting if k > j]
            nxt = self._forward([(rid, [drafts[rid][-1]], n + j - 1) for rid, n in going])
            for (rid, _), token in zip(going, nxt, strict=True):
                self._held[rid].append(drafts[rid][-1])
                drafts[rid].append(token)
        return drafts

    def _valid(self, request_id: str, tokens: list[int]) -> int:
        """How many of ``tokens`` the request's draft cache holds (the rest is recomputed)."""
        held = self._held.get(request_id, [])
        n = 0
        for a, b in zip(held, tokens[:-1], strict=False):  # the last token runs: it drafts
            if a != b:
                break
            n += 1
        return n

    def _room(self, request_id: str, num_tokens: int) -> bool:
        if self.blocks.ensure(request_id, num_tokens):
            return True
        self.free(request_id)  # no room: it starts again later
        return False

    def _forward(self, spans: list[tuple[str, list[int], int]]) -> list[int]:
        """Run each request's tokens at their positions; the greedy next token of each."""
        decode = [s for s in spans if len(s[1]) == 1 and s[2] > 0]
        prefill = [s for s in spans if not (len(s[1]) == 1 and s[2] > 0)]
        ordered = decode + prefill
        slices = [SequenceSlice(self.blocks.table(rid), start, len(t)) for rid, t, start in ordered]
        ids = [t for _, toks, _ in ordered for t in toks]
        device = self.model.device
        ctx, positions = paged_context(self.cache, slices, len(decode), device)
        rows = torch.tensor(ctx.last_token, device=device, dtype=torch.long)
        out = self.model.forward_paged(torch.tensor(ids, device=device), positions, ctx, rows)
        tokens = dict(
            zip((rid for rid, _, _ in ordered), out.logits.argmax(-1).tolist(), strict=True)
        )
        return [tokens[rid] for rid, _, _ in spans]
