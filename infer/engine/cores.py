"""The one scheduler of the cores: which model's step runs next, when several want to.

Each served model has its own thread (its engine's loop, or its embedder's), and one step of
any of them already fills every core: two at once would only slow both, and each thread's
OpenMP team would wait on the other's. So every step holds :class:`Cores` while it runs.

The cores go to the first waiter of the most urgent class (:class:`Urgency`): latency-bound
work (a prompt to prefill: a first token is awaited; a code completion, whose every token
is) before throughput-bound work (the 40th token of a long answer, a large embedding batch).
A thread whose next step is latency-bound too *keeps* the cores while it hands its outputs to
the event loop (``release(keep=True)``), unless a waiter ranks before it; a thread that
releases without keeping hands them to the next waiter, and cannot take them back while
others wait. A throughput waiter that later arrivals (or a keeper) have gone before
``max_skips`` times is served as if it were latency-bound, so none starves; and cores kept
but not taken back within ``keep_s`` (the keeper stopped) go to the next waiter.
"""

from __future__ import annotations

import itertools
import threading
import time
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
    skipped: int = 0  # turns that went to a later arrival meanwhile
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


def outranks_keeper(waiting: Sequence[Waiter], max_skips: int) -> bool:
    """Whether a waiter goes before a latency-bound thread that would keep the cores (which
    ranks as a latency-bound arrival now); if none does, each counts one skip."""
    if any(w.rank(max_skips)[0] == Urgency.LATENCY for w in waiting):
        return True
    for w in waiting:
        w.skipped += 1
    return False


class Cores:
    """A lock over the machine's cores, granted by urgency, then arrival (see the module).

    Args:
        max_skips: How many later arrivals may go before a throughput waiter.
        keep_s: How long kept cores wait for their keeper before going to a waiter.
    """

    def __init__(self, max_skips: int = 4, keep_s: float = 0.02) -> None:
        if max_skips < 1:
            raise ValueError(f"max_skips must be >= 1, got {max_skips}")
        self.max_skips = max_skips
        self.keep_s = keep_s
        self._cond = threading.Condition()
        self._holder: int | None = None  # the thread holding or keeping the cores
        self._kept_until: float | None = None  # kept: until when
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
        me = threading.get_ident()
        with self._cond:
            if self._holder is None or (self._holder == me and self._kept_until is not None):
                self._holder, self._kept_until = me, None
                return
            waiter = Waiter(next(self._seq), urgency)
            self._waiting.append(waiter)
            while not waiter.granted:
                kept = self._kept_until
                if kept is not None and time.monotonic() >= kept:
                    self._hand_on()  # the keeper did not come back
                    continue
                self._cond.wait(None if kept is None else max(kept - time.monotonic(), 0.0))
            self._holder = me

    def release(self, keep: bool = False) -> None:
        """Hand the cores to the next waiter, or free them.

        Args:
            keep: This thread steps again at once, latency-bound: it keeps the cores unless
                a waiter ranks before it (it must take them back, or :meth:`forfeit` them).
        """
        with self._cond:
            if keep and not outranks_keeper(self._waiting, self.max_skips):
                self._kept_until = time.monotonic() + self.keep_s
                return
            self._hand_on()

    def forfeit(self) -> None:
        """Hand on the cores if this thread keeps them (it will not step again)."""
        with self._cond:
            if self._holder == threading.get_ident() and self._kept_until is not None:
                self._hand_on()

    def _hand_on(self) -> None:
        self._kept_until = None
        if not self._waiting:
            self._holder = None
            return
        chosen = next_holder(self._waiting, self.max_skips)
        self._waiting.remove(chosen)
        chosen.granted = True
        self._holder = -1  # the chosen thread sets its own id once it wakes
        self._cond.notify_all()
