"""OpenAI response objects: stream chunks, final bodies, usage, log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from infer.engine.request import StepOutput
from infer.server.fanout import Choices


class ChunkFormat:
    """Builds the chunks and bodies of one completion or chat completion (all its choices).

    Args:
        kind: ``"text_completion"`` or ``"chat.completion"``.
        id_prefix: ``"cmpl-"`` or ``"chatcmpl-"``.
        choices: The request's choices (their id, creation time, usage).
        top_logprobs: Alternatives per token the client asked for; ``None``: no logprobs.
        echo: Per choice, the prompt text to put before its completion (``echo``).
    """

    def __init__(self, kind: str, id_prefix: str, choices: Choices,
                 top_logprobs: int | None, echo: Sequence[str] | None = None) -> None:
        self.kind = kind
        self.chat = kind == "chat.completion"
        self.id = id_prefix + choices.request_id
        self.choices = choices
        gen = choices.gens[0]
        self.created = gen.created
        self.model = gen.state.model_name
        self.top_logprobs = top_logprobs
        self.echo = list(echo) if echo is not None else None
        engine = gen.state.engine
        assert engine is not None  # a request only starts once the engine runs
        self.tokenizer = engine.tokenizer
        self._offsets: dict[int, int] = {}  # text offset of each choice's next token

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def delta(self, text: str | None) -> dict[str, Any] | str:
        """A chunk's new text: ``{"content": text}`` for chat, the bare text otherwise."""
        if self.chat:
            return {} if text is None else {"content": text}
        return text or ""

    def chunk(
        self,
        index: int,
        delta: dict[str, Any] | str,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        usage: bool = False,
    ) -> dict[str, Any]:
        """One stream chunk of one choice.

        Args:
            index: The choice.
            delta: From :meth:`delta` (or a chat role delta).
            finish_reason: Set on the choice's last chunk only.
            logprobs: This chunk's tokens' log-probabilities.
            usage: Add ``"usage": null`` (the client asked for a usage chunk at the end).

        Returns:
            The chunk object.
        """
        choice = {"index": index, "delta" if self.chat else "text": delta,
                  "logprobs": logprobs, "finish_reason": finish_reason}
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [choice]
        if usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict[str, Any]:
        """The chunk after the last one when ``stream_options.include_usage`` is set."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=self.choices.usage())
        return body

    def final(self, texts: Sequence[str], finish_reasons: Sequence[str | None],
              logprobs: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
        """The body of a non-streamed response: one choice per item, in index order."""
        choices = []
        for index, (text, reason, lps) in enumerate(
                zip(texts, finish_reasons, logprobs, strict=True)):
            if self.echo is not None:
                text = self.echo[index] + text
            content: dict[str, Any] = (
                {"message": {"role": "assistant", "content": text}} if self.chat
                else {"text": text})
            choices.append({"index": index, **content, "logprobs": lps,
                            "finish_reason": reason})
        body = self._head(self.kind)
        body.update(choices=choices, usage=self.choices.usage())
        return body

    def logprobs(self, index: int, outputs: Sequence[StepOutput]) -> dict[str, Any]:
        """Log-probabilities of the tokens of choice ``index``'s ``outputs``."""
        with_lp = [o for o in outputs if o.logprob is not None and o.token_id is not None]
        if self.chat:
            return {"content": [self._chat_entry(o) for o in with_lp]}
        tokens, offsets = [], []
        offset = self._offsets.get(index, 0)
        for o in outputs:
            if o.logprob is not None and o.token_id is not None:
                tokens.append(self._token(o.token_id))
                offsets.append(offset)
            offset += len(o.text_delta)
        self._offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": [o.logprob for o in with_lp],
            "top_logprobs": [{self._token(t): lp for t, lp in self._top(o)} for o in with_lp],
            "text_offset": offsets,
        }

    def _chat_entry(self, out: StepOutput) -> dict[str, Any]:
        assert out.token_id is not None and out.logprob is not None  # filtered by the caller
        entry = logprobs_entry(self._token(out.token_id), out.logprob)
        entry["top_logprobs"] = [logprobs_entry(self._token(t), lp) for t, lp in self._top(out)]
        return entry

    def _top(self, out: StepOutput) -> list[tuple[int, float]]:
        return list(out.top_logprobs or [])[: self.top_logprobs or 0]

    def _token(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))


def logprobs_entry(token: str, logprob: float) -> dict[str, Any]:
    """``{"token", "logprob", "bytes"}`` as OpenAI's chat logprobs list them."""
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
