"""When leases run out: one heap of expiry times, for buffers and blocks alike.
The owner says what a key's lease is now (``current``), so a renew or release
leaves a stale entry the heap skips; past twice the live leases (and ``FLOOR``)
it is rebuilt from ``live``, so a storm of renews cannot grow it.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
FLOOR = 1024  # stale entries allowed beyond twice the live leases


class Leases(Generic[K]):
    def __init__(self, current: Callable[[K], float | None],
                 live: Callable[[], Iterable[tuple[K, float]]]) -> None:
        self._current, self._live = current, live
        self._heap: list[tuple[float, int, K]] = []
        self._seq = itertools.count()
        self.count = 0  # live leases (the owner counts them: begun, ended)

    def push(self, key: K, when: float) -> None:
        """``key``'s lease runs out at ``when`` now (new or renewed)."""
        heapq.heappush(self._heap, (when, next(self._seq), key))
        if len(self._heap) > 2 * self.count + FLOOR:
            self._heap = [(w, next(self._seq), k) for k, w in self._live()]
            heapq.heapify(self._heap)

    def next(self) -> float | None:
        """When the next live lease runs out (None: none left)."""
        heap = self._heap
        while heap:
            when, _, key = heap[0]
            if self._current(key) == when:
                return when
            heapq.heappop(heap)  # stale: renewed, released, replaced
        return None

    def due(self, now: float) -> Iterator[tuple[K, float]]:
        """Each key whose lease ran out by ``now``, and when, popped."""
        while (when := self.next()) is not None and when <= now:
            _, _, key = heapq.heappop(self._heap)
            yield key, when
