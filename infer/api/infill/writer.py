"""The writer of llama.cpp's ``/infill``: one completion object per choice, or its pieces as
``data:`` events and then the whole object (:class:`InfillWriter`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from infer.api.errors import APIError
from infer.api.infill import bodies
from infer.api.infill.models import SAMPLERS, InfillRequest
from infer.api.usage import Counts
from infer.api.writer import Event, Ticket, Writer
from infer.engine.request import Outcome, StepOutput


@dataclass
class _Completion:
    """One choice as it arrives."""

    text: list[str] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    predicted: int = 0
    prompt: int = 0
    cached: int = 0
    outcome: Outcome | None = None


class InfillWriter(Writer):
    """llama.cpp's completion objects for an admitted ``/infill`` request.

    Args:
        body: The request.
        ticket: What admission settled (``n_ctx`` is its model's context).
        clock: The clock of the ticket's timings.
    """

    def __init__(self, body: InfillRequest, ticket: Ticket, clock: Callable[[], float]) -> None:
        super().__init__(body.stream)
        self.request = body
        self.ticket = ticket
        self.n_ctx = ticket.context
        self.clock = clock
        self.completions = [_Completion() for _ in range(ticket.choices)]

    def output(self, index: int, out: StepOutput) -> list[Event]:
        done = self.completions[index]
        done.text.append(out.text_delta)
        if out.token_id is not None:
            done.tokens.append(out.token_id)
        done.predicted, done.prompt = out.completion_tokens, out.prompt_tokens
        done.cached, done.outcome = out.cached_tokens, out.outcome
        if not self.streamed or out.finished and not out.text_delta:
            return []
        tokens = [out.token_id] if out.token_id is not None and self.request.return_tokens else []
        piece: bodies.InfillPiece = {
            "index": index,
            "content": out.text_delta,
            "tokens": tokens,
            "stop": False,
            "id_slot": 0,
            "tokens_predicted": out.completion_tokens,
            "tokens_evaluated": out.prompt_tokens,
        }
        return [Event(piece)]

    def finish(self, counts: Counts) -> list[Event]:
        if not self.streamed:
            return []
        return [
            Event(self._fields(self._body(i, final=True))) for i in range(len(self.completions))
        ]

    def failed(self, error: APIError, counts: Counts) -> list[Event]:
        return [Event(bodies.error_body(error))]

    def body(self, counts: Counts) -> Any:
        answers = [self._fields(self._body(i)) for i in range(len(self.completions))]
        return answers[0] if len(answers) == 1 else answers

    def _fields(self, body: bodies.InfillResponse) -> dict[str, Any]:
        fields = self.request.response_fields
        return bodies.only(body, fields) if fields else dict(body)

    def _body(self, index: int, final: bool = False) -> bodies.InfillResponse:
        done, request, timing = self.completions[index], self.request, self.ticket.timing
        text = "".join(done.text)
        now = self.clock()
        first = timing.first_token_at if timing.first_token_at is not None else now
        spent = bodies.timings(
            done.cached,
            done.prompt - done.cached,
            first - timing.arrival,
            done.predicted,
            now - first,
        )
        return {
            "index": index,
            "content": "" if final else text,
            "tokens": done.tokens if request.return_tokens and not final else [],
            "id_slot": 0,
            "stop": True,
            "model": self.ticket.model,
            "tokens_predicted": done.predicted,
            "tokens_evaluated": done.prompt,
            "generation_settings": self._settings(),
            "has_new_line": "\n" in text,
            "truncated": self.ticket.truncated,
            "stop_type": bodies.stop_type(done.outcome),
            "stopping_word": "",
            "tokens_cached": done.prompt + done.predicted,
            "timings": spent,
        }

    def _settings(self) -> bodies.GenerationSettings:
        request, sampling = self.request, self.request.sampling()
        return {
            "n_ctx": self.n_ctx,
            "n_predict": -1 if (limit := request.limit()) is None else limit,
            "temperature": sampling["temperature"],
            "top_k": sampling["top_k"],
            "top_p": sampling["top_p"],
            "min_p": sampling["min_p"],
            "seed": request.seed,
            "stop": request.stop,
            "n_indent": request.n_indent,
            "t_max_predict_ms": request.t_max_predict_ms,
            "samplers": list(request.samplers if request.samplers is not None else SAMPLERS),
        }
