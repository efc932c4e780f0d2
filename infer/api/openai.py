"""OpenAI's completion and chat-completion objects, built from a request's outputs.

A streamed response is ``data: {chunk}`` events: per output of choice ``index``, a chunk
with its new text (and log-probabilities), a last chunk with its ``finish_reason``, a usage
chunk when asked, then ``data: [DONE]``; a failure after the stream started is an error
chunk before ``[DONE]``. A non-streamed response is one body built from each choice's outputs.
Our ``eos`` finish reason is OpenAI's ``stop``; a timeout ends a choice with ``length``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from infer.api.chat import ReplyParser
from infer.engine.request import ErrorCode, FinishReason, StepOutput


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
    """

    id: str
    created: int
    model: str
    chat: bool
    top_logprobs: int | None = None
    usage_field: bool = False

    def _fields(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    @property
    def chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"


def finish_reason(
    outcome: FinishReason | ErrorCode, reply: ReplyParser | None = None
) -> str | None:
    """The ``finish_reason`` a choice that ended so reports; ``None`` for an error. A reply
    that ended by itself after complete tool calls finishes with ``tool_calls``; one cut
    short (``length``) does not, whatever it had begun."""
    if isinstance(outcome, ErrorCode):
        return "length" if outcome is ErrorCode.TIMEOUT else None
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
    head: Head, index: int, out: StepOutput, reply: ReplyParser | None = None
) -> list[dict[str, Any]]:
    """The chunks of one output: its text (with log-probabilities), then, on a choice's last
    output, its finish. An output that ends in an error gives an error object instead.

    A chat reply read by ``reply`` (reasoning, tool calls) gives what that parser makes of
    the text: reasoning, content and tool-call deltas, and ``tool_calls`` as the finish of
    a reply that made calls.
    """
    chunks = []
    logprobs = logprobs_of(head, [out]) if out.logprobs is not None else None
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
        if reason is None:
            assert isinstance(out.outcome, ErrorCode)  # only errors have no finish reason
            chunks.append(error_chunk(out.outcome, out.message))
        else:
            chunks.append(chunk(head, index, {} if head.chat else "", reason))
    return chunks


def error_chunk(code: ErrorCode, message: str | None = None) -> dict[str, Any]:
    """The error object a stream sends before ``[DONE]`` when it fails part-way."""
    return {
        "error": {"message": message or code.message, "type": "server_error", "code": code.value}
    }


def usage_chunk(head: Head, usage: dict[str, int]) -> dict[str, Any]:
    """The chunk after the last one when ``stream_options.include_usage`` is set."""
    body = head._fields(head.chunk_kind)
    body.update(choices=[], usage=usage)
    return body


@dataclass
class Choice:
    """One choice of a non-streamed response, as its outputs made it."""

    text: str
    finish_reason: str | None
    outputs: list[StepOutput]  # those with log-probabilities
    reply: ReplyParser | None = None  # a chat reply's reasoning and tool calls, read


def message(c: Choice) -> dict[str, Any]:
    """The assistant message of a chat choice: content (``null`` when the reply is only
    tool calls), its complete tool calls, and its reasoning in both fields clients read."""
    if c.reply is None:
        return {"role": "assistant", "content": c.text}
    calls = c.reply.calls
    content = c.reply.content
    msg: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    if calls:
        msg["tool_calls"] = [
            {"id": k.id, "type": "function", "function": {"name": k.name, "arguments": k.arguments}}
            for k in calls
        ]
    if c.reply.reasoning:
        msg["reasoning_content"] = msg["reasoning"] = c.reply.reasoning
    return msg


def body(
    head: Head, choices: Sequence[Choice], usage: dict[str, int], echo: Sequence[str] | None = None
) -> dict[str, Any]:
    """The body of a non-streamed response: one choice per item, in index order."""
    items = []
    for index, c in enumerate(choices):
        text = (echo[index] if echo is not None else "") + c.text
        content: dict[str, Any] = {"message": message(c)} if head.chat else {"text": text}
        lps = logprobs_of(head, c.outputs) if head.top_logprobs is not None else None
        items.append({"index": index, **content, "logprobs": lps, "finish_reason": c.finish_reason})
    result = head._fields("chat.completion" if head.chat else "text_completion")
    result.update(choices=items, usage=usage)
    return result


def logprobs_of(head: Head, outputs: Sequence[StepOutput]) -> dict[str, Any]:
    """The ``logprobs`` object of a chunk or choice: chat's ``content`` list, or the
    completions' parallel lists."""
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
        "text_offset": [offset for _, offset in entries],
    }


def _entry(token: str, logprob: float) -> dict[str, Any]:
    """``{"token", "logprob", "bytes"}`` as OpenAI's chat logprobs list them."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
