"""A model that says what a test scripts, for testing what comes after the logits (reasoning
and tool calls read back, the grammar, the HTTP formats) on a template that thinks.

:class:`ScriptedModel` runs a real (tiny, random) model's forward pass and then makes the
script's next token the only likely one; :data:`THINKING_TEMPLATE` is Qwen3's shape.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import Tensor, nn

from infer.models.context import PagedContext
from support.tiny import ours_from, tiny_reference

# Qwen3's shape: tools in a system turn, a reply that thinks unless enable_thinking is false
# (then the prompt closes an empty block).
THINKING_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    '{% endfor %}\n</tools>\nCall a function as <tool_call>\n{"name": <function-name>, '
    '"arguments": <args-json-object>}\n</tool_call><|im_end|>\n{%- endif %}'
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- if enable_thinking is defined "
    "and enable_thinking is false %}<think>\n\n</think>\n\n{%- endif %}{%- endif %}"
)

IM_END = 151645  # Qwen's <|im_end|>: the scripted reply's EOS


class ScriptedModel(nn.Module):
    """A model whose reply is ``script`` (token ids), then EOS."""

    def __init__(self, model: nn.Module, eos: int) -> None:
        super().__init__()
        self.inner, self.config, self.eos = model, model.config, eos
        self.script: list[int] = []
        self._base = 0  # position of the reply's first token

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype  # type: ignore[no-any-return]

    @property
    def device(self) -> torch.device:
        return self.inner.device  # type: ignore[no-any-return]

    def forward_paged(
        self, input_ids: Tensor, positions: Tensor, ctx: PagedContext, logits_index: Tensor
    ) -> Any:
        out = self.inner.forward_paged(input_ids, positions, ctx, logits_index)
        for row, index in enumerate(logits_index.tolist()):
            position = int(positions[index])
            if ctx.spans:  # a prompt's last token: the reply starts after it
                self._base = position + 1
            k = position + 1 - self._base
            token = self.script[k] if k < len(self.script) else self.eos
            out.logits[row] = -1e4
            out.logits[row, token] = 0.0
        return out


def thinking_qwen3(tokenizer: Any) -> tuple[ScriptedModel, Any]:
    """A tiny random Qwen3 that says what a test scripts, and a copy of ``tokenizer`` (Qwen's
    vocabulary) with :data:`THINKING_TEMPLATE`."""
    thinking = copy.deepcopy(tokenizer)
    thinking.chat_template = THINKING_TEMPLATE
    ref = tiny_reference(
        "qwen3",
        perturb=False,
        vocab_size=len(thinking),
        intermediate_size=128,
        max_position_embeddings=32768,
    )
    return ScriptedModel(ours_from(ref), IM_END), thinking
