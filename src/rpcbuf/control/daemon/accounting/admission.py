"""Bounded room for peers that have not proven who they are yet (a connection
before its hello, a UCX endpoint before it binds).

``Pending`` bounds them in total and per source without turning a newcomer away:
at a bound the oldest pending peer (of that source first) is dropped. A parked
attacker only evicts its own older peers; a tenant, whose hello follows within a
round trip, gets in. It decides who goes; the caller closes them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class Pending(Generic[T]):
    """Peers in arrival order, at most ``limit`` in all and ``per_source`` from one."""

    def __init__(self, limit: int, per_source: int | None = None) -> None:
        if limit < 1 or (per_source is not None and per_source < 1):
            raise ValueError("limits must be at least 1")
        self.limit = limit
        self.per_source = per_source
        self._peers: OrderedDict[T, Hashable] = OrderedDict()  # peer -> source, oldest first
        self._by_source: dict[Hashable, OrderedDict[T, None]] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def __contains__(self, peer: object) -> bool:
        return peer in self._peers

    def add(self, peer: T, source: Hashable = None) -> list[T]:
        """Admit ``peer``; return the peers it displaces (removed here), oldest first."""
        out: list[T] = []
        mine = self._by_source.get(source)
        if self.per_source is not None and mine is not None and len(mine) >= self.per_source:
            oldest = next(iter(mine))
            self.discard(oldest)
            out.append(oldest)
        if len(self._peers) >= self.limit:
            oldest = next(iter(self._peers))
            self.discard(oldest)
            out.append(oldest)
        self._peers[peer] = source
        self._by_source.setdefault(source, OrderedDict())[peer] = None
        return out

    def largest_source(self) -> int:
        """How many peers the source with the most has (metrics: no source named)."""
        return max((len(m) for m in self._by_source.values()), default=0)

    def discard(self, peer: T) -> None:
        """``peer`` proved itself or went away (idempotent)."""
        if peer not in self._peers:
            return
        source = self._peers.pop(peer)
        mine = self._by_source[source]
        del mine[peer]
        if not mine:
            del self._by_source[source]
