"""The responses ``/v1/responses`` keeps for ``previous_response_id``: bounded in count and
in age.

A stored response is the conversation it ended (its input and output as chat messages,
without its ``instructions``, which a continuation does not inherit). At most ``capacity``
are kept, each for ``ttl_s`` seconds; a new one past the capacity evicts the oldest.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from infer.api.messages import ChatMessage


@dataclass(frozen=True)
class Stored:
    """A response's conversation, and when it was stored (on the store's clock)."""

    messages: tuple[ChatMessage, ...]
    at: float


class ResponseStore:
    """Responses by id, oldest first.

    Args:
        capacity: Most responses kept.
        ttl_s: Seconds a response stays retrievable.
        clock: Seconds, monotonic (tests pass their own).
    """

    def __init__(
        self, capacity: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.capacity = capacity
        self.ttl_s = ttl_s
        self._clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(self, response_id: str, messages: Sequence[ChatMessage]) -> None:
        """Keep a response's conversation, evicting the oldest past the capacity."""
        self._expire()
        self._items[response_id] = Stored(tuple(messages), self._clock())
        self._items.move_to_end(response_id)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[ChatMessage, ...] | None:
        """A stored response's conversation; ``None`` if unknown or expired."""
        self._expire()
        stored = self._items.get(response_id)
        return stored.messages if stored is not None else None

    def _expire(self) -> None:
        cutoff = self._clock() - self.ttl_s
        while self._items:
            oldest = next(iter(self._items.values()))
            if oldest.at > cutoff:
                return
            self._items.popitem(last=False)
