"""The buffer registry: who owns which slice of which arena, and for how long.

Plain synchronous code (decide here, do I/O in the daemon): allocation with
quotas, lookup by unguessable id scoped to a tenant, leases, session-scoped
buffers, pins that keep memory alive while UCX may still touch it, and the
fair first-come-first-served queue of requests waiting for memory.

A buffer leaves the tenant's view the moment it is released or expires, but
its memory goes back to the allocator only when its last transfer has
finished (``pins == 0``): memory is never handed to another buffer while UCX
may still write into it.  Freeing is idempotent and checked: each pool knows
which buffer owns each allocator block, a buffer is freed at most once, and
only a block it still owns goes back (a stray unpin can never free another
tenant's block).  A freed buffer cannot be pinned again.

Waiting for memory is fair between tenants without letting a stuck request
block the pool: each tenant has its own FIFO per device, the heads are served
round-robin, and a head that does not fit is passed by requests that do; once
the oldest waiter has waited ``AGING`` seconds, nobody passes it any more
while the free bytes would serve it (so a big request is not starved by a
stream of small ones), for at most ``AGING`` more seconds.  A waiter that needs
memory other tenants hold holds nobody back (``_holding``): another tenant's
waiter never makes a request wait or fail.  Waiting bytes count against the
tenant's quota, each tenant may have at most ``MAX_WAITERS`` waiting per
device, and a waiter leaves its queues in O(1) (insertion-ordered dicts keyed
by the waiter itself).

Manifest entries cost the daemon memory too: each one is charged
``ENTRY_BYTES`` against its tenant's bytes on the buffer's device, checked
before a batch changes anything (``charge_entries``).

A host buffer (a segment of the KV tier too) holds a file descriptor and a
mapping for as long as its memory is backed (its memfd, mapped into the
arena): both are charged to its tenant in ``charges`` (``charges.py``: the
node's one table of what each tenant holds) with the allocation, checked
with the quota before anything is allocated, and given back with the block
(``_free``).  A byte quota alone let 19,967 blocks of 4 KiB take all of the
daemon's 20,000 fds.

The KV tier's blocks hold no memfd of their own: the block store carves them
from a few large per-tenant *segments* (``segments.py``).  A segment is a
buffer of the store (``allocate_segment``: bytes, an fd and a mapping
charged, not one of the quota's N buffers); a block is a light buffer over a
slot of one (``add_block``: one of the N, nothing else charged), pinned,
locked and released like any buffer, and freed back into its segment
(``on_block_free``), never to the allocator.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from rpcbuf.control.daemon.accounting.backing import kept_block, lock_until_zeroed, share_of
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
ENTRY_BYTES = 512  # what one manifest entry is charged against its tenant's quota
HANDLES = ("fds", "mappings")  # what a backed host block holds, one of each
SEGMENT_KEY = "\0segment"  # a segment's ``block_key``: hidden like a block, never a key


def oom_sentence(device: str, size: int, block: int, largest: int, free: int) -> str:
    """"no room for 200.0 MiB on cpu:0: the largest free block is 128.0 MiB
    (254.9 MiB free in all)", and the allocator's rounding where it bites."""
    rounded = f" (it takes a block of {format_size(block)})" if block > size * 1.01 else ""
    return (f"no room for {format_size(size)}{rounded} on {device}: the largest free block "
            f"is {format_size(largest)} ({format_size(free)} free in all)")


class Registry:
    """Every pool's buffers, their tenants' quotas and leases, and the
    requests waiting for memory (see the module)."""

    def __init__(self, pools: list[Pool], quotas: dict[str, Quota] | None = None,
                 default_quota: Quota | None = None,
                 clock: Callable[[], float] = time.time,
                 charges: Charges | None = None) -> None:
        self.pools = {p.key: p for p in pools}
        self.charges = charges or Charges()  # fds, mappings (and the daemon's kinds)
        self.quotas = quotas or {}
        self.default_quota = default_quota or Quota()
        self.clock = clock
        self._buffers: dict[str, Buffer] = {}
        self._names: dict[tuple[str, str], str] = {}
        self._tenant_bytes: dict[tuple[str, str], int] = {}
        self._tenant_count: dict[str, int] = {}
        self._counted = 0  # the sum of ``_tenant_count`` (``len``, on every allocation)
        self.records_peak = 0  # the most ``len(self)`` has been (``_grew``)
        self._tenant_waiting: dict[tuple[str, str], int] = {}  # bytes reserved by waiters
        self._waiters: dict[str, Queues] = {k: Queues() for k in self.pools}
        self._leases: Leases[str] = Leases(self._expires_at, self._live_leases)
        self._ids = Ids()
        self._pool_keys: dict[tuple[str, int], Pool] = {}  # (device_type, device) -> pool
        self.expired_total = 0
        self._expired_by: dict[str, int] = {}
        self._lapsed = Lapsed(self.clock)  # leases that ran out: NOT_FOUND says so
        # Told when a block's first pin is taken (True) and its last one
        # dropped (False): the block store keeps held blocks out of its
        # eviction order (``BlockStore._pinned``).
        self.on_pin: Callable[[Buffer, bool], None] | None = None
        # Told when a block's slot is free again (its buffer freed): the block
        # store hands it back to its segment (``BlockStore._slot_freed``).
        self.on_block_free: Callable[[Buffer], None] | None = None
        # The block store: no live session holds an fd of this buffer any more.
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
            # Same answer for "never existed" and "someone else's": no hint
            # leaks (a lapsed lease is told only to the tenant it was of).
            # A block is reached by its key only (blocks.py): its buffer id,
            # which an attachment's answer names for detach, writes nothing.
            raise self._lapsed.not_found(tenant, buffer_id, f"no buffer {buffer_id!r}")
        return buf

    def by_name(self, tenant: str, name: str) -> Buffer:
        bid = self._names.get((tenant, name))
        if bid is None:
            raise self._lapsed.not_found(tenant, "=" + name, f"no buffer named {name!r}")
        return self._buffers[bid]

    def __len__(self) -> int:
        """Records held, what the daemon's own heap grows with: buffers and
        segments, and blocks (one of their tenant's N, in no view), each
        counted once or twice (an allowance, generous by design)."""
        return len(self._buffers) + self._counted

    def _grew(self) -> None:
        """Keep ``records_peak``: the daemon's heap keeps what it grew to for
        records once they are freed (Python's and glibc's allocators reuse it,
        rarely give it back), so the UCX janitor's allowance follows the peak,
        not what is held now (a daemon that held 250,000 blocks and removed
        them was taken for a flood, and dropped every store that waited a tick)."""
        n = len(self)
        if n > self.records_peak:
            self.records_peak = n

    def buffers_of(self, tenant: str) -> list[Buffer]:
        return [b for b in self._buffers.values() if b.tenant == tenant]

    # -- allocation -----------------------------------------------------------

    def quota_for(self, tenant: str) -> Quota:
        return self.quotas.get(tenant, self.default_quota)

    def _check_quota(self, tenant: str, pool: Pool, size: int, extra: int = 0,
                     alloc: int | None = None, new_buffer: bool = True,
                     counted: bool = True) -> None:
        """Would ``tenant`` stay within its quota holding ``alloc`` more bytes
        (default: the block ``size`` takes) on ``pool``?  ``extra``: bytes
        reserved besides what it holds (its waiters' blocks)."""
        q = self.quota_for(tenant)
        if alloc is None:
            alloc = pool.allocator.block_size(size)
        used = self._tenant_bytes.get((tenant, pool.key), 0) + extra
        if q.bytes_per_device is not None and used + alloc > q.bytes_per_device:
            raise QuotaExceeded(
                f"tenant {tenant!r} would hold {format_size(used + alloc)} on {pool.key}, "
                f"quota is {format_size(q.bytes_per_device)}",
                {"requested": alloc, "used": used, "quota": q.bytes_per_device},
            )
        count = self._tenant_count.get(tenant, 0)
        if new_buffer and counted and q.buffers is not None and count + 1 > q.buffers:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds {count} buffers, quota is {q.buffers}",
                {"buffers": count, "quota": q.buffers},
            )
        if new_buffer and pool.holds_fds:
            for kind in HANDLES:
                self.charges.check(tenant, kind)

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
        self._check_quota(tenant, pool, size, extra, counted=counted)

    def try_allocate(self, tenant: str, pool: Pool, size: int, *, name: str | None = None,
                     ttl: float | None = None, session_id: str | None = None,
                     like: Buffer | None = None) -> Buffer | None:
        """Allocate now, or return None when the caller must wait: the pool
        has no block for it, this tenant already has requests waiting there
        (a tenant's requests are served in order), or the device's oldest
        waiter has waited past ``AGING`` (nobody passes it now).  Raises on
        bad input and when the tenant's quota would be exceeded.  ``like``:
        the block maps that buffer's memory instead of its own (``clone``)."""
        queues = self._waiters[pool.key]
        self._validate(tenant, pool, size, name,
                       self._tenant_waiting.get((tenant, pool.key), 0))
        if queues and (tenant in queues.by_tenant or self._holding(pool) is not None):
            return None
        return self._allocate(tenant, pool, size, name, ttl, session_id, like)

    def allocate_segment(self, tenant: str, pool: Pool, size: int) -> Buffer | None:
        """A segment of ``size`` bytes for ``tenant``'s blocks on ``pool``
        (see the module): as ``try_allocate`` (None: wait, or no block free),
        charged its bytes, an fd and a mapping, but not one of the quota's N
        buffers (its blocks are: ``add_block``)."""
        queues = self._waiters[pool.key]
        self._validate(tenant, pool, size, None,
                       self._tenant_waiting.get((tenant, pool.key), 0), counted=False)
        if queues and (tenant in queues.by_tenant or self._holding(pool) is not None):
            return None
        buf = self._allocate(tenant, pool, size, None, None, None, counted=False, owned=True)
        if buf is not None:
            buf.block_key = SEGMENT_KEY
        return buf

    def room(self, tenant: str, pool: Pool) -> tuple[int, bool]:
        """The bytes ``tenant`` could still be given on ``pool`` in one
        block: the rest of its quota (less its waiters'), and no more than
        the pool's largest free block; and whether the quota is what bounds it."""
        key = (tenant, pool.key)
        room = pool.allocator.largest_free()
        q = self.quota_for(tenant).bytes_per_device
        if q is not None:
            used = self._tenant_bytes.get(key, 0) + self._tenant_waiting.get(key, 0)
            if q - used < room:
                return max(0, q - used), True
        return room, False

    def check_count(self, tenant: str) -> None:
        """QUOTA_EXCEEDED when ``tenant`` holds the quota's N buffers and
        blocks already (``add_block`` would pass it)."""
        q = self.quota_for(tenant)
        count = self._tenant_count.get(tenant, 0)
        if q.buffers is not None and count + 1 > q.buffers:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds {count} buffers and blocks, quota is {q.buffers}",
                {"buffers": count, "quota": q.buffers})

    def add_block(self, segment: Buffer, offset: int, size: int, alloc_size: int) -> Buffer:
        """A block of ``segment``'s tenant over its slot ``[offset, offset +
        alloc_size)`` (arena offsets), given by the segment's own allocator:
        one of the tenant's N (``check_count`` first), nothing else charged
        (the segment is), in no view (the block store's: ``block_key``)."""
        tenant = segment.tenant
        self.check_count(tenant)
        buf = Buffer(buffer_id=self._ids.next(), tenant=tenant, pool=segment.pool,
                     offset=offset, size=size, alloc_size=alloc_size, name=None,
                     session_id=None, ttl=None, created_at=self.clock(), expires_at=None,
                     block_key="", segment=segment)
        self._tenant_count[tenant] = self._tenant_count.get(tenant, 0) + 1
        self._counted += 1
        self._grew()
        return buf

    def queued_ahead(self, tenant: str, pool: Pool) -> bool:
        """Whether a ``try_allocate`` of ``tenant`` on ``pool`` would wait for
        the queue rather than for memory: its own requests wait there, or an
        aged waiter holds everyone back (``_holding``).  The block tier
        evicts only when this is False (room, not a queue, is what lacks)."""
        queues = self._waiters[pool.key]
        return bool(queues) and (tenant in queues.by_tenant
                                 or self._holding(pool) is not None)

    def _holding(self, pool: Pool) -> Waiter | None:
        """The aged oldest waiter of ``pool`` while it holds everyone else
        back: only while the device's free bytes would serve it (it waits
        for them to come together, and a small request could split what it
        needs), and for at most ``AGING`` more seconds.  A waiter that needs
        memory other tenants hold, or that free memory has not served in
        that time, holds nobody back: it stays first in line for what comes
        free (``_grant``), but another tenant's waiter never makes a request
        wait or fail, nor a block put evict (docs/security.md)."""
        queues = self._waiters[pool.key]
        w = queues.aged()
        if w is None or time.monotonic() - w.since >= 2 * AGING:
            return None
        return w if w.reserved <= pool.allocator.stats().free else None

    def clone(self, src: Buffer, *, name: str | None = None, ttl: float | None = None,
              session_id: str | None = None) -> Buffer | None:
        """A new buffer of ``src``'s tenant, size and device whose block maps
        ``src``'s memory (``Clones.share``: no copy, no fresh pages; each
        gets memory of its own before its first write, ``Pipeline``): a
        ``try_allocate`` like any other (quota with waiting bytes, names, the
        queues' rule), whose None the caller answers at once (a clone never
        waits).  The caller copies the manifest (``dedupops.clone``)."""
        return self.try_allocate(src.tenant, src.pool, src.size, name=name, ttl=ttl,
                                 session_id=session_id, like=src)

    def _allocate(self, tenant: str, pool: Pool, size: int, name: str | None,
                  ttl: float | None, session_id: str | None,
                  like: Buffer | None = None, counted: bool = True,
                  owned: bool = False) -> Buffer | None:
        # ``owned``: a block segment, which its tenant's same-host sessions
        # may map writable (``HostArena.back_owned``): never a kept memfd.
        host = host_memory(pool.arena) if owned else None
        offset = kept_block(pool, size) if like is None and host is None else None
        if offset is None:
            offset = pool.allocator.allocate(size)
        if offset is None:
            return None
        alloc_size = pool.allocator.block_size(size)
        back = pool.arena.back  # the block's own shareable memory (arena.py, cuda_arena.py)
        if like is not None:
            back = functools.partial(share_of, pool.arena, like)
        elif host is not None:
            back = host.back_owned
        handles = self._charge_handles(tenant, pool, offset)
        try:
            zeroing = back(offset, alloc_size)
        except (OSError, CudaError) as exc:  # no memory, no fds left: nothing changed
            self._refund_handles(tenant, handles)
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
        key = (tenant, pool.key)
        self._tenant_bytes[key] = self._tenant_bytes.get(key, 0) + buf.alloc_size
        if counted:
            self._tenant_count[tenant] = self._tenant_count.get(tenant, 0) + 1
            self._counted += 1
        self._grew()
        if buf.expires_at is not None:
            self._leases.count += 1
            self._leases.push(buf.buffer_id, buf.expires_at)
        return buf

    def _charge_handles(self, tenant: str, pool: Pool, offset: int) -> int:
        """Charge a host block's fd and mapping to ``tenant`` (checked with
        the quota already; a waiter served later is validated again):
        how many kinds were charged.  QUOTA_EXCEEDED frees ``offset``."""
        if not pool.holds_fds:
            return 0
        done = 0
        try:
            for kind in HANDLES:
                self.charges.charge(tenant, kind)
                done += 1
        except QuotaExceeded:
            self._refund_handles(tenant, done)
            pool.allocator.free(offset)
            raise
        return done

    def _refund_handles(self, tenant: str, done: int) -> None:
        for kind in HANDLES[:done]:
            self.charges.refund(tenant, kind)

    def enqueue(self, waiter: Waiter) -> None:
        """Queue a request that must wait.  QUOTA_EXCEEDED when the tenant
        has ``MAX_WAITERS`` waiting on this device already, or when its
        held and waiting bytes with this one would pass its quota."""
        pool, tenant = waiter.pool, waiter.tenant
        queues = self._waiters[pool.key]
        mine = queues.by_tenant.get(tenant)
        if mine is not None and len(mine) >= MAX_WAITERS:
            raise QuotaExceeded(
                f"tenant {tenant!r} has {len(mine)} requests waiting for memory on "
                f"{pool.key} already (at most {MAX_WAITERS})",
                {"limit": "waiters", "waiters": len(mine), "max": MAX_WAITERS})
        key = (tenant, pool.key)
        self._check_quota(tenant, pool, waiter.size, self._tenant_waiting.get(key, 0))
        waiter.reserved = pool.allocator.block_size(waiter.size)
        waiter.since = time.monotonic()
        self._tenant_waiting[key] = self._tenant_waiting.get(key, 0) + waiter.reserved
        queues.add(waiter)

    def _dequeue(self, waiter: Waiter) -> bool:
        if not self._waiters[waiter.pool.key].remove(waiter):
            return False
        key = (waiter.tenant, waiter.pool.key)
        self._tenant_waiting[key] -= waiter.reserved
        if not self._tenant_waiting[key]:
            del self._tenant_waiting[key]
        return True

    def cancel(self, waiter: Waiter) -> None:
        """Remove a waiter that gave up (timeout, cancellation, disconnect).
        No memory came free, so only who may be served changed: everyone,
        if it was an aged oldest waiter (which held the others back); else
        the next of its tenant, if it was that tenant's head.  O(1) then."""
        queues = self._waiters[waiter.pool.key]
        was_aged = queues.aged() is waiter
        mine = queues.by_tenant.get(waiter.tenant)
        was_head = mine is not None and next(iter(mine)) is waiter
        if not self._dequeue(waiter):
            return
        if was_aged:
            self._grant(waiter.pool)
        elif was_head and self._holding(waiter.pool) is None:
            mine = queues.by_tenant.get(waiter.tenant)
            if mine:
                self._serve(next(iter(mine)))

    def waiting(self, pool: Pool, tenant: str | None = None) -> int:
        queues = self._waiters[pool.key]
        if tenant is None:
            return len(queues)
        return len(queues.by_tenant.get(tenant, ()))

    def out_of_memory(self, pool: Pool, size: int) -> OutOfMemory:
        """What fits, not only what is free: "254.9 MiB free" next to a 200 MiB
        refusal read as a bug until one knew the free bytes were in pieces,
        and buddy rounding surprised (a 389 MiB model took 2 x 256 MiB)."""
        details = pool.oom_details(size)
        return OutOfMemory(oom_sentence(pool.key, size, details["block"],
                                        details["largest_free"], details["free"]), details)

    def _grant(self, pool: Pool) -> None:
        """Serve what fits: the aged oldest waiter alone while it waits past
        ``AGING``; else each tenant's head in turn, round-robin, passing
        heads that do not fit."""
        queues = self._waiters[pool.key]
        while queues:
            aged = self._holding(pool)
            if aged is not None:
                if not self._serve(aged):
                    return  # it still does not fit: nobody passes it now
                continue
            served = False
            for w in queues.heads():
                if self._serve(w):
                    served = True
                    queues.turn += 1
            if not served:
                return

    def _serve(self, w: Waiter) -> bool:
        """Allocate for ``w`` (or fail it, when it is no longer valid); False
        when it does not fit yet."""
        pool = w.pool
        try:
            self._validate(w.tenant, pool, w.size, w.options.get("name"))
        except RpcBufError as exc:
            self._dequeue(w)
            w.done(None, exc)
            return True
        buf = self._allocate(w.tenant, pool, w.size, **w.options)
        if buf is None:
            return False
        self._dequeue(w)
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
        """Keep ``buf``'s memory until the matching ``unpin``.  A buffer whose
        memory went back already cannot be pinned (NOT_FOUND): its block may
        belong to another buffer now."""
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
            self._tenant_count[buf.tenant] -= 1
            self._counted -= 1
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
            self._refund_handles(buf.tenant, len(HANDLES))
        pool.allocator.free(buf.offset)
        key = (buf.tenant, pool.key)
        # A block handed out by fd stays charged while a session that got it
        # lives (``unexport``): a dup of the fd still pins its pages.
        kept = buf.alloc_size if buf.exported_to else 0
        self._tenant_bytes[key] -= buf.alloc_size - kept + buf.entries_charged * ENTRY_BYTES
        buf.entries_charged = 0
        if buf.counted:
            self._tenant_count[buf.tenant] -= 1
            self._counted -= 1
        self._grant(pool)

    def charge_entries(self, buf: Buffer, count: int, dry_run: bool = False) -> None:
        """Charge the manifest of ``buf`` at ``count`` entries (from what is
        charged now) against its tenant's quota; QUOTA_EXCEEDED, changing
        nothing, when that would pass it (``dry_run``: only check)."""
        more = count - buf.entries_charged
        if more > 0:
            self._check_quota(buf.tenant, buf.pool, 0, alloc=more * ENTRY_BYTES,
                              new_buffer=False)
        if dry_run:
            return
        key = (buf.tenant, buf.pool.key)
        self._tenant_bytes[key] = self._tenant_bytes.get(key, 0) + more * ENTRY_BYTES
        buf.entries_charged = count

    def export(self, buf: Buffer) -> None:
        """A session is handed an fd of ``buf``'s memory (once per session)."""
        buf.exported_to += 1

    def unexport(self, buf: Buffer) -> None:
        """That session ended: a freed block it pinned is no longer charged
        (what a dup kept past this still pins is not counted: docs/security.md)."""
        if buf.exported_to <= 0:
            raise RuntimeError(f"unexport of {buf.buffer_id} that was not exported")  # a bug
        buf.exported_to -= 1
        if buf.freed and not buf.exported_to:
            self.uncharge(buf.tenant, buf.pool, buf.alloc_size)
        elif not buf.exported_to and self.on_unexported is not None:
            self.on_unexported(buf)  # an empty block segment kept while handed out goes now

    def host_pool(self) -> Pool | None:
        """The first host-memory pool (what memory that is no buffer, such as
        a session's staging area, is charged on); None on a GPU-only node."""
        return next((p for p in self.pools.values() if host_memory(p.arena) is not None), None)

    def charge(self, tenant: str, pool: Pool, nbytes: int) -> None:
        """Count ``nbytes`` of memory that is no buffer of the tenant's (a
        same-host session's staging area) against its bytes on ``pool``
        until ``uncharge``; QUOTA_EXCEEDED, changing nothing, past its quota."""
        key = (tenant, pool.key)
        self._check_quota(tenant, pool, 0, self._tenant_waiting.get(key, 0), alloc=nbytes,
                          new_buffer=False)
        self._tenant_bytes[key] = self._tenant_bytes.get(key, 0) + nbytes

    def uncharge(self, tenant: str, pool: Pool, nbytes: int) -> None:
        key = (tenant, pool.key)
        left = self._tenant_bytes.get(key, 0) - nbytes
        if left < 0:
            raise RuntimeError(f"uncharge of {nbytes} bytes {tenant!r} was not charged")  # a bug
        self._tenant_bytes[key] = left
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
        """Node-wide figures (``tenant`` None: the operator's view, for metrics
        and logs), or what one tenant may see: its own buffers, bytes and
        waiters, and each device's size and free bytes."""
        if tenant is None:
            return {
                "buffers": len(self._buffers),
                "waiters": {k: len(q) for k, q in self._waiters.items()},
                "expired_total": self.expired_total,
                "devices": [p.describe() for p in self.pools.values()],
            }
        return {
            "buffers": self._tenant_count.get(tenant, 0),
            "bytes": {k: self._tenant_bytes.get((tenant, k), 0) for k in self.pools},
            "waiters": {k: len(q.by_tenant.get(tenant, ())) for k, q in self._waiters.items()},
            "devices": [p.describe() for p in self.pools.values()],
            "limits": self.limits_of(tenant),
        }

    def limits_of(self, tenant: str) -> dict[str, dict[str, Any]]:
        """The tenant's rows of the table of what it holds and the limit of
        each: bytes per device and buffers (its quota) and ``charges``'
        kinds (fds, mappings, sessions, buffered frame bytes)."""
        q = self.quota_for(tenant)
        rows: dict[str, dict[str, Any]] = {
            f"bytes:{k}": {"held": self._tenant_bytes.get((tenant, k), 0)
                           + self._tenant_waiting.get((tenant, k), 0),
                           "limit": q.bytes_per_device} for k in self.pools}
        rows["buffers"] = {"held": self._tenant_count.get(tenant, 0), "limit": q.buffers}
        rows.update(self.charges.table(tenant))
        return rows

    def tenant_usage(self) -> dict[str, Any]:
        """What each tenant holds (what quotas count, so memory still pinned by a
        transfer after release is included): buffers per tenant, bytes per
        (tenant, device)."""
        return {"buffers": {t: n for t, n in self._tenant_count.items() if n},
                "bytes": {k: n for k, n in self._tenant_bytes.items() if n}}
