"""OpenAI's completion and chat-completion objects, built from a request's outputs; their
types are what ``/openapi.json`` documents.

A streamed response is ``data: {chunk}`` events: per output of choice ``index``, a chunk
with its new text (and log-probabilities), a last chunk with its ``finish_reason``, a usage
chunk when asked, then ``data: [DONE]``; a failure after the stream started is an error
chunk before ``[DONE]``. A non-streamed response is one body built from each choice's outputs.
Our ``eos`` finish reason is OpenAI's ``stop``; a timeout ends a choice with ``length``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple, NotRequired, cast

from pydantic import Field
from typing_extensions import TypedDict

from infer.api.chat import ReplyParser
from infer.api.usage import Usage
from infer.engine.request import Failure, FinishReason, Outcome, PromptLogprob, StepOutput


class PromptTokenLogprob(TypedDict):
    """One token of vLLM's `prompt_logprobs` entries (keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]
SCORED_PROMPT = Field(
    description="with prompt_logprobs: null for the first prompt token, then each's"
)


class ChoiceEnd(TypedDict):
    """What every choice of a body ends with."""

    logprobs: dict[str, Any] | None
    finish_reason: str | None
    prompt_logprobs: NotRequired[Annotated[PromptLogprobs | None, SCORED_PROMPT]]


class CompletionChoice(ChoiceEnd):
    index: int
    text: str


class Answer(TypedDict):
    """What a body of either route carries beside its choices."""

    id: str
    created: int
    model: str
    usage: Usage


class CompletionResponse(Answer):
    """`POST /v1/completions` with `stream: false`."""

    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class OutputFunction(TypedDict):
    name: str
    arguments: str  # a JSON text that fits the tool's schema


class OutputCall(TypedDict):
    id: str
    type: Literal["function"]
    function: OutputFunction


class AssistantMessage(TypedDict):
    role: Literal["assistant"]
    content: str | None  # null when the reply is only tool calls
    tool_calls: NotRequired[list[OutputCall]]
    reasoning_content: NotRequired[str]  # a thinking template's reasoning block
    reasoning: NotRequired[str]  # the same text, under vLLM's newer name


class ChatChoice(ChoiceEnd):
    index: int
    message: AssistantMessage


class ChatCompletionResponse(Answer):
    """`POST /v1/chat/completions` with `stream: false`."""

    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class ModelCard(TypedDict):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int | None  # None until the model is loaded (its context decides it)
    status: str  # loaded, unloaded, loading, unloading or failed


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelCard]


class ServedModel(NamedTuple):
    """What `/v1/models` says of one served model."""

    names: Sequence[str]  # its name, then its aliases
    max_model_len: int | None
    status: str


def model_list(models: Sequence[ServedModel]) -> ModelList:
    """`/v1/models`: every served model under each of its names, loaded or not."""
    cards: list[ModelCard] = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "infer",
            "max_model_len": model.max_model_len,
            "status": model.status,
        }
        for model in models
        for name in model.names
    ]
    return {"object": "list", "data": cards}


@dataclass(frozen=True)
class Head:
    """What every chunk and body of one response shares.

    Args:
        id: ``cmpl-...`` or ``chatcmpl-...``.
        created: Unix time of the request.
        model: The served model's name.
        chat: A chat completion (else a text completion).
        top_logprobs: Alternatives per token the client asked for; ``None``: no logprobs.
        usage_field: Put ``"usage": null`` in every chunk (a usage chunk comes last).
        echo_scores: The echoed prompt's tokens start each choice's ``logprobs`` (a
            completion with ``echo`` and ``logprobs``).
        prompt_logprobs: vLLM's ``prompt_logprobs``: alternatives per prompt token;
            ``None``: no such field.
    """

    id: str
    created: int
    model: str
    chat: bool
    top_logprobs: int | None = None
    usage_field: bool = False
    echo_scores: bool = False
    prompt_logprobs: int | None = None

    def _fields(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def finish_reason(outcome: Outcome, reply: ReplyParser | None = None) -> str | None:
    """The ``finish_reason`` a choice that ended so reports; ``None`` for an error. A reply
    that ended by itself after complete tool calls finishes with ``tool_calls``; one cut
    short (``length``) does not, whatever it had begun."""
    if isinstance(outcome, Failure):
        return "length" if outcome is Failure.TIMEOUT else None
    if outcome is not FinishReason.LENGTH and reply is not None and reply.calls:
        return "tool_calls"
    return "stop" if outcome is FinishReason.EOS else outcome.value


def chunk(
    head: Head,
    index: int,
    delta: dict[str, Any] | str,
    finish: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One stream chunk of choice ``index``."""
    choice = {
        "index": index,
        "delta" if head.chat else "text": delta,
        "logprobs": logprobs,
        "finish_reason": finish,
    }
    body = head._fields(head.chunk_kind)
    body["choices"] = [choice]
    if head.usage_field:
        body["usage"] = None
    return body


def opening(head: Head, choices: int, echo: Sequence[str] | None) -> list[dict[str, Any]]:
    """The chunks before any token: each chat choice's role, or each echoed prompt."""
    if head.chat:
        return [chunk(head, i, {"role": "assistant", "content": ""}) for i in range(choices)]
    return [chunk(head, i, text) for i, text in enumerate(echo or [])]


def output_chunks(
    head: Head, index: int, out: StepOutput, reply: ReplyParser | None = None, offset: int = 0
) -> list[dict[str, Any]]:
    """The chunks of one output: its text (with log-probabilities), then, on a choice's last
    output, its finish (an output that ends in an error is answered by :func:`error_chunk`).
    ``offset`` is the length of the echoed prompt before the generated text.

    A chat reply read by ``reply`` (reasoning, tool calls) gives what that parser makes of
    the text: reasoning, content and tool-call deltas, and ``tool_calls`` as the finish of
    a reply that made calls.
    """
    chunks = []
    logprobs = logprobs_of(head, [out], offset) if out.logprobs is not None else None
    if reply is not None:
        parsed = reply.feed(out.text_delta)
        if out.outcome is not None:
            parsed.extend(reply.finish())
        delta: dict[str, Any] | str = parsed.as_openai()
    else:
        delta = {"content": out.text_delta} if head.chat and out.text_delta else out.text_delta
    if delta or logprobs is not None:
        chunks.append(chunk(head, index, delta or ({} if head.chat else ""), logprobs=logprobs))
    if out.outcome is not None:
        reason = finish_reason(out.outcome, reply)
        chunks.append(chunk(head, index, {} if head.chat else "", reason))
    return chunks


def error_chunk(code: str, message: str) -> dict[str, Any]:
    """The error object a stream sends before ``[DONE]`` when it fails part-way."""
    return {"error": {"message": message, "type": "server_error", "code": code}}


def usage_chunk(head: Head, usage: Usage) -> dict[str, Any]:
    """The chunk after the last one when ``stream_options.include_usage`` is set."""
    body = head._fields(head.chunk_kind)
    body.update(choices=[], usage=usage)
    return body


@dataclass(frozen=True)
class PromptScores:
    """A scored prompt, with the text of every token its scores name.

    Args:
        ids: The prompt's token ids.
        scores: The scores of tokens ``1...`` (the first token has none).
        texts: Token id → its text.
        offsets: Each prompt token's character offset in the prompt's text.
    """

    ids: list[int]
    scores: list[PromptLogprob]
    texts: dict[int, str]
    offsets: list[int]


def prompt_chunk(head: Head, index: int, prompt: PromptScores, echo: str | None) -> dict[str, Any]:
    """The chunk that carries a choice's scored prompt: the echoed prompt with its tokens'
    ``logprobs`` (``echo_scores``) and vLLM's ``prompt_logprobs`` (when asked)."""
    if head.chat:
        result = chunk(head, index, {})
    elif head.echo_scores:
        result = chunk(head, index, echo or "", logprobs=echo_logprobs(prompt, head.top_logprobs))
    else:
        result = chunk(head, index, "")
    if head.prompt_logprobs is not None:
        result["choices"][0]["prompt_logprobs"] = vllm_prompt_logprobs(prompt, head.prompt_logprobs)
    return result


def echo_logprobs(prompt: PromptScores, top: int | None) -> dict[str, Any]:
    """The completions' parallel ``logprobs`` lists over the prompt's tokens (the first
    token has no log-probability: ``null``)."""
    k = top or 0
    return {
        "tokens": [prompt.texts[t] for t in prompt.ids],
        "token_logprobs": [None] + [s.logprob for s in prompt.scores],
        "top_logprobs": [None]
        + [{prompt.texts[t]: v for t, v in s.top[:k]} for s in prompt.scores],
        "text_offset": list(prompt.offsets),
    }


def vllm_prompt_logprobs(prompt: PromptScores, k: int) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs``: ``null`` for the first token, then per token
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` for its top ``k`` and itself."""
    result: PromptLogprobs = [None]
    for s in prompt.scores:
        entries: dict[str, PromptTokenLogprob] = {
            str(t): {"logprob": v, "rank": rank, "decoded_token": prompt.texts[t]}
            for rank, (t, v) in enumerate(s.top[:k], start=1)
        }
        entries[str(s.token_id)] = {
            "logprob": s.logprob,
            "rank": s.rank,
            "decoded_token": prompt.texts[s.token_id],
        }
        result.append(entries)
    return result


@dataclass
class Choice:
    """One choice of a non-streamed response, as its outputs made it."""

    text: str
    finish_reason: str | None
    outputs: list[StepOutput]  # those with log-probabilities
    reply: ReplyParser | None = None  # a chat reply's reasoning and tool calls, read
    prompt: PromptScores | None = None  # its scored prompt, when asked


def message(c: Choice) -> AssistantMessage:
    """The assistant message of a chat choice: content (``null`` when the reply is only
    tool calls), its complete tool calls, and its reasoning in both fields clients read."""
    if c.reply is None:
        return {"role": "assistant", "content": c.text}
    calls = c.reply.calls
    content = c.reply.content
    msg: AssistantMessage = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        msg["tool_calls"] = [
            {"id": k.id, "type": "function", "function": {"name": k.name, "arguments": k.arguments}}
            for k in calls
        ]
    if c.reply.reasoning:
        msg["reasoning_content"] = msg["reasoning"] = c.reply.reasoning
    return msg


def body(
    head: Head, choices: Sequence[Choice], usage: Usage, echo: Sequence[str] | None = None
) -> CompletionResponse | ChatCompletionResponse:
    """The body of a non-streamed response: one choice per item, in index order."""
    items: list[ChatChoice] | list[CompletionChoice]
    if head.chat:
        items = [_chat_choice(head, i, c) for i, c in enumerate(choices)]
    else:
        items = [_text_choice(head, i, c, echo[i] if echo else "") for i, c in enumerate(choices)]
    result = head._fields("chat.completion" if head.chat else "text_completion")
    result.update(choices=items, usage=usage)
    return cast(CompletionResponse | ChatCompletionResponse, result)


def _chat_choice(head: Head, index: int, c: Choice) -> ChatChoice:
    return {"index": index, "message": message(c), **_end(head, c, 0)}


def _text_choice(head: Head, index: int, c: Choice, echoed: str) -> CompletionChoice:
    return {"index": index, "text": echoed + c.text, **_end(head, c, len(echoed))}


def _end(head: Head, c: Choice, offset: int) -> ChoiceEnd:
    """A choice's ``logprobs`` (an echo with scores starts with its prompt's tokens), its
    finish, and its scored prompt when asked."""
    lps = None
    if head.top_logprobs is not None:
        lps = logprobs_of(head, c.outputs, offset)
        if head.echo_scores and c.prompt is not None:
            lps = join_logprobs(echo_logprobs(c.prompt, head.top_logprobs), lps)
    end: ChoiceEnd = {"logprobs": lps, "finish_reason": c.finish_reason}
    if head.prompt_logprobs is not None:
        end["prompt_logprobs"] = _scored(head.prompt_logprobs, c)
    return end


def _scored(k: int, c: Choice) -> PromptLogprobs | None:
    return vllm_prompt_logprobs(c.prompt, k) if c.prompt else None


def join_logprobs(first: dict[str, Any], then: dict[str, Any]) -> dict[str, Any]:
    """Two completions ``logprobs`` objects as one: each list, then the other's."""
    return {key: first[key] + then[key] for key in first}


def logprobs_of(head: Head, outputs: Sequence[StepOutput], offset: int = 0) -> dict[str, Any]:
    """The ``logprobs`` object of a chunk or choice: chat's ``content`` list, or the
    completions' parallel lists (``offset`` is added to each token's ``text_offset``: the
    echoed prompt's length)."""
    top = head.top_logprobs or 0
    entries = [(o.logprobs, o.text_offset) for o in outputs if o.logprobs is not None]
    if head.chat:
        return {
            "content": [
                {
                    **_entry(lp.token, lp.logprob),
                    "top_logprobs": [_entry(t, v) for t, v in lp.top[:top]],
                }
                for lp, _ in entries
            ]
        }
    return {
        "tokens": [lp.token for lp, _ in entries],
        "token_logprobs": [lp.logprob for lp, _ in entries],
        "top_logprobs": [dict(lp.top[:top]) for lp, _ in entries],
        "text_offset": [offset + at for _, at in entries],
    }


def _entry(token: str, logprob: float) -> dict[str, Any]:
    """``{"token", "logprob", "bytes"}`` as OpenAI's chat logprobs list them."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
