"""Requests waiting for memory on one device, and who is served next.

- Each tenant has a FIFO; every waiter is also kept in arrival order. Both are
  insertion-ordered dicts keyed by the waiter, so removal is O(1).
- Heads are served round-robin; a head that does not fit is passed by ones that do.
- Once the oldest has waited ``AGING``, nobody passes it while the free bytes would
  serve it, for at most ``AGING`` more (``holding``). A waiter that needs memory
  other tenants hold holds nobody back: another tenant's waiter never makes a
  request wait or fail, nor a block put evict (docs/security.md).
- A waiter's block size is ``reserved`` against its tenant's quota while it waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rpcbuf.control.wire.errors import RpcBufError

if TYPE_CHECKING:
    from rpcbuf.control.daemon.accounting.buffers import Buffer, Pool

AGING = 5.0  # seconds after which the oldest waiter may hold the others back (``holding``)
MAX_WAITERS = 64  # requests one tenant may have waiting for memory, per device


@dataclass(eq=False)
class Waiter:
    """A request_buffer waiting for memory; ``done`` is called exactly once.
    Hashed by identity: it is the key of its queues."""

    tenant: str
    pool: Pool
    size: int
    options: dict[str, Any]
    done: Callable[[Buffer | None, RpcBufError | None], None]
    since: float = 0.0  # time.monotonic() when it was queued
    reserved: int = 0  # its block size, counted against the tenant's quota while it waits


class Queues:
    __slots__ = ("by_tenant", "order", "pool", "reserved", "turn")

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.by_tenant: dict[str, dict[Waiter, None]] = {}
        self.order: dict[Waiter, None] = {}
        self.reserved: dict[str, int] = {}  # bytes each tenant's waiters reserve
        self.turn = 0  # round-robin position among the tenants

    def __len__(self) -> int:
        return len(self.order)

    def add(self, w: Waiter) -> None:
        w.reserved = self.pool.allocator.block_size(w.size)
        w.since = time.monotonic()
        self.reserved[w.tenant] = self.reserved.get(w.tenant, 0) + w.reserved
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
        self.reserved[w.tenant] -= w.reserved
        if not self.reserved[w.tenant]:
            del self.reserved[w.tenant]
        return True

    def aged(self) -> Waiter | None:
        """The oldest waiter once it has waited ``AGING``."""
        w = next(iter(self.order), None)
        return w if w is not None and time.monotonic() - w.since >= AGING else None

    def holding(self) -> Waiter | None:
        """The aged oldest waiter while it holds everyone else back (see the module)."""
        w = self.aged()
        if w is None or time.monotonic() - w.since >= 2 * AGING:
            return None
        return w if w.reserved <= self.pool.allocator.stats().free else None

    def ahead(self, tenant: str) -> bool:
        """Whether a new request of ``tenant`` must queue behind others (its own
        requests wait, or an aged waiter holds everyone back)."""
        return bool(self.order) and (tenant in self.by_tenant or self.holding() is not None)

    def heads(self) -> list[Waiter]:
        """Each tenant's first waiter, round-robin from this turn's tenant."""
        heads = [next(iter(q)) for q in self.by_tenant.values()]
        k = self.turn % len(heads) if heads else 0
        return heads[k:] + heads[:k]

    def grant(self, serve: Callable[[Waiter], bool]) -> None:
        """Serve what fits (``serve``: False when it does not fit yet): the aged
        waiter alone while it holds the rest back, else each head in turn."""
        while self.order:
            aged = self.holding()
            if aged is not None:
                if not serve(aged):
                    return  # it still does not fit: nobody passes it now
                continue
            served = False
            for w in self.heads():
                if serve(w):
                    served = True
                    self.turn += 1
            if not served:
                return

    def cancel(self, w: Waiter, serve: Callable[[Waiter], bool]) -> None:
        """Remove a waiter that gave up. No memory came free, so serve everyone
        if it was the aged waiter, else its tenant's next if it was the head."""
        was_aged = self.aged() is w
        mine = self.by_tenant.get(w.tenant)
        was_head = mine is not None and next(iter(mine)) is w
        if not self.remove(w):
            return
        if was_aged:
            self.grant(serve)
        elif was_head and self.holding() is None:
            mine = self.by_tenant.get(w.tenant)
            if mine:
                serve(next(iter(mine)))
