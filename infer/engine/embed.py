"""Embeddings: many texts through an encoder in a few batched forwards, on the caller's thread.

Synchronous and free of I/O, like the rest of the engine. Inputs are sorted by length and cut
into batches of at most ``token_budget`` padded tokens, so little of a batch is padding and
its activations stay bounded whatever the request holds. torch runs each forward on the
threads the caller set (``torch.set_num_threads``); nothing here changes them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from infer.engine.request import Refusal, RequestError
from infer.models.loader import LoadedEmbeddingModel
from infer.models.pooling import normalize, pool

# Padded tokens per forward. The 32 x 256-token benchmark ran fastest at 8 rows a forward
# (bench/results/LOG.md): larger batches' activations pass glibc's 32 MB mmap threshold, and
# every such allocation then faults in fresh pages.
DEFAULT_TOKEN_BUDGET = 2048

EmbedInput = str | Sequence[int]


@dataclass
class Embeddings:
    """One vector per input, in input order, and what each input cost."""

    vectors: Tensor  # [N, D] float32; unit length where the model normalises
    token_counts: list[int]  # tokens each input ran as, its special tokens included

    @property
    def total_tokens(self) -> int:
        return sum(self.token_counts)


class Embedder:
    """Embeds texts, or token ids, with an encoder loaded by
    ``load_model(name, kind=ModelKind.EMBED)``.

    Text is tokenized as sentence-transformers does (the model's special tokens around it:
    ``[CLS] ... [SEP]`` for BERT). A token-id input is the text's tokens without those, and
    gets them added the same way, so ``[ids of text]`` and ``text`` embed alike.
    """

    def __init__(
        self, loaded: LoadedEmbeddingModel, token_budget: int = DEFAULT_TOKEN_BUDGET
    ) -> None:
        if token_budget < loaded.sentence.max_length:
            raise ValueError(f"token_budget {token_budget} cannot hold one longest input")
        self.loaded = loaded
        self.token_budget = token_budget
        self.loaded_at = time.time()  # wall-clock time its model was ready to embed
        self.prefix, self.suffix = _special_tokens(loaded)

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def dimensions(self) -> int:
        return self.loaded.dimensions

    @property
    def max_length(self) -> int:
        """The most tokens one input may run as, its special tokens included."""
        return self.loaded.sentence.max_length

    def embed(
        self,
        inputs: Sequence[EmbedInput],
        truncate: bool = False,
        dimensions: int | None = None,
        turn: Callable[[int], AbstractContextManager[None]] | None = None,
    ) -> Embeddings:
        """Embed every input.

        Args:
            inputs: Texts, or lists of token ids (without special tokens), or a mix.
            truncate: Cut an input that is too long to the model's length (keeping its
                start, as sentence-transformers does) instead of refusing the request.
            dimensions: The vector length wanted. Only the model's own is accepted: a vector
                cut shorter is only meaningful for a model trained for it (Matryoshka), and
                no model infer serves says it is, so, as OpenAI does for such models, any
                other value is refused rather than silently degraded.
            turn: Held around each forward, given the request's token count (a server
                shares the cores between models with it).

        Returns:
            The float32 vectors, in input order, with the token count of each input.

        Raises:
            RequestError: No inputs (``EMPTY_PROMPT``); an input too long without
                ``truncate`` (``CONTEXT_LENGTH_EXCEEDED``, naming it); a token id outside
                the vocabulary or a ``dimensions`` the model does not support
                (``INVALID_VALUE``).
        """
        if dimensions is not None and dimensions != self.dimensions:
            raise RequestError(
                Refusal.INVALID_VALUE,
                f"{self.name} does not support dimensions={dimensions}: its vectors have "
                f"{self.dimensions} and it was not trained to be cut shorter",
            )
        rows = self.encode(inputs, truncate)
        counts = [len(r) for r in rows]
        vectors = torch.empty(len(rows), self.dimensions)
        for batch in self._batches(rows):
            with turn(sum(counts)) if turn is not None else nullcontext():
                vectors[batch] = self._forward([rows[i] for i in batch])
        return Embeddings(vectors, counts)

    def encode(self, inputs: Sequence[EmbedInput], truncate: bool = False) -> list[list[int]]:
        """The token ids each input runs as, special tokens added, checked against the
        model's length (see :meth:`embed` for the arguments and what it raises)."""
        if not inputs:
            raise RequestError(Refusal.EMPTY_PROMPT, "there is no input to embed")
        texts = [(i, t) for i, t in enumerate(inputs) if isinstance(t, str)]
        content: list[list[int]] = [[] for _ in inputs]
        if texts:
            lower = self.loaded.sentence.lowercase
            batch = [t.lower() if lower else t for _, t in texts]
            # verbose=False: a text past the model's length is ours to refuse or cut, without
            # transformers' warning that it is "longer than the specified maximum"
            tokenize = self.loaded.tokenizer
            encoded = tokenize(batch, add_special_tokens=False, verbose=False)["input_ids"]
            for (i, _), ids in zip(texts, encoded, strict=True):
                content[i] = list(ids)
        vocab = self.loaded.config.vocab_size
        for i, item in enumerate(inputs):
            if not isinstance(item, str):
                content[i] = _checked_ids(i, item, vocab)
        room = self.max_length - len(self.prefix) - len(self.suffix)
        for i, ids in enumerate(content):
            if len(ids) > room and not truncate:
                raise RequestError(
                    Refusal.CONTEXT_LENGTH_EXCEEDED,
                    f"input {i} is {len(ids) + self.max_length - room} tokens long, its "
                    f"special tokens included; {self.name} takes at most {self.max_length}: "
                    "shorten it or ask for truncation",
                )
        return [self.prefix + ids[:room] + self.suffix for ids in content]

    def _batches(self, rows: list[list[int]]) -> list[list[int]]:
        """Indices of ``rows``, longest first, in batches of at most ``token_budget`` padded
        tokens (a batch pads to its first, longest, row)."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]), reverse=True)
        batches: list[list[int]] = []
        for i in order:
            if batches and (len(batches[-1]) + 1) * len(rows[batches[-1][0]]) <= self.token_budget:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def _forward(self, rows: list[list[int]]) -> Tensor:
        """Pooled (and normalised) vectors of one batch: ``[len(rows), D]`` float32."""
        longest = max(len(r) for r in rows)
        pad = self.loaded.config.pad_token_id
        ids = torch.full((len(rows), longest), pad, dtype=torch.long)
        for j, row in enumerate(rows):
            ids[j, : len(row)] = torch.tensor(row)
        lengths = torch.tensor([len(r) for r in rows])
        mask = torch.arange(longest) < lengths[:, None]  # [B, T]
        sentence = self.loaded.sentence
        with torch.inference_mode():
            hidden = self.loaded.model(ids, lengths)  # [B, T, C]
            vectors = pool(hidden, mask, sentence.pooling)
            return normalize(vectors) if sentence.normalize else vectors


def _checked_ids(index: int, ids: Sequence[int], vocab: int) -> list[int]:
    out = list(ids)
    bad = next((t for t in out if not isinstance(t, int) or not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(
            Refusal.INVALID_VALUE,
            f"input {index}: token id {bad!r} is outside the vocabulary (0 to {vocab - 1})",
        )
    return out


def _special_tokens(loaded: LoadedEmbeddingModel) -> tuple[list[int], list[int]]:
    """The ids the tokenizer puts before and after a text's own (``[CLS]``, ``[SEP]``)."""
    tokenizer = loaded.tokenizer
    bare = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    for start in range(len(full) - len(bare) + 1):
        if full[start : start + len(bare)] == bare:
            return list(full[:start]), list(full[start + len(bare) :])
    raise ValueError(f"{loaded.name}: cannot find where its tokenizer adds special tokens")
