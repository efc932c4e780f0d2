"""The one scheduler of the cores: which model's step runs next, when several want to.

Each served model has its own thread (its engine's loop, or its embedder's), and one step of
any of them already fills every core: two at once would only slow both, and each thread's
OpenMP team would wait on the other's. So every step holds :class:`Cores` while it runs.

It is handed over at release, not raced for: the thread that releases it cannot take it back
while another waits. The next holder is the first waiter of the most urgent class
(:class:`Urgency`): latency-bound work (a prompt to prefill: a first token is awaited; a code
completion, whose every token is) before throughput-bound work (the 40th token of a long
answer, a large embedding batch). A throughput waiter that later arrivals have gone before
``max_skips`` times is served as if it were latency-bound, so none starves.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum


class Urgency(IntEnum):
    """How soon a step's result is awaited (lower goes first)."""

    LATENCY = 0
    THROUGHPUT = 1


@dataclass
class Waiter:
    """A thread waiting for the cores."""

    seq: int  # arrival order
    urgency: Urgency
    skipped: int = 0  # grants that went to a later arrival meanwhile
    granted: bool = False

    def rank(self, max_skips: int) -> tuple[int, int]:
        """Its place in line: urgency (raised once skipped enough), then arrival."""
        urgency = Urgency.LATENCY if self.skipped >= max_skips else self.urgency
        return urgency, self.seq


def next_holder(waiting: Sequence[Waiter], max_skips: int) -> Waiter:
    """The waiter the cores go to next; every earlier arrival it passes counts one skip."""
    chosen = min(waiting, key=lambda w: w.rank(max_skips))
    for w in waiting:
        if w.seq < chosen.seq:
            w.skipped += 1
    return chosen


class Cores:
    """A lock over the machine's cores, granted by urgency, then arrival (see the module).

    Args:
        max_skips: How many later arrivals may go before a throughput waiter.
    """

    def __init__(self, max_skips: int = 4) -> None:
        if max_skips < 1:
            raise ValueError(f"max_skips must be >= 1, got {max_skips}")
        self.max_skips = max_skips
        self._cond = threading.Condition()
        self._held = False
        self._waiting: list[Waiter] = []
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        """Threads waiting for their turn now."""
        with self._cond:
            return len(self._waiting)

    @contextmanager
    def turn(self, urgency: Urgency) -> Iterator[None]:
        """Hold the cores for the block (one step)."""
        self.acquire(urgency)
        try:
            yield
        finally:
            self.release()

    def acquire(self, urgency: Urgency) -> None:
        """Wait until this thread holds the cores."""
        with self._cond:
            if not self._held:
                self._held = True
                return
            waiter = Waiter(next(self._seq), urgency)
            self._waiting.append(waiter)
            while not waiter.granted:
                self._cond.wait()

    def release(self) -> None:
        """Hand the cores to the next waiter, or free them."""
        with self._cond:
            if not self._waiting:
                self._held = False
                return
            chosen = next_holder(self._waiting, self.max_skips)
            self._waiting.remove(chosen)
            chosen.granted = True
            self._cond.notify_all()
