"""The body of llama.cpp's ``/infill`` (code completion), as llama.vim and llama.vscode send
it, and the engine request it becomes (:meth:`InfillRequest.engine_request`).

llama.cpp's defaults apply where the client sets nothing (temperature 0.8, top-k 40,
top-p 0.95, min-p 0.05). Its other completion options are accepted at the values that
describe what this server does (``cache_prompt``: the prefix cache is always on and exact;
``id_slot``, ``t_max_prompt_ms``, ``n_keep``: no slots, no prompt budget, no context shift).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictStr, field_validator, model_validator

from infer.api.engine_request import EngineRequest, Prompt
from infer.api.fields import Body, without_nulls
from infer.api.fim import Chunk, Fill, FimRequest, Layout, Limits, editor_stops
from infer.engine.params import (
    MAX_STOP_STRINGS,
    SEED_MAX,
    Bias,
    MinP,
    Penalty,
    RepetitionPenalty,
    SamplingParams,
    Temperature,
    TokenId,
    TopK,
    TopP,
)

MAX_COMPLETIONS = 8  # n_cmpl
# How much of each piece a prompt keeps, as llama.cpp's server with its default batch of
# 2048 keeps: 3/4 of it for the prefix, the rest for the suffix (the extra files fill the
# context that remains).
PREFIX_TOKENS, SUFFIX_TOKENS = 1536, 510
# llama.cpp's sampler names; the ones this server applies are the first four
SAMPLERS = ("top_k", "top_p", "min_p", "temperature", "penalties", "infill", "typ_p", "typical_p")
SamplerName = Literal[
    "top_k", "top_p", "min_p", "temperature", "penalties", "infill", "typ_p", "typical_p"
]
SamplerNames = Annotated[list[SamplerName], Field(max_length=16)]


class ExtraChunk(Body):
    """`input_extra` item: another file's text (llama.vim adds a `time`, ignored)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    text: StrictStr
    filename: StrictStr = "tmp"


class InfillRequest(Body):
    """`POST /infill`: llama.cpp's code completion."""

    input_prefix: StrictStr
    input_suffix: StrictStr
    input_extra: Annotated[list[ExtraChunk], Field(max_length=256)] = Field(default_factory=list)
    prompt: StrictStr = ""
    model: str | None = None
    n_predict: Annotated[int, Field(ge=-1)] | None = None
    max_tokens: Annotated[int, Field(ge=-1)] | None = None
    n_indent: Annotated[int, Field(ge=0)] = 0
    t_max_predict_ms: int = -1
    t_max_prompt_ms: int | None = None  # accepted; llama.cpp has no prompt budget either
    n_cmpl: Annotated[int, Field(ge=1, le=MAX_COMPLETIONS)] = 1
    stream: bool = False
    response_fields: Annotated[list[str], Field(max_length=64)] = Field(default_factory=list)
    return_tokens: bool = False
    samplers: SamplerNames | None = None
    temperature: Temperature = 0.8
    top_k: TopK = 40
    top_p: TopP = 0.95
    min_p: MinP = 0.05
    repeat_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Annotated[int, Field(ge=-1, le=SEED_MAX)] = -1  # -1: a random seed
    stop: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] = Field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[TokenId, Bias] | list[tuple[TokenId, Bias | Literal[False]]] | None = None
    # the values that describe this server (no slots, the prefix cache always on)
    cache_prompt: bool = True
    id_slot: int = -1
    n_keep: int = 0
    n_probs: Literal[0] = 0
    timings_per_token: bool = False
    stop_at_suffix: bool = True  # infer's: a fill that repeats the suffix's first line ends

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return without_nulls(data, frozenset(cls.model_fields))

    @field_validator("stop")
    @classmethod
    def _no_empty_stops(cls, stop: list[str]) -> list[str]:
        return [s for s in stop if s]  # llama.cpp skips them

    def limit(self) -> int | None:
        """The client's token limit (``n_predict`` wins); ``None``: up to the context."""
        n = self.n_predict if self.n_predict is not None else self.max_tokens
        return None if n is None or n < 0 else n

    def sampling(self) -> dict[str, Any]:
        """Temperature, top-k, top-p and min-p as the sampler chain applies them: a
        sampler left out of ``samplers`` does nothing (temperature 0 is greedy still)."""
        chain = set(self.samplers) if self.samplers is not None else set(SAMPLERS)
        temperature = self.temperature if "temperature" in chain or self.temperature <= 0 else 1.0
        return {
            "temperature": max(temperature, 0.0),
            "top_k": self.top_k if "top_k" in chain else 0,
            "top_p": self.top_p if "top_p" in chain else 1.0,
            "min_p": self.min_p if "min_p" in chain else 0.0,
        }

    def engine_request(self, layout: Layout) -> EngineRequest:
        """What the completion asks of the engine (``n_cmpl`` choices of one fill)."""
        extra = tuple(Chunk(c.text, c.filename) for c in self.input_extra)
        code = FimRequest(self.input_prefix, self.input_suffix, self.prompt, extra)
        fill = Fill(code, Limits(PREFIX_TOKENS, SUFFIX_TOKENS), layout)
        budget = self.t_max_predict_ms / 1000 if self.t_max_predict_ms > 0 else None
        head = (self.input_prefix + self.prompt).rsplit("\n", 1)[-1]
        editor = editor_stops(
            self.input_suffix, self.n_indent, budget, self.stop_at_suffix, line_head=head
        )
        params = SamplingParams(
            repetition_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=self.stop,
            seed=self.seed if self.seed >= 0 else None,
            ignore_eos=self.ignore_eos,
            logit_bias=self.bias(),
            editor=editor,
            **self.sampling(),
        )
        return EngineRequest(
            [Prompt(fill=fill)],
            params,
            max_tokens=self.limit(),
            default_max_tokens=2**31,  # -1: until the fill ends or the context is full
            model=self.model or None,
            n=self.n_cmpl,
        )

    def bias(self) -> dict[int, float]:
        """``logit_bias`` in either of llama.cpp's forms (``false`` bans a token)."""
        if self.logit_bias is None:
            return {}
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        return {token: -100.0 if value is False else float(value) for token, value in pairs}
