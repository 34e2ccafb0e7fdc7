"""Requests waiting for memory: a ``Waiter`` per request, and per device the
``Queues`` that serve them fairly (a FIFO per tenant, every waiter also in
arrival order so the oldest is found at once; removal is O(1): both are
insertion-ordered dicts keyed by the waiter itself).  ``registry.Registry``
decides who is served (round-robin, passing heads that do not fit, until the
oldest has waited ``AGING`` and the free bytes would serve it: ``_holding``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rpcbuf.control.wire.errors import RpcBufError

if TYPE_CHECKING:
    from rpcbuf.control.daemon.accounting.buffers import Buffer, Pool

AGING = 5.0  # seconds after which the oldest waiter may hold the others back (``_holding``)
MAX_WAITERS = 64  # requests one tenant may have waiting for memory, per device


@dataclass(eq=False)
class Waiter:
    """A request_buffer waiting for memory; ``done`` is called exactly once.
    Compared and hashed by identity: it is the key of its queues."""

    tenant: str
    pool: Pool
    size: int
    options: dict[str, Any]
    done: Callable[[Buffer | None, RpcBufError | None], None]
    since: float = 0.0  # time.monotonic() when it was queued
    reserved: int = 0  # its block size, counted against the tenant's quota while it waits


class Queues:
    """The waiters of one device: a FIFO per tenant, and every waiter in
    arrival order (the oldest first), both O(1) to remove from."""

    __slots__ = ("by_tenant", "order", "turn")

    def __init__(self) -> None:
        self.by_tenant: dict[str, dict[Waiter, None]] = {}
        self.order: dict[Waiter, None] = {}
        self.turn = 0  # round-robin position among the tenants

    def __len__(self) -> int:
        return len(self.order)

    def add(self, w: Waiter) -> None:
        self.by_tenant.setdefault(w.tenant, {})[w] = None
        self.order[w] = None

    def remove(self, w: Waiter) -> bool:
        """Take ``w`` out; False when it was not queued (served or gone)."""
        if w not in self.order:
            return False
        del self.order[w]
        mine = self.by_tenant[w.tenant]
        del mine[w]
        if not mine:
            del self.by_tenant[w.tenant]
        return True

    def oldest(self) -> Waiter | None:
        return next(iter(self.order), None)

    def aged(self) -> Waiter | None:
        """The oldest waiter once it has waited ``AGING`` (the registry decides
        whether it holds the others back: ``Registry._holding``)."""
        w = self.oldest()
        return w if w is not None and time.monotonic() - w.since >= AGING else None

    def heads(self) -> list[Waiter]:
        """Each tenant's first waiter, round-robin from this turn's tenant."""
        heads = [next(iter(q)) for q in self.by_tenant.values()]
        k = self.turn % len(heads) if heads else 0
        return heads[k:] + heads[:k]
