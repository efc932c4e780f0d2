"""The bodies of Ollama's routes, and the engine requests ``/api/generate`` and ``/api/chat``
become (:meth:`OllamaGenerateRequest.engine_request`, :meth:`OllamaChatRequest.engine_request`).

Ollama reads its bodies with Go's JSON decoder, and so does a client written against it
expect: a field it does not know is ignored (a newer or older client's), ``null`` is a
field's default, and an option it does not know (``num_gpu``, ``mirostat``...) is ignored.
The values this server honours are checked with the engine's ranges; a value it cannot honour
is refused with the reason (``images``, a ``template`` of one's own, ``num_ctx`` past the
server's context).
"""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import Callable
from typing import Annotated, Any, Literal

import jsonschema
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from infer.api.engine_request import EngineRequest, Prompt
from infer.api.errors import APIError, ErrorCode
from infer.api.fim import Chunk, Fill, FimRequest, editor_stops
from infer.api.messages import (
    MAX_TOOLS,
    CalledFunction,
    ChatMessage,
    FunctionDefinition,
    FunctionName,
    check_tools,
)
from infer.api.messages import ToolCall as HistoryCall
from infer.api.messages import tool_choice as offered_tools
from infer.api.ollama.card import ModelCard
from infer.api.tools import ToolChoice
from infer.catalog import parse_keep_alive
from infer.engine.params import (
    SEED_MAX,
    EditorStops,
    MinP,
    Penalty,
    RepetitionPenalty,
    SamplingParams,
    Temperature,
    TopP,
)

UNLIMITED = 2**31  # num_predict -1: until the reply ends or the context is full
MAX_TOP_K = 2**31 - 1  # more than any vocabulary: off
MAX_STOPS = 32  # Continue sends nine for Qwen2.5-Coder, and the model's own
# Continue's end of the other files of a repository before the prefix (its spelling)
CONTINUE_REPO_END = "<|system_separator_istruction_repository_level|>"
FILE_SEP = "<|file_sep|>"


def _duration(value: float | str) -> float | str:
    """A Go duration ("5m", "1h30m", "-1s", "0": a text needs its unit) or a number of
    seconds, as Ollama's keep_alive takes one."""
    digits = value.strip().lstrip("+-") if isinstance(value, str) else ""
    if digits.replace(".", "", 1).isdigit() and digits != "0":
        raise ValueError(f"{value!r} is not a duration (such as 5m, 1h or -1s)")
    try:
        parse_keep_alive(value)
    except ValueError:
        raise ValueError(f"{value!r} is not a duration (such as 5m, 1h or -1s)") from None
    return value


Think = bool | Literal["high", "medium", "low", "max"]
Format = Literal["", "json"] | dict[str, Any]
KeepAlive = Annotated[float | str, AfterValidator(_duration)]
Stops = Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOPS)]


class OllamaBody(BaseModel):
    """A body or a part of one, read as Ollama reads it: unknown fields ignored, ``null``
    for the default."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class KeptAlive(OllamaBody):
    """A body that names a model, and how long it stays loaded once idle: a Go duration
    (``5m``), or seconds; 0 unloads it once answered, a negative one keeps it for ever."""

    model: str
    keep_alive: KeepAlive | None = None

    def keep_alive_s(self) -> float | None:
        """``keep_alive`` in seconds (``inf``: for ever; ``None``: the model's default)."""
        return None if self.keep_alive is None else parse_keep_alive(self.keep_alive)


class OllamaOptions(OllamaBody):
    """`options`: the sampling and length options this server honours, Ollama's defaults
    where the client sets none (temperature 0.8, top-k 40, top-p 0.9)."""

    num_ctx: Annotated[int, Field(ge=1)] | None = None
    num_predict: int = -1
    temperature: Temperature = 0.8
    top_k: int = 40
    top_p: TopP = 0.9
    min_p: MinP = 0.0
    repeat_penalty: RepetitionPenalty = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    seed: Annotated[int, Field(le=SEED_MAX)] = -1  # negative: a random seed
    stop: Annotated[str, Field(min_length=1)] | Stops = Field(default_factory=list)

    def engine_request(
        self,
        prompt: Prompt,
        card: ModelCard,
        json_schema: dict[str, Any] | None,
        tools: ToolChoice | None = None,
        editor: EditorStops | None = None,
    ) -> EngineRequest:
        """One reply to ``prompt`` sampled as these options say.

        Raises:
            APIError: ``num_ctx`` is more than the model's context here.
        """
        if self.num_ctx is not None and self.num_ctx > card.context_length:
            raise APIError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"options.num_ctx: {self.num_ctx} tokens is more than the context of "
                f"{card.name!r} here, {card.context_length} tokens; it is set when the server "
                "starts (--max-seq-len, or the model's max_seq_len), not per request",
            )
        params = SamplingParams(
            temperature=self.temperature,
            top_k=min(max(self.top_k, 0), MAX_TOP_K),  # 0 or less: off, as in llama.cpp
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repeat_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop),
            seed=self.seed if self.seed >= 0 else None,
            editor=editor,
        )
        return EngineRequest(
            [prompt],
            params,
            max_tokens=self.num_predict if self.num_predict > 0 else None,
            default_max_tokens=UNLIMITED,
            tools=tools,
            json_schema=json_schema,
        )


class ReplyFields(KeptAlive):
    """What ``/api/generate`` and ``/api/chat`` share."""

    stream: bool = True
    format: Format | None = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)
    think: Think | None = None
    truncate: bool | None = None  # accepted: a prompt too long is refused, never cut
    shift: bool | None = None  # accepted: the context never shifts
    logprobs: bool = False  # refused when true
    top_logprobs: Annotated[int, Field(ge=0, le=20)] = 0

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, logprobs: bool) -> bool:
        if logprobs:
            raise ValueError(
                "logprobs are not supported on Ollama's routes here: use /v1/completions or "
                "/v1/chat/completions"
            )
        return logprobs

    @field_validator("format")
    @classmethod
    def _schema(cls, value: Format | None) -> Format | None:
        if isinstance(value, dict):
            try:
                jsonschema.validators.validator_for(value).check_schema(value)
            except jsonschema.SchemaError as e:
                raise ValueError(f"not a JSON schema: {e.message}") from None
        return value

    def json_schema(self) -> dict[str, Any] | None:
        """The schema the reply must follow: ``"json"`` is any JSON object."""
        if isinstance(self.format, dict):
            return self.format
        return {"type": "object"} if self.format == "json" else None

    @abstractmethod
    def loads_only(self) -> bool:
        """Whether there is nothing to generate (Ollama then only loads the model)."""

    def engine_request(self, card: ModelCard) -> EngineRequest:
        """The one reply the request asks for, of the model ``card`` describes, kept loaded
        as ``keep_alive`` says."""
        request = self.reply(card)
        return dataclasses.replace(request, model=card.name, keep_alive=self.keep_alive_s())

    @abstractmethod
    def reply(self, card: ModelCard) -> EngineRequest:
        """The reply, as the route's body asks for it."""

    def unloads(self) -> bool:
        """Whether ``keep_alive`` asks to unload the model now (0)."""
        return self.keep_alive is not None and parse_keep_alive(self.keep_alive) == 0

    def template_kwargs(self, card: ModelCard) -> dict[str, Any] | None:
        """The template's thinking switch: a model that reasons thinks unless ``think`` is
        false (as in Ollama).

        Raises:
            APIError: ``think`` asks a model that does not reason to.
        """
        think = self.think
        if not card.thinking:
            if think not in (None, False):
                raise APIError(
                    ErrorCode.INVALID_REQUEST, f"{self.model!r} does not support thinking"
                )
            return None
        kwargs: dict[str, Any] = {"enable_thinking": think is not False}
        if isinstance(think, str):
            kwargs["reasoning_effort"] = "high" if think == "max" else think
        return kwargs


class OllamaGenerateRequest(ReplyFields):
    """`POST /api/generate`: a completion of `prompt` (through the chat template unless
    `raw`), or, with a `suffix`, the code between `prompt` and `suffix`."""

    prompt: str = ""
    suffix: str = ""
    system: str = ""
    raw: bool = False
    template: str = ""  # refused when set, as `context` and `images` are
    context: list[int] = Field(default_factory=list)
    images: list[str] = Field(default_factory=list)

    @field_validator("template", "context", "images", mode="before")
    @classmethod
    def _refused(cls, value: Any, info: Any) -> Any:
        if value:
            raise ValueError(REFUSED[info.field_name])
        return value

    @model_validator(mode="after")
    def _raw(self) -> OllamaGenerateRequest:
        if self.raw and self.system:
            raise ValueError("raw mode does not support template, system, or context")
        return self

    def loads_only(self) -> bool:
        return not self.prompt

    def reply(self, card: ModelCard) -> EngineRequest:
        """The completion: ``raw``, the prompt as it is (a ``suffix`` is then ignored, as
        Ollama ignores it); with a ``suffix``, a fill built by the FIM prompt builder;
        else the prompt (and ``system``) through the chat template, as a user's message."""
        kwargs, schema, options = self.template_kwargs(card), self.json_schema(), self.options
        if self.raw or (not self.suffix and card.chat_template is None):
            return options.engine_request(Prompt(self.prompt), card, schema)
        if self.suffix:
            fill = Fill(fim_request(self.prompt, self.suffix), layout=card.layout)
            stops = editor_stops(self.suffix, line_head=self.prompt.rsplit("\n", 1)[-1])
            return options.engine_request(Prompt(fill=fill), card, schema, editor=stops)
        turns = [ChatMessage(role="system", content=self.system)] if self.system else []
        turns.append(ChatMessage(role="user", content=self.prompt))
        return options.engine_request(Prompt(messages=turns, template_kwargs=kwargs), card, schema)


REFUSED = {
    "template": "template is not supported: the model's own chat template renders prompts",
    "context": "context is not supported (Ollama deprecates it): send the conversation to "
    "/api/chat",
    "images": "images are not supported: the models served here read text only",
}


def fim_request(prompt: str, suffix: str) -> FimRequest:
    """The code around the cursor. Continue sends a repository's other files before the
    prefix, in Qwen2.5-Coder's repo-level format and ended by a separator of its own: they
    become the fill's other files."""
    head, found, prefix = prompt.partition(CONTINUE_REPO_END)
    if not found:
        return FimRequest(prompt, suffix)
    files = head.split(FILE_SEP)[1:-1]  # after the repository's name; before the current file
    chunks = []
    for file in files:
        name, _, text = file.partition("\n")
        chunks.append(Chunk(text.removesuffix("\n"), name))
    return FimRequest(prefix, suffix, extra=tuple(chunks))


class OllamaCalledTool(OllamaBody):
    name: FunctionName
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None


class OllamaToolCall(OllamaBody):
    """A call in an assistant message of the history (its arguments an object)."""

    id: str | None = None
    function: OllamaCalledTool


class OllamaMessage(OllamaBody):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    thinking: str | None = None  # an earlier reply's thinking: not given to the model again
    images: list[str] = Field(default_factory=list)  # refused when set
    tool_calls: list[OllamaToolCall] = Field(default_factory=list)
    tool_name: str | None = None
    tool_call_id: str | None = None

    @field_validator("role", mode="before")
    @classmethod
    def _lower(cls, role: Any) -> Any:
        return role.lower() if isinstance(role, str) else role  # as Ollama reads it

    @field_validator("images", mode="before")
    @classmethod
    def _no_images(cls, images: Any) -> Any:
        if images:
            raise ValueError(REFUSED["images"])
        return images


class OllamaTool(OllamaBody):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class OllamaChatRequest(ReplyFields):
    """`POST /api/chat`: the assistant's next message, with its tool calls and thinking."""

    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: Annotated[list[OllamaTool], Field(max_length=MAX_TOOLS)] = Field(default_factory=list)
    _turns: list[ChatMessage] = PrivateAttr(default_factory=list)

    @model_validator(mode="after")
    def _conversation(self) -> OllamaChatRequest:
        names = [t.function.name for t in self.tools]
        check_tools(names, None, None, "format" if self.json_schema() else None)
        self._turns = chat_messages(self.messages)
        return self

    def loads_only(self) -> bool:
        return not self.messages

    def reply(self, card: ModelCard) -> EngineRequest:
        """The reply to the conversation, offered its tools (the model decides)."""
        kwargs = self.template_kwargs(card)
        tools = None
        if self.tools:
            tools = offered_tools([t.function.tool() for t in self.tools], None, None, True)
        prompt = Prompt(messages=self._turns, template_kwargs=kwargs)
        return self.options.engine_request(prompt, card, self.json_schema(), tools)


def chat_messages(messages: list[OllamaMessage]) -> list[ChatMessage]:
    """The conversation as the chat template takes it. Ollama's calls and results need no
    ids: a call gets one, and a result answers the first call not answered yet (of its
    ``tool_name``, when it names one)."""
    turns: list[ChatMessage] = []
    waiting: list[HistoryCall] = []  # the calls no result has answered yet
    for i, m in enumerate(messages):
        if m.role == "assistant" and m.tool_calls:
            calls = [
                HistoryCall(
                    id=c.id or f"call_{i}_{k}",
                    function=CalledFunction(name=c.function.name, arguments=c.function.arguments),
                )
                for k, c in enumerate(m.tool_calls)
            ]
            waiting = list(calls)
            turns.append(ChatMessage(role="assistant", content=m.content, tool_calls=calls))
        elif m.role == "tool":
            call = _answered(waiting, m)
            answered = call.id if call is not None else m.tool_call_id or f"call_{i}"
            turns.append(
                ChatMessage(role="tool", content=m.content, tool_call_id=answered, name=m.tool_name)
            )
        else:
            turns.append(ChatMessage(role=m.role, content=m.content))
    return turns


def _answered(waiting: list[HistoryCall], result: OllamaMessage) -> HistoryCall | None:
    """The call a tool's result answers (taken off ``waiting``), if any."""
    for call in waiting:
        if result.tool_call_id in (None, call.id) and result.tool_name in (
            None,
            call.function.name,
        ):
            waiting.remove(call)
            return call
    return None


class OllamaShowRequest(OllamaBody):
    """`POST /api/show`: `model` (or `name`, as Continue sends it)."""

    model: str = ""
    name: str = ""
    verbose: bool = False

    @model_validator(mode="after")
    def _named(self) -> OllamaShowRequest:
        if not (self.model or self.name):
            raise ValueError("model is required")
        return self

    def model_name(self) -> str:
        return self.model or self.name


class OllamaEmbedRequest(KeptAlive):
    """`POST /api/embed`: vectors of `input` (none: the model is only loaded); an input
    longer than the model takes is cut to it unless `truncate` is false."""

    input: str | list[str] = ""
    truncate: bool = True
    dimensions: Annotated[int, Field(ge=1)] | None = None
    options: OllamaOptions = Field(default_factory=OllamaOptions)  # accepted, not used

    def inputs(self) -> list[str]:
        if isinstance(self.input, str):
            return [self.input] if self.input else []
        return self.input


class OllamaEmbeddingsRequest(KeptAlive):
    """`POST /api/embeddings` (Ollama's older route): the vector of `prompt` (none: the
    model is only loaded)."""

    prompt: str = ""
    options: OllamaOptions = Field(default_factory=OllamaOptions)  # accepted, not used

    def inputs(self) -> list[str]:
        return [self.prompt] if self.prompt else []


Embeddable = OllamaEmbedRequest | OllamaEmbeddingsRequest


def model_names(name: str) -> tuple[str, ...]:
    """The names a client's ``model`` may mean: as given, without Ollama's default tag
    (``name:latest``), and a tag as the served name's last part (Continue asks for
    ``qwen2.5-coder:0.5b`` by the served ``qwen2.5-coder-0.5b``)."""
    return (name, name.removesuffix(":latest"), name.replace(":", "-"))


def served_name(name: str, serves: Callable[[str], bool]) -> str | None:
    """The served name a client's ``model`` means (see :func:`model_names`); ``None``: no
    model served here."""
    return next((n for n in model_names(name) if serves(n)), None)
