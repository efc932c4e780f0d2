"""The one way a prompt becomes token ids: text, token ids, or a conversation.

Text is tokenized with its special tokens as written (none are added: a chat template writes
its own). A conversation is rendered by the model's chat template first. Token ids are taken
as they are, once checked against the vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from infer.engine.request import Refusal, RequestError


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    turns: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text of a conversation through the tokenizer's chat template.

    Args:
        tokenizer: The model's tokenizer.
        turns: ``{"role", "content"}`` messages (and ``tool_calls``, ``tool_call_id``);
            OpenAI's ``developer`` role is the templates' ``system``.
        add_generation_prompt: End with the opening of an assistant turn.
        tools: Function tools in OpenAI's shape, for a template that renders them.
        template_kwargs: Variables for the template (``enable_thinking``...).

    Raises:
        RequestError: No messages, no chat template, or the template refuses them.
    """
    if not turns:
        raise RequestError(Refusal.EMPTY_PROMPT, "messages is empty")
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError(Refusal.NO_CHAT_TEMPLATE, "the model has no chat template")
    turns = [{**t, "role": "system"} if t["role"] == "developer" else t for t in turns]
    try:
        text = tokenizer.apply_chat_template(
            [dict(t) for t in turns],  # type: ignore[misc]  # transformers' narrow annotation
            tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **{k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED},
        )
    except Exception as e:  # noqa: BLE001 - the template refuses the conversation
        raise RequestError(
            Refusal.INVALID_MESSAGES, f"messages: the chat template refused them: {e}"[:300]
        ) from None
    return str(text)


# apply_chat_template's own arguments: not template variables a client may set
_RESERVED = frozenset(
    {"conversation", "tools", "documents", "tokenize", "add_generation_prompt", "chat_template"}
    | {"continue_final_message", "return_dict", "return_tensors", "padding", "truncation"}
    | {"max_length", "return_assistant_tokens_mask", "tokenizer_kwargs"}
)


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase,
    vocab_size: int,
    prompt: str | Sequence[int] | None = None,
    turns: Sequence[Mapping[str, Any]] | None = None,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
    max_bytes: int | None = None,
    allow_empty: bool = False,
) -> list[int]:
    """Token ids of a prompt (text or ids) or of a conversation (``turns``).

    Args:
        tokenizer: The model's tokenizer.
        vocab_size: Ids must lie in ``[0, vocab_size)``.
        prompt: Text, or token ids.
        turns: A conversation, rendered by :func:`render_chat` (instead of ``prompt``).
        tools: With ``turns``: tools for the template to render.
        template_kwargs: With ``turns``: the template's variables.
        add_generation_prompt: With ``turns``: open an assistant turn at the end.
        add_special_tokens: Let the tokenizer add its special tokens to text (BOS).
        max_bytes: Longest prompt text in UTF-8 bytes (ids count as their decoded text).
        allow_empty: Return no ids for empty text instead of refusing it (counting tokens).

    Raises:
        RequestError: Empty, too large, or ids outside the vocabulary.
    """
    if turns is not None:
        text = render_chat(tokenizer, turns, add_generation_prompt, tools, template_kwargs)
    elif isinstance(prompt, str):
        text = prompt
    else:
        ids = list(prompt or [])
        if any(not isinstance(i, int) or not 0 <= i < vocab_size for i in ids):
            raise RequestError(
                Refusal.INVALID_VALUE, f"prompt token ids must be integers in [0, {vocab_size})"
            )
        if not ids and not allow_empty:
            raise RequestError(Refusal.EMPTY_PROMPT, "prompt is empty")
        if max_bytes is not None:
            check_size(str(tokenizer.decode(ids)), max_bytes)
        return ids
    if not text and not allow_empty:
        raise RequestError(Refusal.EMPTY_PROMPT, "prompt is empty")
    if max_bytes is not None:
        check_size(text, max_bytes)
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens) if text else []
    if not ids and not allow_empty:  # text that tokenizes to nothing
        raise RequestError(Refusal.EMPTY_PROMPT, "prompt is empty")
    return [int(i) for i in ids]


def check_size(text: str, max_bytes: int) -> None:
    """Refuse prompt text longer than ``max_bytes`` UTF-8 bytes.

    Raises:
        RequestError: ``PROMPT_TOO_LARGE``.
    """
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise RequestError(
            Refusal.PROMPT_TOO_LARGE, f"the prompt is {size} bytes; the limit is {max_bytes}"
        )
