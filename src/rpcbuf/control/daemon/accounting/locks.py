"""Byte-range locks inside one buffer: many readers or one writer per range.

Overlapping stores never interleave and a read never sees half a store, while
disjoint ranges run in parallel. Waiters queue first come, first served (granted
only when conflicting with no held lock and no earlier waiter), so readers
cannot starve a writer. ``acquire`` returns a ``LockGrant`` whose ``ready`` fires
when granted.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(eq=False, slots=True)
class LockGrant:
    ranges: list[tuple[int, int]]  # half-open [start, end)
    exclusive: bool
    ready: Callable[[], None] = field(default=lambda: None)
    granted: bool = False

    def conflicts(self, other: LockGrant) -> bool:
        if not (self.exclusive or other.exclusive):
            return False
        return any(a < d and c < b for a, b in self.ranges for c, d in other.ranges)


class RangeLocks:
    __slots__ = ("held", "waiting")

    def __init__(self) -> None:
        self.held: list[LockGrant] = []
        self.waiting: list[LockGrant] = []

    def acquire(self, ranges: list[tuple[int, int]], exclusive: bool,
                ready: Callable[[], None] = lambda: None) -> LockGrant:
        g = LockGrant([(s, e) for s, e in ranges if e > s], exclusive, ready)
        if not self.held and not self.waiting:  # the common case: nobody else here
            g.granted = True
            self.held.append(g)
        elif not any(g.conflicts(h) for h in self.held) and \
                not any(g.conflicts(w) for w in self.waiting):
            g.granted = True
            self.held.append(g)
        else:
            self.waiting.append(g)
        return g

    def release(self, g: LockGrant) -> None:
        """Release a held grant, or withdraw a waiting one (cancellation)."""
        if g.granted and g in self.held:
            self.held.remove(g)
        elif not g.granted and g in self.waiting:
            self.waiting.remove(g)
        else:
            return
        if self.waiting:
            self._wake()

    def _wake(self) -> None:
        still: list[LockGrant] = []
        for w in self.waiting:
            blocked = any(w.conflicts(h) for h in self.held) or \
                any(w.conflicts(e) for e in still)
            if blocked:
                still.append(w)
            else:
                w.granted = True
                self.held.append(w)
                w.ready()
        self.waiting = still

    @property
    def idle(self) -> bool:
        return not self.held and not self.waiting
