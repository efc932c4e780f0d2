"""The tokenizer a model folder holds (a Hugging Face directory, or one infer saved)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved in ``folder``.

    A ``tokenizer.json`` that its ``tokenizer_config.json`` says is a plain fast tokenizer
    (what transformers writes for the tokenizers infer converts) is read as one directly:
    ``AutoTokenizer`` would first build the model's config class, whose import costs more
    than a second of every server's start. Any other folder goes through ``AutoTokenizer``.
    """
    try:
        declared = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        declared = None
    if declared in _FAST_TOKENIZERS and (folder / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


# What tokenizer_config.json names a tokenizer read from tokenizer.json alone.
_FAST_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")
