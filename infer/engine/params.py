"""How one request picks its tokens and when it stops: :class:`SamplingParams`.

Every range is stated once, in the field types below. The HTTP request models declare their
fields with the same types, so a value is checked by the same rule (and the same pydantic
message) whether it comes from a request body, the command line or a library caller. It is
checked once: by the request's model at the HTTP edge, or by :meth:`SamplingParams.checked`
for the command line and library callers; building the dataclass checks nothing.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

from pydantic import ConfigDict, Field, TypeAdapter

DEFAULT_MAX_TOKENS = 256
MAX_STOP_STRINGS = 8
MAX_LOGPROBS = 20
MAX_TEMPERATURE = 100.0
MAX_PENALTY = 2.0  # presence and frequency penalties, as OpenAI bounds them
MAX_LOGIT_BIAS = 100.0
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed accepts

MaxTokens = Annotated[int, Field(ge=1)]
MaxNewTokens = Annotated[int, Field(ge=0)]  # 0: only score the prompt (prompt_logprobs)
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY)]
TokenId = Annotated[int, Field(ge=0)]
Bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
StopStrings = Annotated[
    list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)
]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]

if TYPE_CHECKING:
    from infer.engine.grammar import Grammar

    GrammarOrNone = Grammar | None
else:  # compiled by the server (and checked there); importing xgrammar here costs seconds
    GrammarOrNone = Any


@dataclass(frozen=True)
class EditorStops:
    """How a code completion ends where an editor wants it to (llama.cpp's ``/infill``
    options); the engine honours them like stop strings.

    Args:
        indent: A generated line indented by fewer columns (spaces or tabs) than this ends
            the completion before that line; 0: off. The first line is never cut.
        time_budget_s: The completion ends at the first token that ends a line this long
            after its first token (finish ``length``); ``None``: no limit.
        suffix_line: The first non-blank line of the text after the cursor, stripped; a
            generated line equal to it ends the completion before that line ("" : off).
        keep_newline: A completion cut before a line keeps that line's newline (the text
            after the cursor starts a line of its own), else it ends before it.
        line_rest: The rest of the cursor's line: a first line of the completion that ends
            with it is cut before it, and the completion ends there ("" : off).
    """

    indent: Annotated[int, Field(ge=0)] = 0
    time_budget_s: Annotated[float, Field(gt=0.0)] | None = None
    suffix_line: str = ""
    keep_newline: bool = False
    line_rest: str = ""

    @property
    def by_line(self) -> bool:
        """Whether a generated line may end the completion (held back until decided)."""
        return self.indent > 0 or bool(self.suffix_line) or bool(self.line_rest)


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    Args:
        max_new_tokens: Most tokens to generate; 0: the prompt is only read into the KV
            cache (where the prefix cache keeps it for later prompts) and scored when
            ``prompt_logprobs`` asks, and nothing is generated.
        temperature: Softmax temperature in ``[0, 100]``; 0 means greedy (argmax).
        top_p: Nucleus sampling: keep the smallest set of tokens whose probability
            mass reaches ``top_p``; in ``(0, 1]``, 1 disables it.
        top_k: Keep only the ``top_k`` most likely tokens; 0 disables it.
        repetition_penalty: Hugging Face style penalty (> 0) on every token already
            seen in the prompt or the output; 1 disables it.
        stop: Up to 8 non-empty strings; generation ends before the first of them (one that
            is a special token's text, such as ``<|im_end|>``, ends on that token).
        seed: Seed of this request's own generator; ``None`` uses the global RNG.
        ignore_eos: Keep generating past the end-of-sequence token.
        logprobs: How many top log-probabilities to report per token (0 to 20).
        presence_penalty: OpenAI's: subtracted once from the logit of every token already
            generated; in ``[-2, 2]``.
        frequency_penalty: OpenAI's: subtracted from a token's logit once per time it was
            generated; in ``[-2, 2]``.
        logit_bias: Token id -> value in ``[-100, 100]`` added to its logit (-100 bans it,
            +100 all but forces it).
        grammar: Constrains the output to a grammar (structured output); ``None``: free.
        prompt_logprobs: Score every prompt token (its log-probability given the tokens
            before it, its rank, and the top ``prompt_logprobs`` alternatives, 0 to 20);
            ``None``: the prompt is not scored.
        stop_token_ids: Tokens that end generation as EOS does (a fill's end tokens).
        editor: A code completion's line and time stops (:class:`EditorStops`).
        min_p: Keep only the tokens at least ``min_p`` times as likely as the likeliest
            (in ``[0, 1]``; 0 disables it).
        healing: Text the prompt was cut back by (token healing): the completion starts
            with it, and it is not part of the output (:mod:`infer.engine.healing`).

    Build it with :meth:`checked` from values nothing has checked yet.
    """

    __pydantic_config__: ClassVar[ConfigDict] = ConfigDict(allow_inf_nan=False, extra="forbid")

    max_new_tokens: MaxNewTokens = DEFAULT_MAX_TOKENS
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    repetition_penalty: RepetitionPenalty = 1.0
    stop: StopStrings = field(default_factory=list)
    seed: Seed | None = None
    ignore_eos: bool = False
    logprobs: Logprobs = 0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: dict[TokenId, Bias] = field(default_factory=dict)
    grammar: GrammarOrNone = None
    prompt_logprobs: Logprobs | None = None
    stop_token_ids: frozenset[TokenId] = frozenset()
    editor: EditorStops | None = None
    min_p: MinP = 0.0
    healing: str = ""

    @classmethod
    def checked(cls, **values: Any) -> SamplingParams:
        """Parameters from values nothing has checked yet (the command line, a library
        caller), each checked against its range.

        Raises:
            ValueError: A value is out of range; the message names its field.
        """
        params = _adapter().validate_python(values)
        if params.max_new_tokens == 0 and params.prompt_logprobs is None:
            raise ValueError("max_new_tokens: 0 is only allowed with prompt_logprobs")
        return params

    @property
    def greedy(self) -> bool:
        """Whether this request takes the argmax instead of sampling."""
        return self.temperature == 0.0


@functools.cache
def _adapter() -> TypeAdapter[SamplingParams]:
    return TypeAdapter(SamplingParams)
