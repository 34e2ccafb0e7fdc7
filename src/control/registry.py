"""The buffer registry: who owns which slice of which arena, and for how long.

Plain synchronous code (decide here, do I/O in the daemon): allocation with
quotas, lookup by unguessable id scoped to a tenant, leases, session-scoped
buffers, pins that keep memory alive while UCX may still touch it, and the
fair first-come-first-served queue of requests waiting for memory.

A buffer leaves the tenant's view the moment it is released or expires, but
its memory goes back to the allocator only when its last transfer has
finished (``pins == 0``): memory is never handed to another buffer while UCX
may still write into it.
"""

from __future__ import annotations

import base64
import heapq
import itertools
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dataplane.allocator import Allocator, make_allocator
from dataplane.arena import Arena

from .errors import BadRequest, NotFound, OutOfMemory, QuotaExceeded, RpcBufError, UnsupportedDevice
from .locks import RangeLocks


@dataclass
class Pool:
    """One device: its arena and the allocator that carves it."""

    key: str
    arena: Arena
    allocator: Allocator

    @classmethod
    def create(cls, arena: Arena, allocator: str) -> Pool:
        kind = getattr(arena, "kind", arena.device_type.lower())  # GPU arenas: "cuda"
        return cls(f"{kind}:{arena.device}", arena,
                   make_allocator(allocator, arena.size))

    def describe(self) -> dict[str, Any]:
        st = self.allocator.stats()
        return {
            **self.arena.describe(),
            "key": self.key,
            "allocator": self.allocator.name,
            "total": st.total,
            "used": st.used,
            "free": st.free,
            "largest_free": st.largest_free,
            "buffers": st.count,
        }


@dataclass
class Buffer:
    buffer_id: str
    tenant: str
    pool: Pool
    offset: int
    size: int
    alloc_size: int
    name: str | None
    session_id: str | None  # set only for session-scoped buffers
    ttl: float | None
    created_at: float
    expires_at: float | None
    tensors: dict[str, Any] = field(default_factory=dict)
    manifest_version: int = 0  # bumped by every manifest change
    tensors_end: int = 0  # where new slots go: the end of the highest slot ever recorded
    locks: RangeLocks = field(default_factory=RangeLocks)
    pins: int = 0
    released: bool = False

    def meta(self, tensors: bool = True) -> dict[str, Any]:
        return {
            "buffer_id": self.buffer_id,
            "name": self.name,
            "size": self.size,
            "alloc_size": self.alloc_size,
            "device_type": self.pool.arena.device_type,
            "device": self.pool.arena.device,
            "base_addr": self.offset,
            "tenant": self.tenant,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "ttl": self.ttl,
            "session_scoped": self.session_id is not None,
            "tensors": self.tensors if tensors else None,
            "tensor_count": len(self.tensors),
            "tensors_end": self.tensors_end,
            "manifest_version": self.manifest_version,
        }


_ID_BYTES = 18  # a buffer id is "b-" + 24 base64url characters: 144 random bits
_ID_CHARS = _ID_BYTES * 4 // 3  # 18 bytes are whole base64 groups: no padding, no spill


class _Ids:
    """Unguessable buffer ids, as ``"b-" + secrets.token_urlsafe(18)`` makes
    them (the same CSPRNG, the same 144 bits each), drawn from the OS and
    base64-encoded 256 at a time instead of one syscall and one encode each."""

    BATCH = 256

    def __init__(self) -> None:
        self._text = ""
        self._at = 0

    def next(self) -> str:
        at = self._at
        if at >= len(self._text):
            self._text = base64.urlsafe_b64encode(os.urandom(_ID_BYTES * self.BATCH)).decode()
            at = 0
        self._at = at + _ID_CHARS
        return "b-" + self._text[at:at + _ID_CHARS]


@dataclass(frozen=True)
class Quota:
    bytes_per_device: int | None = None
    buffers: int | None = None


@dataclass
class Waiter:
    """A request_buffer waiting for memory; ``done`` is called exactly once."""

    tenant: str
    pool: Pool
    size: int
    options: dict[str, Any]
    done: Callable[[Buffer | None, RpcBufError | None], None]


class Registry:
    def __init__(self, pools: list[Pool], quotas: dict[str, Quota] | None = None,
                 default_quota: Quota | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.pools = {p.key: p for p in pools}
        self.quotas = quotas or {}
        self.default_quota = default_quota or Quota()
        self.clock = clock
        self._buffers: dict[str, Buffer] = {}
        self._names: dict[tuple[str, str], str] = {}
        self._tenant_bytes: dict[tuple[str, str], int] = {}
        self._tenant_count: dict[str, int] = {}
        self._waiters: dict[str, deque[Waiter]] = {k: deque() for k in self.pools}
        self._expiries: list[tuple[float, int, str]] = []
        self._seq = itertools.count()
        self._ids = _Ids()
        self._pool_keys: dict[tuple[str, int], Pool] = {}  # (device_type, device) -> pool
        self.expired_total = 0

    # -- lookup ---------------------------------------------------------------

    def pool_for(self, device_type: str, device: int) -> Pool:
        pool = self._pool_keys.get((device_type, device))
        if pool is not None:
            return pool
        kind = device_type.lower()
        kind = {"gpu": "cuda"}.get(kind, kind)
        key = f"{kind}:{device}"
        if key not in self.pools:
            raise UnsupportedDevice(
                f"this node has no {device_type} device {device}",
                {"devices": sorted(self.pools)},
            )
        pool = self._pool_keys[(device_type, device)] = self.pools[key]
        return pool

    def get(self, tenant: str, buffer_id: str) -> Buffer:
        buf = self._buffers.get(buffer_id)
        if buf is None or buf.tenant != tenant:
            # Same answer for "never existed" and "someone else's": no hint leaks.
            raise NotFound(f"no buffer {buffer_id!r}")
        return buf

    def by_name(self, tenant: str, name: str) -> Buffer:
        bid = self._names.get((tenant, name))
        if bid is None:
            raise NotFound(f"no buffer named {name!r}")
        return self._buffers[bid]

    def buffers_of(self, tenant: str) -> list[Buffer]:
        return [b for b in self._buffers.values() if b.tenant == tenant]

    # -- allocation -----------------------------------------------------------

    def quota_for(self, tenant: str) -> Quota:
        return self.quotas.get(tenant, self.default_quota)

    def _check_quota(self, tenant: str, pool: Pool, size: int) -> None:
        q = self.quota_for(tenant)
        alloc = pool.allocator.block_size(size)
        used = self._tenant_bytes.get((tenant, pool.key), 0)
        if q.bytes_per_device is not None and used + alloc > q.bytes_per_device:
            raise QuotaExceeded(
                f"tenant {tenant!r} would hold {used + alloc} bytes on {pool.key}, "
                f"quota is {q.bytes_per_device}",
                {"requested": alloc, "used": used, "quota": q.bytes_per_device},
            )
        count = self._tenant_count.get(tenant, 0)
        if q.buffers is not None and count + 1 > q.buffers:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds {count} buffers, quota is {q.buffers}",
                {"buffers": count, "quota": q.buffers},
            )

    def _validate(self, tenant: str, pool: Pool, size: int, name: str | None) -> None:
        if size <= 0:
            raise BadRequest("size must be positive")
        if size > pool.allocator.max_size:
            raise OutOfMemory(
                f"{size} bytes can never fit on {pool.key} (largest possible buffer: "
                f"{pool.allocator.max_size} bytes)",
                self._oom_details(pool, size),
            )
        if name is not None and (tenant, name) in self._names:
            raise BadRequest(f"a buffer named {name!r} already exists", {"name": name})
        self._check_quota(tenant, pool, size)

    def _oom_details(self, pool: Pool, size: int) -> dict[str, Any]:
        st = pool.allocator.stats()
        return {"requested": size, "free": st.free, "largest_free": st.largest_free,
                "device": pool.key}

    def try_allocate(self, tenant: str, pool: Pool, size: int, *, name: str | None = None,
                     ttl: float | None = None, session_id: str | None = None) -> Buffer | None:
        """Allocate now, or return None when the caller must wait (pool full or
        others already queued: first come, first served). Raises on bad input."""
        self._validate(tenant, pool, size, name)
        if self._waiters[pool.key]:
            return None
        return self._allocate(tenant, pool, size, name, ttl, session_id)

    def _allocate(self, tenant: str, pool: Pool, size: int, name: str | None,
                  ttl: float | None, session_id: str | None) -> Buffer | None:
        offset = pool.allocator.allocate(size)
        if offset is None:
            return None
        now = self.clock()
        buf = Buffer(
            buffer_id=self._ids.next(),
            tenant=tenant, pool=pool, offset=offset, size=size,
            alloc_size=pool.allocator.block_size(size), name=name,
            session_id=session_id if name is None and ttl is None else None,
            ttl=ttl, created_at=now, expires_at=None if ttl is None else now + ttl,
        )
        self._buffers[buf.buffer_id] = buf
        if name is not None:
            self._names[(tenant, name)] = buf.buffer_id
        key = (tenant, pool.key)
        self._tenant_bytes[key] = self._tenant_bytes.get(key, 0) + buf.alloc_size
        self._tenant_count[tenant] = self._tenant_count.get(tenant, 0) + 1
        if buf.expires_at is not None:
            heapq.heappush(self._expiries, (buf.expires_at, next(self._seq), buf.buffer_id))
        return buf

    def enqueue(self, waiter: Waiter) -> None:
        self._waiters[waiter.pool.key].append(waiter)

    def cancel(self, waiter: Waiter) -> None:
        """Remove a waiter that gave up (timeout, cancellation, disconnect)."""
        queue = self._waiters[waiter.pool.key]
        if waiter in queue:
            queue.remove(waiter)
            self._grant(waiter.pool)  # the head may have changed

    def waiting(self, pool: Pool) -> int:
        return len(self._waiters[pool.key])

    def out_of_memory(self, pool: Pool, size: int) -> OutOfMemory:
        return OutOfMemory(f"no {size}-byte block free on {pool.key}",
                           self._oom_details(pool, size))

    def _grant(self, pool: Pool) -> None:
        queue = self._waiters[pool.key]
        while queue:
            w = queue[0]
            try:
                self._validate(w.tenant, pool, w.size, w.options.get("name"))
            except RpcBufError as exc:
                queue.popleft()
                w.done(None, exc)
                continue
            buf = self._allocate(w.tenant, pool, w.size, **w.options)
            if buf is None:
                return  # the head still does not fit: nobody jumps the queue
            queue.popleft()
            w.done(buf, None)

    # -- release, pins, leases ------------------------------------------------

    def release(self, buf: Buffer) -> None:
        """Take the buffer out of every view; free its memory once unpinned."""
        if buf.released:
            return
        buf.released = True
        del self._buffers[buf.buffer_id]
        if buf.name is not None:
            self._names.pop((buf.tenant, buf.name), None)
        if buf.pins == 0:
            self._free(buf)

    def pin(self, buf: Buffer) -> None:
        buf.pins += 1

    def unpin(self, buf: Buffer) -> None:
        buf.pins -= 1
        if buf.pins == 0 and buf.released:
            self._free(buf)

    def _free(self, buf: Buffer) -> None:
        buf.pool.allocator.free(buf.offset)
        key = (buf.tenant, buf.pool.key)
        self._tenant_bytes[key] -= buf.alloc_size
        self._tenant_count[buf.tenant] -= 1
        self._grant(buf.pool)

    def renew(self, buf: Buffer, ttl: float | None) -> None:
        ttl = buf.ttl if ttl is None else ttl
        if ttl is None:
            return  # no lease to renew: the buffer lives until released
        buf.ttl = ttl
        buf.session_id = None  # a leased buffer outlives its session
        buf.expires_at = self.clock() + ttl
        heapq.heappush(self._expiries, (buf.expires_at, next(self._seq), buf.buffer_id))

    def next_expiry(self) -> float | None:
        while self._expiries:
            when, _, bid = self._expiries[0]
            buf = self._buffers.get(bid)
            if buf is not None and buf.expires_at == when:
                return when
            heapq.heappop(self._expiries)  # stale: released or renewed
        return None

    def expire(self) -> list[Buffer]:
        """Release every buffer whose lease has run out; return them."""
        now = self.clock()
        out: list[Buffer] = []
        while (when := self.next_expiry()) is not None and when <= now:
            _, _, bid = heapq.heappop(self._expiries)
            buf = self._buffers[bid]
            self.release(buf)
            self.expired_total += 1
            out.append(buf)
        return out

    def session_closed(self, session_id: str) -> list[Buffer]:
        doomed = [b for b in self._buffers.values() if b.session_id == session_id]
        for b in doomed:
            self.release(b)
        return doomed

    def stats(self) -> dict[str, Any]:
        return {
            "buffers": len(self._buffers),
            "waiters": {k: len(q) for k, q in self._waiters.items()},
            "expired_total": self.expired_total,
            "devices": [p.describe() for p in self.pools.values()],
        }

    def tenant_usage(self) -> dict[str, Any]:
        """What each tenant holds (what quotas count, so memory still pinned by a
        transfer after release is included): buffers per tenant, bytes per
        (tenant, device)."""
        return {"buffers": {t: n for t, n in self._tenant_count.items() if n},
                "bytes": {k: n for k, n in self._tenant_bytes.items() if n}}
