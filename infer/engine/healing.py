"""Token healing: a prompt that ends inside a word is cut back to where a token starts, and
the completion must begin with the text that was cut.

A tokenizer splits ``"    ans.appe"`` as ``"   ", " ans", ".ap", "pe"``, while the code the
model learnt from had ``".append"`` as one token: after ``"pe"`` it sees a boundary it never
saw, and its next token is a guess. Cut back to ``"   "`` (the prompt then ends where a
token of that text would end), the completion is constrained to start with
``" ans.appe"``: its first tokens are the model's own choice among those that spell it
(``" ans"``, then ``".append"``), and the text that was cut is not shown again.

:class:`Vocabulary` finds those tokens; a request's ``params.healing`` is the cut text and
``Request.heal_left`` what of it the completion has not spelled yet.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from infer.engine.request import Request

_LAST_CHAR = "\U0010ffff"
_CACHED_TEXTS = 256


class Vocabulary:
    """Every token's text (special tokens and partial characters as none), by prefix.

    Args:
        tokenizer: The model's tokenizer.
        size: The model's vocabulary size (ids past the tokenizer's have no text).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, size: int) -> None:
        known = min(size, len(tokenizer))
        texts = tokenizer.batch_decode([[i] for i in range(known)], skip_special_tokens=True)
        self.texts = [t if t and "\ufffd" not in t else "" for t in texts] + [""] * (size - known)
        self._order = sorted((i for i, t in enumerate(self.texts) if t), key=self.texts.__getitem__)
        self._sorted = [self.texts[i] for i in self._order]
        self._by_text: dict[str, list[int]] = {}
        for i, text in enumerate(self.texts):
            if text:
                self._by_text.setdefault(text, []).append(i)
        self._allowed: OrderedDict[str, Tensor] = OrderedDict()

    def allowed(self, left: str) -> Tensor:
        """The ids of the tokens a completion that must start with ``left`` may take next:
        those whose text starts with it, and those whose text is a start of it."""
        ids = self._allowed.get(left)
        if ids is None:
            low = bisect.bisect_left(self._sorted, left)
            high = bisect.bisect_left(self._sorted, left + _LAST_CHAR)
            found = self._order[low:high]
            for end in range(1, len(left)):
                found += self._by_text.get(left[:end], [])
            ids = torch.tensor(sorted(set(found)), dtype=torch.long)
            self._allowed[left] = ids
            if len(self._allowed) > _CACHED_TEXTS:
                self._allowed.popitem(last=False)
        self._allowed.move_to_end(left)
        return ids


def heal_logits(logits: Tensor, requests: Sequence[Request], vocab: Vocabulary) -> Tensor:
    """``logits`` with every token masked that a healing row may not take (the same tensor
    when no row heals; else a new one: the input stays raw, for the reported logprobs)."""
    rows = [i for i, r in enumerate(requests) if r.heal_left]
    if not rows:
        return logits
    out = logits.float().clone()
    for row in rows:
        left = requests[row].heal_left
        assert left  # chosen above
        keep = vocab.allowed(left).to(out.device)
        masked = torch.full_like(out[row], float("-inf"))
        masked[keep] = out[row, keep]
        out[row] = masked
    return out


def advance(req: Request, text: str) -> None:
    """What a healing request has left to spell after a token of ``text``."""
    left = req.heal_left
    if left:
        req.heal_left = left[len(text) :] if left.startswith(text) else ""
