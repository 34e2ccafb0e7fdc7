"""The buffer registry: who owns which slice of which arena, and for how long.

Plain synchronous code (decide here, do I/O in the daemon): allocation against
quotas, lookup by unguessable id scoped to a tenant, leases, session-scoped buffers,
pins, and the queues of requests waiting for memory (``waiters.py``).

- A buffer leaves the tenant's view when released or expired; its block goes back
  to the allocator only when unpinned (``pins == 0``), so memory is never handed on
  while UCX may still write into it. A block is freed at most once, only by the
  buffer that owns it, and a freed buffer cannot be pinned again.
- Charged to the tenant in its ``Books``, checked before anything changes: bytes
  per device (with its waiters' reserved bytes), its N buffers, ``ENTRY_BYTES`` per
  manifest entry, and for a host block an fd and a mapping (a byte quota alone let
  4 KiB blocks take all the daemon's fds).
- A segment of the KV tier is a buffer charged bytes, an fd and a mapping but not
  one of the N; a block is a light buffer over a slot of one (one of the N, nothing
  else charged), freed back into its segment (``on_block_free``), never to the allocator.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from rpcbuf.control.daemon.accounting.backing import kept_block, lock_until_zeroed, share_of
from rpcbuf.control.daemon.accounting.books import ENTRY_BYTES, Books
from rpcbuf.control.daemon.accounting.buffers import Buffer, Ids, Pool, Quota
from rpcbuf.control.daemon.accounting.charges import Charges
from rpcbuf.control.daemon.accounting.lapsed import Lapsed
from rpcbuf.control.daemon.accounting.leases import Leases
from rpcbuf.control.daemon.accounting.waiters import AGING, MAX_WAITERS, Queues, Waiter
from rpcbuf.control.wire.errors import (
    BadRequest,
    NotFound,
    OutOfMemory,
    QuotaExceeded,
    RpcBufError,
    UnsupportedDevice,
)
from rpcbuf.control.wire.units import format_size
from rpcbuf.dataplane.arena import host_memory
from rpcbuf.dataplane.cuda_vmm import CudaError

__all__ = ["AGING", "ENTRY_BYTES", "MAX_WAITERS", "Buffer", "Pool", "Quota", "Registry",
           "Waiter"]  # the registry's vocabulary, defined in buffers.py and waiters.py

log = logging.getLogger("rpcbuf.daemon")
SEGMENT_KEY = "\0segment"  # a segment's ``block_key``: hidden like a block, never a key


def oom_sentence(device: str, size: int, block: int, largest: int, free: int) -> str:
    """What fits, not only what is free, and the allocator's rounding where it bites."""
    rounded = f" (it takes a block of {format_size(block)})" if block > size * 1.01 else ""
    return (f"no room for {format_size(size)}{rounded} on {device}: the largest free block "
            f"is {format_size(largest)} ({format_size(free)} free in all)")


class Registry:
    def __init__(self, pools: list[Pool], quotas: dict[str, Quota] | None = None,
                 default_quota: Quota | None = None,
                 clock: Callable[[], float] = time.time,
                 charges: Charges | None = None) -> None:
        self.pools = {p.key: p for p in pools}
        self.books = Books(quotas, default_quota, charges, self._reserved)
        self.charges = self.books.charges
        self.clock = clock
        self._buffers: dict[str, Buffer] = {}
        self._names: dict[tuple[str, str], str] = {}
        self.records_peak = 0  # the most ``len(self)`` has been (``_grew``)
        self._waiters: dict[str, Queues] = {k: Queues(p) for k, p in self.pools.items()}
        self._leases: Leases[str] = Leases(self._expires_at, self._live_leases)
        self._ids = Ids()
        self._pool_keys: dict[tuple[str, int], Pool] = {}  # (device_type, device) -> pool
        self.expired_total = 0
        self._expired_by: dict[str, int] = {}
        self._lapsed = Lapsed(self.clock)  # leases that ran out: NOT_FOUND says so
        # The block store's hooks: a block's first pin taken (True) or last one
        # dropped (False); a block's slot free again; no live session holds an fd.
        self.on_pin: Callable[[Buffer, bool], None] | None = None
        self.on_block_free: Callable[[Buffer], None] | None = None
        self.on_unexported: Callable[[Buffer], None] | None = None

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
        if buf is None or buf.tenant != tenant or buf.block_key is not None:
            # Same answer for "never existed" and "someone else's" (a lapsed
            # lease is told only to its tenant). A block is reached by its key only.
            raise self._lapsed.not_found(tenant, buffer_id, f"no buffer {buffer_id!r}")
        return buf

    def by_name(self, tenant: str, name: str) -> Buffer:
        bid = self._names.get((tenant, name))
        if bid is None:
            raise self._lapsed.not_found(tenant, "=" + name, f"no buffer named {name!r}")
        return self._buffers[bid]

    def __len__(self) -> int:
        """Records held, what the daemon's heap grows with (blocks and counted
        buffers twice: an allowance, generous by design)."""
        return len(self._buffers) + self.books.counted

    def _grew(self) -> None:
        """The heap keeps what it grew to once records are freed, so allowances
        follow the peak, not what is held now."""
        n = len(self)
        if n > self.records_peak:
            self.records_peak = n

    def buffers_of(self, tenant: str) -> list[Buffer]:
        return [b for b in self._buffers.values() if b.tenant == tenant]

    # -- allocation -----------------------------------------------------------

    def _validate(self, tenant: str, pool: Pool, size: int, name: str | None,
                  extra: int = 0, counted: bool = True) -> None:
        if size <= 0:
            raise BadRequest("size must be positive")
        if size > pool.allocator.max_size:
            raise OutOfMemory(
                f"{format_size(size)} can never fit on {pool.key} (largest possible buffer: "
                f"{format_size(pool.allocator.max_size)})",
                pool.oom_details(size),
            )
        if name is not None and (tenant, name) in self._names:
            raise BadRequest(f"a buffer named {name!r} already exists", {"name": name})
        self.books.check(tenant, pool, size, extra, counted=counted)

    def try_allocate(self, tenant: str, pool: Pool, size: int, *, name: str | None = None,
                     ttl: float | None = None, session_id: str | None = None,
                     like: Buffer | None = None) -> Buffer | None:
        """Allocate now, or None when the caller must wait (no block free, or
        others are ahead in the queues). BAD_REQUEST, OUT_OF_MEMORY (never
        fits), QUOTA_EXCEEDED. ``like``: map that buffer's memory (``clone``)."""
        self._validate(tenant, pool, size, name, self._reserved(tenant, pool))
        if self.queued_ahead(tenant, pool):
            return None
        return self._allocate(tenant, pool, size, name, ttl, session_id, like)

    def allocate_segment(self, tenant: str, pool: Pool, size: int) -> Buffer | None:
        """A segment for ``tenant``'s blocks (see the module), as ``try_allocate``."""
        self._validate(tenant, pool, size, None, self._reserved(tenant, pool), counted=False)
        if self.queued_ahead(tenant, pool):
            return None
        buf = self._allocate(tenant, pool, size, None, None, None, counted=False, owned=True)
        if buf is not None:
            buf.block_key = SEGMENT_KEY
        return buf

    def add_block(self, segment: Buffer, offset: int, size: int, alloc_size: int) -> Buffer:
        """A block over ``segment``'s slot ``[offset, offset + alloc_size)``: one
        of the tenant's N, nothing else charged, in no view."""
        tenant = segment.tenant
        self.books.check_count(tenant)
        buf = Buffer(buffer_id=self._ids.next(), tenant=tenant, pool=segment.pool,
                     offset=offset, size=size, alloc_size=alloc_size, name=None,
                     session_id=None, ttl=None, created_at=self.clock(), expires_at=None,
                     block_key="", segment=segment)
        self.books.add_count(tenant, 1)
        self._grew()
        return buf

    def queued_ahead(self, tenant: str, pool: Pool) -> bool:
        """Whether ``try_allocate`` would wait for the queue rather than memory
        (the block tier evicts only when it would not)."""
        return self._waiters[pool.key].ahead(tenant)

    def _reserved(self, tenant: str, pool: Pool) -> int:
        return self._waiters[pool.key].reserved.get(tenant, 0)

    def clone(self, src: Buffer, *, name: str | None = None, ttl: float | None = None,
              session_id: str | None = None) -> Buffer | None:
        """A buffer whose block maps ``src``'s memory (no copy; each gets its own
        before its first write): a ``try_allocate`` whose None means no room now."""
        return self.try_allocate(src.tenant, src.pool, src.size, name=name, ttl=ttl,
                                 session_id=session_id, like=src)

    def _allocate(self, tenant: str, pool: Pool, size: int, name: str | None,
                  ttl: float | None, session_id: str | None,
                  like: Buffer | None = None, counted: bool = True,
                  owned: bool = False) -> Buffer | None:
        # ``owned``: a block segment, which its tenant's same-host sessions may
        # map writable: never a kept memfd.
        host = host_memory(pool.arena) if owned else None
        offset = kept_block(pool, size) if like is None and host is None else None
        if offset is None:
            offset = pool.allocator.allocate(size)
        if offset is None:
            return None
        alloc_size = pool.allocator.block_size(size)
        back = pool.arena.back  # the block's own shareable memory
        if like is not None:
            back = functools.partial(share_of, pool.arena, like)
        elif host is not None:
            back = host.back_owned
        handles = self.books.charge_handles(tenant, pool, offset)
        try:
            zeroing = back(offset, alloc_size)
        except (OSError, CudaError) as exc:  # no memory, no fds left: nothing changed
            self.books.refund_handles(tenant, handles)
            pool.allocator.free(offset)
            log.warning("%s: backing a block of %d bytes failed: %s", pool.key,
                        alloc_size, exc)
            why = getattr(exc, "strerror", None) or exc
            raise OutOfMemory(f"cannot back {format_size(alloc_size)} on {pool.key}: {why}",
                              {**pool.oom_details(size), "reason": "backing"}) from None
        now = self.clock()
        buf = Buffer(
            buffer_id=self._ids.next(),
            tenant=tenant, pool=pool, offset=offset, size=size,
            alloc_size=alloc_size, name=name,
            session_id=session_id if name is None and ttl is None else None,
            ttl=ttl, created_at=now, expires_at=None if ttl is None else now + ttl,
            counted=counted,
        )
        if zeroing is not None:
            lock_until_zeroed(buf, zeroing)
        self._buffers[buf.buffer_id] = buf
        pool.owners[offset] = buf
        if name is not None:
            self._names[(tenant, name)] = buf.buffer_id
        self.books.add(tenant, pool, buf.alloc_size)
        if counted:
            self.books.add_count(tenant, 1)
        self._grew()
        if buf.expires_at is not None:
            self._leases.count += 1
            self._leases.push(buf.buffer_id, buf.expires_at)
        return buf

    def enqueue(self, waiter: Waiter) -> None:
        """Queue a request that must wait. QUOTA_EXCEEDED past ``MAX_WAITERS`` on
        this device, or when its held and waiting bytes would pass its quota."""
        pool, tenant = waiter.pool, waiter.tenant
        queues = self._waiters[pool.key]
        mine = queues.by_tenant.get(tenant)
        if mine is not None and len(mine) >= MAX_WAITERS:
            raise QuotaExceeded(
                f"tenant {tenant!r} has {len(mine)} requests waiting for memory on "
                f"{pool.key} already (at most {MAX_WAITERS})",
                {"limit": "waiters", "waiters": len(mine), "max": MAX_WAITERS})
        self.books.check(tenant, pool, waiter.size, self._reserved(tenant, pool))
        queues.add(waiter)

    def cancel(self, waiter: Waiter) -> None:
        """Remove a waiter that gave up (timeout, cancellation, disconnect)."""
        self._waiters[waiter.pool.key].cancel(waiter, self._serve)

    def waiting(self, pool: Pool, tenant: str | None = None) -> int:
        queues = self._waiters[pool.key]
        if tenant is None:
            return len(queues)
        return len(queues.by_tenant.get(tenant, ()))

    def out_of_memory(self, pool: Pool, size: int) -> OutOfMemory:
        details = pool.oom_details(size)
        return OutOfMemory(oom_sentence(pool.key, size, details["block"],
                                        details["largest_free"], details["free"]), details)

    def _grant(self, pool: Pool) -> None:
        self._waiters[pool.key].grant(self._serve)

    def _serve(self, w: Waiter) -> bool:
        """Allocate for ``w`` (or fail it, when no longer valid); False when it
        does not fit yet."""
        pool = w.pool
        queues = self._waiters[pool.key]
        try:
            self._validate(w.tenant, pool, w.size, w.options.get("name"))
        except RpcBufError as exc:
            queues.remove(w)
            w.done(None, exc)
            return True
        buf = self._allocate(w.tenant, pool, w.size, **w.options)
        if buf is None:
            return False
        queues.remove(w)
        w.done(buf, None)
        return True

    # -- release, pins, leases ------------------------------------------------

    def release(self, buf: Buffer) -> None:
        """Take the buffer out of every view; free its memory once unpinned."""
        if buf.released:
            return
        buf.released = True
        if buf.mapped is not None:  # written in place: the client stops at its next copy
            buf.mapped.end(buf)
            buf.mapped = None
        if self._buffers.get(buf.buffer_id) is buf:
            del self._buffers[buf.buffer_id]
        if buf.name is not None and self._names.get((buf.tenant, buf.name)) == buf.buffer_id:
            del self._names[(buf.tenant, buf.name)]
            self._lapsed.forget_name(buf.tenant, buf.name)  # an older one's lease
        if buf.expires_at is not None:
            self._leases.count -= 1
        if buf.pins == 0:
            self._free(buf)

    def pin(self, buf: Buffer) -> None:
        """Keep ``buf``'s memory until the matching ``unpin``. NOT_FOUND once
        its block went back (it may be another buffer's now)."""
        if buf.freed:
            raise NotFound(f"no buffer {buf.buffer_id!r}")
        buf.pins += 1
        if buf.pins == 1 and buf.block_key and self.on_pin is not None:
            self.on_pin(buf, True)

    def unpin(self, buf: Buffer) -> None:
        if buf.pins <= 0:
            raise RuntimeError(f"unpin of {buf.buffer_id} without a pin")  # a bug: say so
        buf.pins -= 1
        if buf.pins == 0:
            if buf.released:
                self._free(buf)
            elif buf.block_key and self.on_pin is not None:
                self.on_pin(buf, False)

    def _free(self, buf: Buffer) -> None:
        """Give ``buf``'s block back, once, and only if it still owns it."""
        if buf.freed:
            return
        buf.freed = True
        if buf.segment is not None:  # a block: its slot goes back to its segment
            self.books.add_count(buf.tenant, -1)
            if self.on_block_free is not None:
                self.on_block_free(buf)
            return
        pool = buf.pool
        if pool.owners.get(buf.offset) is not buf:
            raise RuntimeError(f"{buf.buffer_id}: block {buf.offset} of {pool.key} "
                               "belongs to another buffer")  # a bug: never free it
        del pool.owners[buf.offset]
        pool.arena.unback(buf.offset, buf.alloc_size)
        if pool.holds_fds:
            self.books.refund_handles(buf.tenant)
        pool.allocator.free(buf.offset)
        # A block handed out by fd stays charged while a session that got it
        # lives: a dup of the fd still pins its pages.
        kept = buf.alloc_size if buf.exported_to else 0
        self.books.add(buf.tenant, pool, kept - buf.alloc_size - buf.entries_charged * ENTRY_BYTES)
        buf.entries_charged = 0
        if buf.counted:
            self.books.add_count(buf.tenant, -1)
        self._grant(pool)

    def charge_entries(self, buf: Buffer, count: int, dry_run: bool = False) -> None:
        self.books.charge_entries(buf, count, dry_run)

    def export(self, buf: Buffer) -> None:
        """A session is handed an fd of ``buf``'s memory (once per session)."""
        buf.exported_to += 1

    def unexport(self, buf: Buffer) -> None:
        """That session ended: a freed block it pinned is no longer charged."""
        if buf.exported_to <= 0:
            raise RuntimeError(f"unexport of {buf.buffer_id} that was not exported")  # a bug
        buf.exported_to -= 1
        if buf.freed and not buf.exported_to:
            self.uncharge(buf.tenant, buf.pool, buf.alloc_size)
        elif not buf.exported_to and self.on_unexported is not None:
            self.on_unexported(buf)  # an empty block segment kept while handed out goes now

    def host_pool(self) -> Pool | None:
        """The first host-memory pool (where memory that is no buffer is
        charged); None on a GPU-only node."""
        return next((p for p in self.pools.values() if host_memory(p.arena) is not None), None)

    def charge(self, tenant: str, pool: Pool, nbytes: int) -> None:
        self.books.charge(tenant, pool, nbytes)

    def uncharge(self, tenant: str, pool: Pool, nbytes: int) -> None:
        self.books.uncharge(tenant, pool, nbytes)
        self._grant(pool)  # its waiters may fit its quota now

    def renew(self, buf: Buffer, ttl: float | None) -> None:
        ttl = buf.ttl if ttl is None else ttl
        if ttl is None:
            return  # no lease to renew: the buffer lives until released
        buf.ttl = ttl
        buf.session_id = None  # a leased buffer outlives its session
        if buf.expires_at is None:
            self._leases.count += 1
        buf.expires_at = self.clock() + ttl
        self._leases.push(buf.buffer_id, buf.expires_at)

    def _expires_at(self, buffer_id: str) -> float | None:
        buf = self._buffers.get(buffer_id)
        return None if buf is None else buf.expires_at

    def _live_leases(self) -> Iterable[tuple[str, float]]:
        return ((b.buffer_id, b.expires_at) for b in self._buffers.values()
                if b.expires_at is not None)

    def next_expiry(self) -> float | None:
        return self._leases.next()

    def expire(self) -> list[Buffer]:
        """Release every buffer whose lease has run out; return them."""
        out: list[Buffer] = []
        for bid, when in self._leases.due(self.clock()):
            buf = self._buffers[bid]
            self.release(buf)
            self._lapsed.note(buf, when)
            self.expired_total += 1
            self._expired_by[buf.tenant] = self._expired_by.get(buf.tenant, 0) + 1
            out.append(buf)
        return out

    def session_closed(self, session_id: str) -> list[Buffer]:
        doomed = [b for b in self._buffers.values() if b.session_id == session_id]
        for b in doomed:
            self.release(b)
        return doomed

    def expired_of(self, tenant: str) -> int:
        return self._expired_by.get(tenant, 0)

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """Node-wide figures (``tenant`` None: the operator's view), or what one
        tenant may see: its own buffers, bytes and waiters, and each device."""
        if tenant is None:
            return {
                "buffers": len(self._buffers),
                "waiters": {k: len(q) for k, q in self._waiters.items()},
                "expired_total": self.expired_total,
                "devices": [p.describe() for p in self.pools.values()],
            }
        return {
            "buffers": self.books.count.get(tenant, 0),
            "bytes": {k: self.books.bytes.get((tenant, k), 0) for k in self.pools},
            "waiters": {k: len(q.by_tenant.get(tenant, ())) for k, q in self._waiters.items()},
            "devices": [p.describe() for p in self.pools.values()],
            "limits": self.books.limits_of(tenant, self.pools),
        }

    def tenant_usage(self) -> dict[str, Any]:
        return self.books.usage()
