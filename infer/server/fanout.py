"""One OpenAI request as several engine requests: ``n`` choices per prompt, list prompts.

Each choice is its own engine request (its own sampling stream and seed). :class:`Choices`
reads them as one stream of ``(index, output)``: a single choice is read directly, several
through one small task per choice in the app's nursery that forwards its outputs to a shared
channel (trio forbids a nursery that stays open across the response generator's ``yield``).
The channel is bounded, so a slow reader still backs up into each request's own output
channel, where the worker coalesces and limits it as for any stream.
"""

from __future__ import annotations

import logging
import math
from contextlib import ExitStack
from typing import Any

import trio

from infer.engine.request import StepOutput
from infer.server.generation import SHUTDOWN_POLL_S, Generation

log = logging.getLogger("infer.server")

SEED_MOD = 2**64
_SEED_STEP = 0x9E3779B97F4A7C15  # odd: choices of one seed never collide


def choice_seed(seed: int | None, index: int) -> int | None:
    """The seed of choice ``index`` of a request seeded with ``seed``.

    Choice 0 keeps the request's seed (so ``n=1`` and the first of ``n`` agree); the others
    get distinct seeds derived from it, the same on every call.
    """
    if seed is None or index == 0:
        return seed
    return (seed + index * _SEED_STEP) % SEED_MOD


class Choices:
    """The generations of one request, read as one stream; use it as a context manager.

    Args:
        gens: The started generations, prompt by prompt, ``n`` per prompt (index order).
        n: Choices per prompt.
        nursery: Where the forwarding tasks run when there is more than one choice.
    """

    def __init__(self, gens: list[Generation], n: int, nursery: trio.Nursery) -> None:
        self.gens = gens
        self.n = n
        self._nursery = nursery
        self._done: set[int] = set()
        self._scopes: list[trio.CancelScope] = []
        self._exits = ExitStack()
        self._send, self._receive = trio.open_memory_channel[tuple[int, StepOutput | None]](
            len(gens))

    @property
    def request_id(self) -> str:
        return self.gens[0].request_id

    @property
    def finished(self) -> bool:
        """Whether the last output of every choice has been read."""
        return len(self._done) == len(self.gens)

    def __enter__(self) -> Choices:
        for gen in self.gens:
            self._exits.enter_context(gen)
        if len(self.gens) > 1:
            for index, gen in enumerate(self.gens):
                scope = trio.CancelScope()
                self._scopes.append(scope)
                self._nursery.start_soon(self._forward, index, gen, self._send.clone(), scope)
            self._send.close()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for scope in self._scopes:
            scope.cancel()
        self._exits.close()  # aborts the choices that have not finished

    def fail(self) -> None:
        """The server could not go on with the stream: end every choice as an error."""
        for gen in self.gens:
            gen.fail()

    async def next(self, wait_s: float | None = None) -> tuple[int, StepOutput] | None:
        """The next output of any choice with its index, or ``None`` after ``wait_s`` quiet.

        Raises:
            RuntimeError: A choice's stream failed, or all were read already.
        """
        if len(self.gens) == 1:
            out = await self.gens[0].next(wait_s)
            if out is not None and out.finished:
                self._done.add(0)
            return None if out is None else (0, out)
        give_up = trio.current_time() + wait_s if wait_s is not None else math.inf
        while True:
            self.gens[0]._check_shutdown()  # the forwarding tasks cannot see the deadline
            with trio.move_on_at(min(give_up, trio.current_time() + SHUTDOWN_POLL_S)):
                try:
                    index, out = await self._receive.receive()
                except trio.EndOfChannel:
                    raise RuntimeError("every choice has ended") from None
                if out is None:
                    raise RuntimeError(f"choice {index} failed")
                if out.finished:
                    self._done.add(index)
                return index, out
            if trio.current_time() >= give_up:
                return None

    async def _forward(self, index: int, gen: Generation,
                       send: trio.MemorySendChannel[tuple[int, StepOutput | None]],
                       scope: trio.CancelScope) -> None:
        with scope:
            async with send:
                try:
                    while not gen.finished:
                        await send.send((index, await gen.next()))
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the reader has gone
                except Exception:  # noqa: BLE001 - reported to the reader as a failure
                    log.exception("choice %d of %s failed", index, gen.request_id)
                    await send.send((index, None))

    def usage(self) -> dict[str, int]:
        """Token counts of the whole request: each prompt once, every choice's output."""
        prompt = sum(g.prompt_tokens for g in self.gens[:: self.n])
        completion = sum(g.tokens for g in self.gens)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}
