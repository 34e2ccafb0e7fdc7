"""What each tenant holds against its quota: bytes per device, its N buffers and
blocks, and a host block's fd and mapping (in ``charges``).

Checks come before changes: a refused charge changes nothing. Bytes reserved by
a tenant's waiters count as held (``reserved``, the registry's queues).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rpcbuf.control.daemon.accounting.buffers import Buffer, Pool, Quota
from rpcbuf.control.daemon.accounting.charges import Charges
from rpcbuf.control.wire.errors import QuotaExceeded
from rpcbuf.control.wire.units import format_size

ENTRY_BYTES = 512  # what one manifest entry is charged against its tenant's quota
HANDLES = ("fds", "mappings")  # what a backed host block holds, one of each


class Books:
    def __init__(self, quotas: dict[str, Quota] | None, default_quota: Quota | None,
                 charges: Charges | None, reserved: Callable[[str, Pool], int]) -> None:
        self.quotas = quotas or {}
        self.default_quota = default_quota or Quota()
        self.charges = charges or Charges()  # fds, mappings (and the daemon's kinds)
        self.reserved = reserved
        self.bytes: dict[tuple[str, str], int] = {}  # (tenant, device) -> bytes held
        self.count: dict[str, int] = {}  # buffers and blocks (the quota's N)
        self.counted = 0  # the sum of ``count``

    def quota_for(self, tenant: str) -> Quota:
        return self.quotas.get(tenant, self.default_quota)

    def check(self, tenant: str, pool: Pool, size: int, extra: int = 0,
              alloc: int | None = None, new_buffer: bool = True, counted: bool = True) -> None:
        """QUOTA_EXCEEDED unless ``tenant`` stays within its quota holding ``alloc``
        more bytes (default: the block ``size`` takes) and ``extra`` reserved."""
        q = self.quota_for(tenant)
        if alloc is None:
            alloc = pool.allocator.block_size(size)
        used = self.bytes.get((tenant, pool.key), 0) + extra
        if q.bytes_per_device is not None and used + alloc > q.bytes_per_device:
            raise QuotaExceeded(
                f"tenant {tenant!r} would hold {format_size(used + alloc)} on {pool.key}, "
                f"quota is {format_size(q.bytes_per_device)}",
                {"requested": alloc, "used": used, "quota": q.bytes_per_device},
            )
        count = self.count.get(tenant, 0)
        if new_buffer and counted and q.buffers is not None and count + 1 > q.buffers:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds {count} buffers, quota is {q.buffers}",
                {"buffers": count, "quota": q.buffers},
            )
        if new_buffer and pool.holds_fds:
            for kind in HANDLES:
                self.charges.check(tenant, kind)

    def check_count(self, tenant: str) -> None:
        """QUOTA_EXCEEDED when ``tenant`` holds its N buffers and blocks already."""
        q = self.quota_for(tenant)
        count = self.count.get(tenant, 0)
        if q.buffers is not None and count + 1 > q.buffers:
            raise QuotaExceeded(
                f"tenant {tenant!r} holds {count} buffers and blocks, quota is {q.buffers}",
                {"buffers": count, "quota": q.buffers})

    def room(self, tenant: str, pool: Pool) -> tuple[int, bool]:
        """The bytes ``tenant`` could still be given on ``pool`` in one block,
        and whether its quota (not the largest free block) bounds it."""
        room = pool.allocator.largest_free()
        q = self.quota_for(tenant).bytes_per_device
        if q is not None:
            used = self.bytes.get((tenant, pool.key), 0) + self.reserved(tenant, pool)
            if q - used < room:
                return max(0, q - used), True
        return room, False

    def add(self, tenant: str, pool: Pool, nbytes: int) -> None:
        key = (tenant, pool.key)
        self.bytes[key] = self.bytes.get(key, 0) + nbytes

    def add_count(self, tenant: str, n: int) -> None:
        self.count[tenant] = self.count.get(tenant, 0) + n
        self.counted += n

    def charge(self, tenant: str, pool: Pool, nbytes: int) -> None:
        """Count ``nbytes`` that are no buffer (a staging area) against the
        tenant's bytes until ``uncharge``; QUOTA_EXCEEDED, changing nothing."""
        self.check(tenant, pool, 0, self.reserved(tenant, pool), alloc=nbytes,
                   new_buffer=False)
        self.add(tenant, pool, nbytes)

    def uncharge(self, tenant: str, pool: Pool, nbytes: int) -> None:
        key = (tenant, pool.key)
        left = self.bytes.get(key, 0) - nbytes
        if left < 0:
            raise RuntimeError(f"uncharge of {nbytes} bytes {tenant!r} was not charged")  # a bug
        self.bytes[key] = left

    def charge_entries(self, buf: Buffer, count: int, dry_run: bool = False) -> None:
        """Charge ``buf``'s manifest at ``count`` entries; QUOTA_EXCEEDED, changing
        nothing, past the quota (``dry_run``: only check)."""
        more = count - buf.entries_charged
        if more > 0:
            self.check(buf.tenant, buf.pool, 0, alloc=more * ENTRY_BYTES, new_buffer=False)
        if dry_run:
            return
        self.add(buf.tenant, buf.pool, more * ENTRY_BYTES)
        buf.entries_charged = count

    def charge_handles(self, tenant: str, pool: Pool, offset: int) -> int:
        """Charge a host block's fd and mapping: how many kinds were charged.
        QUOTA_EXCEEDED frees ``offset``."""
        if not pool.holds_fds:
            return 0
        done = 0
        try:
            for kind in HANDLES:
                self.charges.charge(tenant, kind)
                done += 1
        except QuotaExceeded:
            self.refund_handles(tenant, done)
            pool.allocator.free(offset)
            raise
        return done

    def refund_handles(self, tenant: str, done: int = len(HANDLES)) -> None:
        for kind in HANDLES[:done]:
            self.charges.refund(tenant, kind)

    def limits_of(self, tenant: str, pools: dict[str, Pool]) -> dict[str, dict[str, Any]]:
        """What the tenant holds and the limit of each: bytes per device,
        buffers, and ``charges``' kinds."""
        q = self.quota_for(tenant)
        rows: dict[str, dict[str, Any]] = {
            f"bytes:{k}": {"held": self.bytes.get((tenant, k), 0) + self.reserved(tenant, p),
                           "limit": q.bytes_per_device} for k, p in pools.items()}
        rows["buffers"] = {"held": self.count.get(tenant, 0), "limit": q.buffers}
        rows.update(self.charges.table(tenant))
        return rows

    def usage(self) -> dict[str, Any]:
        """What quotas count (memory still pinned after release too): buffers
        per tenant, bytes per (tenant, device)."""
        return {"buffers": {t: n for t, n in self.count.items() if n},
                "bytes": {k: n for k, n in self.bytes.items() if n}}
