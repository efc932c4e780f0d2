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

MAX_NGRAM = 4
MIN_NGRAM = 2
# The acceptance rate a request starts from, and how much weight that guess carries
# (in verified draft tokens) against what the request shows.
PRIOR_ACCEPTANCE = 0.5
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
class DraftState:
    """One request's draft sources and the acceptance it has shown.

    Args:
        prediction: The ids of the request's ``prediction``, if it sent one.
    """

    prediction: list[int] | None = None
    sources: list[Corpus] = field(default_factory=list)
    kept: float = 0.0  # draft tokens kept, decayed
    missed: float = 0.0  # draft tokens rejected (at most one per step), decayed
    from_prediction: bool = False  # this step's draft came from the prediction
    accepted_prediction: int = 0  # prediction tokens the answer kept
    rejected_prediction: int = 0  # prediction tokens drafted and not kept

    @property
    def acceptance(self) -> float:
        """The chance that the next draft token is kept, given the one before it was."""
        prior = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
        return (self.kept + prior) / (self.kept + self.missed + PRIOR_WEIGHT)

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
                self.from_prediction = self.prediction is not None and i == 0
                return draft
        return []

    def record(self, drafted: int, kept: int) -> None:
        """A verify step kept ``kept`` of its ``drafted`` draft tokens."""
        self.kept = self.kept * DECAY + kept
        self.missed = self.missed * DECAY + int(kept < drafted)
        if self.from_prediction:
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

    def plan(self, requests: Sequence[tuple[float, int]], rows: int) -> list[int]:
        """How many draft tokens each decoding request may verify this step.

        Rows are given out in order of the chance they pay: the ``j``-th draft token of a
        request with acceptance ``a`` is kept with chance ``a ** j``, and is worth a row
        while that chance beats the step's expected tokens per unit of cost so far.

        Args:
            requests: Each decoding request's acceptance rate and the most draft tokens it
                can use (its ``max_new_tokens`` left, less the token every step makes).
            rows: Rows the step runs already (decode tokens and prompt chunks).

        Returns:
            Draft tokens allowed, per request.
        """
        allowed = [0] * len(requests)
        if not self.max_tokens:
            return allowed
        offers = sorted(
            (
                (acceptance**j, i)
                for i, (acceptance, most) in enumerate(requests)
                for j in range(1, min(self.max_tokens, most) + 1)
            ),
            reverse=True,
        )
        tokens, cost = float(len(requests)), 1.0 / self.row_cost + rows
        for chance, i in offers:
            if chance <= tokens / cost:
                break
            allowed[i] += 1
            tokens, cost = tokens + chance, cost + 1
        return allowed

    def record(self, drafted: int, kept: int) -> None:
        self.drafted += drafted
        self.accepted += kept
