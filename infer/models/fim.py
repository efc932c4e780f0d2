"""A model's fill-in-the-middle (FIM) tokens, read from the model itself.

A GGUF file may name them in its metadata (``tokenizer.ggml.fim_pre_token_id`` and the
``suf``, ``mid``, ``pad``, ``rep`` and ``sep`` keys); otherwise they are the tokenizer's
special tokens spelled as the code models that were trained for FIM spell them (the same
spellings llama.cpp looks for). Nothing here depends on the model's name: a model whose
vocabulary has no prefix, suffix and middle tokens does not fill in the middle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

# role -> spellings, most common first (Qwen2.5-Coder, StarCoder, DeepSeek-Coder, CodeGemma,
# CodeLlama, GLM, Granite)
SPELLINGS: dict[str, tuple[str, ...]] = {
    "pre": (
        "<|fim_prefix|>",
        "<fim_prefix>",
        "<fim-prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
    ),
    "suf": (
        "<|fim_suffix|>",
        "<fim_suffix>",
        "<fim-suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
    ),
    "mid": (
        "<|fim_middle|>",
        "<fim_middle>",
        "<fim-middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
    ),
    "pad": ("<|fim_pad|>", "<fim_pad>", "<fim-pad>", "<PAD>"),
    "rep": ("<|repo_name|>", "<|fim_repo|>", "<reponame>", "<fim-repo>", "<REPO>"),
    "sep": ("<|file_sep|>", "<|fim_sep|>", "<file_sep>", "<fim-sep>", "<filename>"),
}
# Tokens that end a fill besides EOS, where the vocabulary has them as special tokens (a FIM
# middle ends with <|endoftext|> in Qwen2.5-Coder's training, not with its chat EOS).
END_SPELLINGS = (
    "<|endoftext|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<EOT>",
    "▁<EOT>",
    "<|end|>",
    "<end_of_turn>",
    "<｜end▁of▁sentence｜>",
)
GGUF_KEYS = {role: f"tokenizer.ggml.fim_{role}_token_id" for role in SPELLINGS}


@dataclass(frozen=True)
class FimTokens:
    """The token ids a FIM prompt is made of, and those that end a fill.

    Attributes:
        prefix, suffix, middle: The three markers of a file-level FIM prompt.
        pad, repo, sep: Qwen2.5-Coder's ``<|fim_pad|>``, ``<|repo_name|>`` and
            ``<|file_sep|>`` (repo-level prompts need ``repo`` and ``sep``), or ``None``.
        end: Every token that ends a fill (the model's EOS comes on top).
    """

    prefix: int
    suffix: int
    middle: int
    pad: int | None = None
    repo: int | None = None
    sep: int | None = None
    end: frozenset[int] = frozenset()

    @property
    def repo_level(self) -> bool:
        """Whether the model takes other files before the one being completed."""
        return self.repo is not None and self.sep is not None


def find_fim_tokens(
    tokenizer: PreTrainedTokenizerBase, metadata: Mapping[str, object] | None = None
) -> FimTokens | None:
    """The model's FIM tokens: from GGUF metadata where it names them, else its special
    tokens; ``None`` when it has no prefix, suffix and middle tokens.

    Args:
        tokenizer: The model's tokenizer.
        metadata: A GGUF file's ``tokenizer.ggml.fim_*_token_id`` values (others ignored).
    """
    special = _special_tokens(tokenizer)
    ids: dict[str, int | None] = {}
    for role, spellings in SPELLINGS.items():
        named = (metadata or {}).get(GGUF_KEYS[role])
        if isinstance(named, int) and 0 <= named < len(tokenizer):
            ids[role] = named
        else:
            ids[role] = next((special[s] for s in spellings if s in special), None)
    prefix, suffix, middle = ids["pre"], ids["suf"], ids["mid"]
    if prefix is None or suffix is None or middle is None:
        return None
    end = {special[s] for s in END_SPELLINGS if s in special}
    end |= {i for i in (ids["pad"], ids["rep"], ids["sep"]) if i is not None}
    return FimTokens(prefix, suffix, middle, ids["pad"], ids["rep"], ids["sep"], frozenset(end))


def _special_tokens(tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Spelling -> id of every added (special) token of the vocabulary."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return {str(token): int(i) for i, token in decoder.items()}
