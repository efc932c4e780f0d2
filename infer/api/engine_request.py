"""The one request every protocol's request becomes, and the only one admission takes.

A protocol package converts its validated body into an :class:`EngineRequest`: what to
complete (text, token ids, or a conversation with its template's variables), the tools it
offers, each choice's sampling parameters and how many choices, and its limits. What
depends on the served model (the token limit that fits, the tools' call format, the
grammar, each choice's seed) is settled at admission.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from infer.api.fim import Fill
from infer.api.tools import ToolChoice
from infer.engine.params import DEFAULT_MAX_TOKENS, SamplingParams
from infer.engine.request import TraceSpec

if TYPE_CHECKING:
    from infer.api.messages import ChatMessage


@dataclass(frozen=True)
class Prompt:
    """One prompt: text or token ids, a conversation and its template's variables, or the
    code around a cursor to fill in the middle (built with the model's FIM tokens)."""

    text: str | list[int] | None = None
    messages: Sequence[ChatMessage] | None = None
    template_kwargs: Mapping[str, Any] | None = None
    fill: Fill | None = None


@dataclass(frozen=True)
class EngineRequest:
    """A request as admission takes it, whatever protocol it came in.

    Args:
        prompts: What to complete; ``n`` choices each, prompt by prompt.
        params: Each choice's sampling parameters, before admission settles its token
            limit, seed and grammar (``params.seed`` is the request's seed).
        max_tokens: The client's token limit; ``None``: ``default_max_tokens``, capped by
            the room the context leaves.
        default_max_tokens: The protocol's default limit.
        model: The model the client named (``None``: the served one).
        n: Choices per prompt.
        tools: The tools a chat prompt offers.
        json_schema: The schema structured output must follow.
        prediction: Text every choice's answer is expected to repeat (drafts).
        trace: Per-token traces (native streams).
        timeout_s: The client's time limit.
        keep_alive: Seconds the model stays loaded once idle after this request (Ollama's
            ``keep_alive``: 0 unloads it then, ``inf`` keeps it; ``None``: its default).
    """

    prompts: Sequence[Prompt]
    params: SamplingParams
    max_tokens: int | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    model: str | None = None
    n: int = 1
    tools: ToolChoice | None = None
    json_schema: dict[str, Any] | None = None
    prediction: str | None = None
    trace: TraceSpec | None = None
    timeout_s: float | None = None
    keep_alive: float | None = None
