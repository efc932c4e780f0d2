"""OpenAI response objects: stream chunks, final bodies, usage, log-probabilities."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from infer.engine.request import StepOutput
from infer.server.generation import Generation


class ChunkFormat:
    """Builds the chunks and bodies of one completion or chat completion.

    Args:
        kind: ``"text_completion"`` or ``"chat.completion"``.
        id_prefix: ``"cmpl-"`` or ``"chatcmpl-"``.
        gen: The request (its id, creation time, usage).
        top_logprobs: Alternatives per token the client asked for; ``None``: no logprobs.
    """

    def __init__(self, kind: str, id_prefix: str, gen: Generation,
                 top_logprobs: int | None) -> None:
        self.kind = kind
        self.chat = kind == "chat.completion"
        self.id = id_prefix + gen.request_id
        self.gen = gen
        self.model = gen.state.model_name
        self.top_logprobs = top_logprobs
        engine = gen.state.engine
        assert engine is not None  # a request only starts once the engine runs
        self.tokenizer = engine.tokenizer
        self._offset = 0  # text offset of the next token (legacy completion logprobs)

    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.gen.created, "model": self.model}

    def delta(self, text: str | None) -> dict[str, Any] | str:
        """A chunk's new text: ``{"content": text}`` for chat, the bare text otherwise."""
        if self.chat:
            return {} if text is None else {"content": text}
        return text or ""

    def chunk(
        self,
        delta: dict[str, Any] | str,
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        usage: bool = False,
    ) -> dict[str, Any]:
        """One stream chunk.

        Args:
            delta: From :meth:`delta` (or a chat role delta).
            finish_reason: Set on the last chunk only.
            logprobs: This chunk's tokens' log-probabilities.
            usage: Add ``"usage": null`` (the client asked for a usage chunk at the end).

        Returns:
            The chunk object.
        """
        choice = {"index": 0, "delta" if self.chat else "text": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = [choice]
        if usage:
            body["usage"] = None
        return body

    def usage_chunk(self) -> dict[str, Any]:
        """The chunk after the last one when ``stream_options.include_usage`` is set."""
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body.update(choices=[], usage=self.gen.usage())
        return body

    def final(self, text: str, finish_reason: str | None,
              logprobs: dict[str, Any] | None) -> dict[str, Any]:
        """The body of a non-streamed response."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        body = self._head(self.kind)
        body.update(choices=[choice], usage=self.gen.usage())
        return body

    def logprobs(self, outputs: Sequence[StepOutput]) -> dict[str, Any]:
        """Log-probabilities of the tokens of ``outputs`` in this endpoint's format."""
        with_lp = [o for o in outputs if o.logprob is not None and o.token_id is not None]
        if self.chat:
            return {"content": [self._chat_entry(o) for o in with_lp]}
        tokens, offsets = [], []
        for o in outputs:
            if o.logprob is not None and o.token_id is not None:
                tokens.append(self._token(o.token_id))
                offsets.append(self._offset)
            self._offset += len(o.text_delta)
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
