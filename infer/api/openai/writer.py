"""The writer of OpenAI's completions and chat completions: a chunk per output then
``[DONE]``, or one body (:class:`CompletionWriter`).

A chat request's tools and reasoning are read back out of the reply by
:class:`~infer.api.chat.ReplyParser`. A timeout ends a choice with ``length``, not an error.
"""

from __future__ import annotations

from typing import Any

from infer.api.chat import ReplyParser
from infer.api.errors import APIError
from infer.api.openai import bodies
from infer.api.openai.models import ChatCompletionRequest, CompletionRequest, OpenAIFields
from infer.api.usage import Counts, usage
from infer.api.writer import DONE, Event, Job, Ticket, Writer
from infer.engine.request import Outcome, StepOutput


def completion_writer(body: CompletionRequest, ticket: Ticket) -> CompletionWriter:
    """The writer of an admitted ``/v1/completions`` request."""
    scored = body.echo_logprobs() is not None
    head = _head(body, ticket, body.logprobs, body.prompt_logprobs, echo_scores=scored)
    echo = body.prompt_list() if body.echo else None
    return CompletionWriter(ticket, body.stream, head, body.n, echo)


def chat_writer(body: ChatCompletionRequest, ticket: Ticket) -> CompletionWriter:
    """The writer of an admitted ``/v1/chat/completions`` request."""
    head = _head(body, ticket, body.top_logprobs_wanted(), body.prompt_logprobs, chat=True)
    plan, thinking, separate = ticket.plan, ticket.thinking, body.separate_reasoning
    replies = None
    if plan is not None or (thinking is not None and separate):
        replies = [ReplyParser(plan, thinking, separate) for _ in range(ticket.choices)]
    return CompletionWriter(ticket, body.stream, head, body.n, replies=replies)


def _head(
    body: OpenAIFields,
    ticket: Ticket,
    top_logprobs: int | None,
    prompt_logprobs: int | None,
    chat: bool = False,
    echo_scores: bool = False,
) -> bodies.Head:
    prefix = "chatcmpl-" if chat else "cmpl-"
    return bodies.Head(
        prefix + ticket.id,
        ticket.created,
        ticket.model,
        chat,
        top_logprobs,
        body.include_usage(),
        echo_scores,
        prompt_logprobs,
    )


class CompletionWriter(Writer):
    """Completions and chat completions: a chunk per output then ``[DONE]``, or one body.

    Args:
        ticket: The admitted request (its prompts, and the tokenizer that names their
            scored tokens).
        streamed: Whether the client reads chunks.
        head: What every chunk and the body share.
        n: Choices per prompt.
        echo: Each prompt as the client sent it, to echo (completions with ``echo``).
        replies: Each chat choice's reply parser (tools, separate reasoning).
    """

    def __init__(
        self,
        ticket: Ticket,
        streamed: bool,
        head: bodies.Head,
        n: int,
        echo: list[str | list[int]] | None = None,
        replies: list[ReplyParser] | None = None,
    ) -> None:
        super().__init__(streamed)
        self.ticket = ticket
        self.head = head
        self.prompts = [ids for ids in ticket.prompt_ids for _ in range(n)]
        self.n = n
        self.sent = echo
        self.echo: list[str] | None = None  # each choice's echoed text (start_work)
        self.replies = replies
        count = ticket.choices
        self.texts: list[list[str]] = [[] for _ in range(count)]
        self.choices = [bodies.Choice("", None, []) for _ in range(count)]
        self.outcomes: list[Outcome | None] = [None] * count
        self._scores: dict[int, bodies.PromptScores] = {}

    def is_error(self, out: StepOutput) -> bool:
        return out.outcome is not None and bodies.finish_reason(out.outcome) is None

    def start_work(self) -> Job | None:
        """The echoed prompts' text: token ids are decoded."""
        sent, tokenizer = self.sent, self.ticket.tokenizer
        if sent is None:
            return None

        def run() -> None:
            texts = [p if isinstance(p, str) else str(tokenizer.decode(p)) for p in sent]
            self.echo = [text for text in texts for _ in range(self.n)]

        if all(isinstance(p, str) for p in sent):
            run()  # nothing to decode
            return None
        return run

    def start(self) -> list[Event]:
        if not self.streamed:
            return []
        echo = None if self.head.echo_scores else self.echo
        return _events(bodies.opening(self.head, len(self.choices), echo))

    def work(self, index: int, out: StepOutput) -> Job | None:
        """Names the tokens of an output's prompt scores and, for an echo with
        log-probabilities, finds each prompt token's offset."""
        scores = out.prompt_logprobs
        if scores is None:
            return None
        ids, tokenizer, offsets = self.prompts[index], self.ticket.tokenizer, self.head.echo_scores

        def run() -> None:
            named = {*ids, *(t for s in scores for t, _ in s.top)}
            texts = {t: str(tokenizer.decode([t])) for t in named}
            at = [len(tokenizer.decode(ids[:i])) for i in range(len(ids))] if offsets else []
            self._scores[index] = bodies.PromptScores(ids, scores, texts, at)

        return run

    def output(self, index: int, out: StepOutput) -> list[Event]:
        head = self.head
        prompt = self._scores.pop(index, None)
        if not self.streamed:
            self.texts[index].append(out.text_delta)
            choice = self.choices[index]
            if out.logprobs is not None:
                choice.outputs.append(out)
            if prompt is not None:
                choice.prompt = prompt
            self.outcomes[index] = out.outcome
            return []
        echoed = self.echo[index] if self.echo is not None else None
        chunks = [bodies.prompt_chunk(head, index, prompt, echoed)] if prompt else []
        offset = len(echoed) if head.echo_scores and echoed else 0
        reply = self.replies[index] if self.replies else None
        return _events(chunks + bodies.output_chunks(head, index, out, reply, offset))

    def finish(self, counts: Counts) -> list[Event]:
        if not self.streamed:
            return []
        if not self.head.usage_field:
            return [DONE]
        return [Event(bodies.usage_chunk(self.head, usage(counts))), DONE]

    def failed(self, error: APIError, counts: Counts) -> list[Event]:
        return [Event(bodies.error_chunk(error.code.value, error.message)), DONE]

    def body(self, counts: Counts) -> bodies.CompletionResponse | bodies.ChatCompletionResponse:
        for index, (choice, outcome) in enumerate(zip(self.choices, self.outcomes, strict=True)):
            assert outcome is not None  # every choice has ended
            choice.text = "".join(self.texts[index])
            if self.replies:
                choice.reply = self.replies[index]
                choice.reply.feed(choice.text)
                choice.reply.finish()
            choice.finish_reason = bodies.finish_reason(outcome, choice.reply)
        return bodies.body(self.head, self.choices, usage(counts), self.echo)


def _events(chunks: list[dict[str, Any]]) -> list[Event]:
    return [Event(c) for c in chunks]
