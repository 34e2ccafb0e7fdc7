"""A client-side pool of remote buffers, reused instead of released.

``acquire`` hands out the smallest idle buffer of at least ``size`` and at
most ``max_slack`` times it (binary search per device), else asks the
daemon.  Bookkeeping is synchronous and done before any await, so a
cancelled call never leaves the pool inconsistent.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rpcbuf.control.wire.errors import BadRequest

if TYPE_CHECKING:
    from rpcbuf.control.client.context import RpcContext


@dataclass
class PoolStatistics:
    hits: int = 0
    misses: int = 0
    idle: int = 0
    in_use: int = 0
    held_bytes: int = 0


class BufferPool:
    """A pool of one context's buffers.  ``max_slack`` >= 1.0 (else
    BAD_REQUEST); ``ttl``: each new buffer's lease."""

    def __init__(self, ctx: RpcContext, max_slack: float = 2.0, ttl: float | None = None) -> None:
        if max_slack < 1.0:
            raise BadRequest("max_slack must be >= 1.0")
        self._ctx = ctx
        self.max_slack = max_slack
        self.ttl = ttl
        self._idle: dict[tuple[str, int], list[tuple[int, str]]] = {}  # sorted (size, id)
        self._owned: dict[str, tuple[tuple[str, int], int]] = {}  # id -> (device, size)
        self._in_use: set[str] = set()
        self._stats = PoolStatistics()

    async def __aenter__(self) -> BufferPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def acquire(self, size: int, device_type: str = "CPU", device: int = 0,
                      timeout: float | None = None) -> str:
        """A buffer id of at least ``size`` bytes.  Raises BAD_REQUEST, and what
        ``request_buffer`` raises."""
        if not isinstance(size, int) or size <= 0:
            raise BadRequest(f"size must be a positive int, got {size!r}")
        key = (device_type.upper(), device)
        idle = self._idle.get(key, [])
        i = bisect.bisect_left(idle, (size, ""))
        if i < len(idle) and idle[i][0] <= size * self.max_slack:
            _, buffer_id = idle.pop(i)
            self._in_use.add(buffer_id)
            self._stats.hits += 1
            return buffer_id
        self._stats.misses += 1
        buffer_id = await self._ctx.request_buffer(size, device_type=device_type, device=device,
                                                   timeout=timeout, ttl=self.ttl)
        self._owned[buffer_id] = (key, size)
        self._in_use.add(buffer_id)
        return buffer_id

    def release(self, buffer_id: str) -> None:
        """Give a buffer back to the pool.  Raises BAD_REQUEST for an id not
        handed out or already released."""
        if buffer_id not in self._in_use:
            raise BadRequest(f"buffer {buffer_id!r} is not in use from this pool")
        self._in_use.discard(buffer_id)
        key, size = self._owned[buffer_id]
        bisect.insort(self._idle.setdefault(key, []), (size, buffer_id))

    async def trim(self) -> int:
        """Release every idle buffer to the daemon; return how many.  A failed
        release raises, and the rest stay idle in the pool."""
        released = 0
        while self._idle:
            key, idle = next(iter(self._idle.items()))
            if not idle:  # every buffer of that device was handed out again (``acquire``)
                del self._idle[key]
                continue
            _, buffer_id = idle.pop()
            del self._owned[buffer_id]
            await self._ctx.release_buffer(buffer_id)
            released += 1
        return released

    async def close(self) -> None:
        """Release every buffer held, in use or idle, as ``trim`` does."""
        await self.trim()
        while self._in_use:
            buffer_id = self._in_use.pop()
            del self._owned[buffer_id]
            await self._ctx.release_buffer(buffer_id)

    def statistics(self) -> PoolStatistics:
        """Hits, misses, buffers idle and in use, bytes held (as asked for)."""
        idle = sum(len(v) for v in self._idle.values())
        held = sum(size for _, size in self._owned.values())
        return PoolStatistics(self._stats.hits, self._stats.misses, idle, len(self._in_use),
                              held)

    def __repr__(self) -> str:
        s: Any = self.statistics()
        return f"<BufferPool idle={s.idle} in_use={s.in_use} hits={s.hits} misses={s.misses}>"
