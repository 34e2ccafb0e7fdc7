"""The daemon's content index: which bytes a tenant already holds, by hash.

Every manifest entry the daemon records (``store_tensors``, ``dedup_store``)
is indexed as tenant -> xxh3-128 of its bytes -> where they lie (buffer,
offset, nbytes, xxh3-64).  A client about to upload asks which of its
tensors' hashes are here and sends only the others (``dedupops.py``).

Plain synchronous bookkeeping, like the registry.  Correctness does not rest
on it: every placement copies and then verifies the xxh3-64 of what landed.
It is kept precise anyway, so that lookups rarely miss:

- *Overwritten* bytes drop their entries at once: every write into a buffer
  (store, batch, clear, copy, dedup) takes an exclusive range lock first, and
  ``Pipeline.lock`` calls ``forget`` for the ranges it locks.
- *Released* buffers drop out lazily: a lookup skips them, and a sweep every
  ``SWEEP_EVERY`` additions removes them (no hook in the registry needed).
- *Per tenant*: a lookup sees only the asking tenant's entries, so no tenant
  learns what another stored.

Entries of one buffer never overlap (a manifest's entries do not), so each
buffer keeps them sorted by offset and ``forget`` is a bisection.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from control.daemon.diskcache import DiskCache
    from control.daemon.registry import Buffer, Registry

log = logging.getLogger("rpcbuf.daemon")
SWEEP_EVERY = 1024
MAX_LOCATIONS = 4  # places remembered per (tenant, hash): a few copies suffice
MAX_DEFERRED = 10_000  # stored batches per tenant waiting to be indexed


@dataclass(eq=False)
class Location:
    buf: Buffer
    offset: int
    nbytes: int
    checksum: int
    digest: int  # xxh3-128


class _BufferEntries:
    """One buffer's indexed ranges, sorted by offset, disjoint."""

    __slots__ = ("buf", "locs", "starts")

    def __init__(self, buf: Buffer) -> None:
        self.buf = buf
        self.starts: list[int] = []
        self.locs: list[Location] = []

    def overlapping(self, a: int, b: int) -> range:
        j = bisect.bisect_left(self.starts, b)  # entries starting before b
        i = j
        while i > 0 and self.locs[i - 1].offset + self.locs[i - 1].nbytes > a:
            i -= 1
        return range(i, j)


class ContentIndex:
    def __init__(self, cache: DiskCache | None = None) -> None:
        self.cache = cache
        self._tenants: dict[str, dict[int, list[Location]]] = {}
        self._buffers: dict[str, _BufferEntries] = {}
        self._adds = 0
        self._writes: set[asyncio.Task[None]] = set()
        self._write_slots = asyncio.Semaphore(1)  # one disk writer: the CPUs serve transfers
        self.counters = {"lookups": 0, "hits": 0, "forgotten": 0}
        # tenant -> batches stored but not hashed yet (see ``defer``)
        self._deferred: dict[str, deque[tuple[Buffer, dict[str, dict[str, Any]]]]] = {}

    # -- deferred indexing ----------------------------------------------------------

    def defer(self, buf: Buffer, manifest: dict[str, dict[str, Any]]) -> None:
        """Remember a stored batch's manifest entries, to hash and index on the
        tenant's next dedup query: hashing every store up front cost a third
        of a 10,000-tensor ``store_batch``, and most stores are never deduped
        against.  Bounded: the oldest batches are forgotten first (they only
        stop being dedup sources)."""
        q = self._deferred.setdefault(buf.tenant, deque(maxlen=MAX_DEFERRED))
        q.append((buf, manifest))

    def take_deferred(self, tenant: str) -> list[tuple[Buffer, dict[str, dict[str, Any]]]]:
        q = self._deferred.pop(tenant, None)
        return [(b, m) for b, m in q if not b.released] if q else []

    # -- queries ----------------------------------------------------------------

    def lookup(self, tenant: str, digest: int, nbytes: int, checksum: int) -> Location | None:
        """A live place holding this tenant's bytes with that hash, size and checksum."""
        self.counters["lookups"] += 1
        locs = self._tenants.get(tenant, {}).get(digest)
        if not locs:
            return None
        for loc in list(locs):
            if loc.buf.released:
                self._remove(loc)
            elif loc.nbytes == nbytes and loc.checksum == checksum:
                self.counters["hits"] += 1
                return loc
        return None

    def holds(self, loc: Location) -> bool:
        """Whether ``loc`` is still indexed (nothing wrote its bytes since)."""
        entries = self._buffers.get(loc.buf.buffer_id)
        if entries is None or loc.buf.released:
            return False
        j = bisect.bisect_left(entries.starts, loc.offset)
        return j < len(entries.locs) and entries.locs[j] is loc

    def __len__(self) -> int:
        return sum(len(e.locs) for e in self._buffers.values())

    # -- updates ----------------------------------------------------------------

    def add(self, buf: Buffer, offset: int, nbytes: int, digest: int,
            checksum: int) -> Location | None:
        """Index ``[offset, offset + nbytes)`` of ``buf`` (replacing what overlapped)."""
        if nbytes <= 0 or buf.released:
            return None
        self.forget(buf, [(offset, offset + nbytes)], count=False)
        entries = self._buffers.get(buf.buffer_id)
        if entries is None:
            entries = self._buffers[buf.buffer_id] = _BufferEntries(buf)
        loc = Location(buf, offset, nbytes, checksum, digest)
        j = bisect.bisect_left(entries.starts, offset)
        entries.starts.insert(j, offset)
        entries.locs.insert(j, loc)
        locs = self._tenants.setdefault(buf.tenant, {}).setdefault(digest, [])
        locs.append(loc)
        if len(locs) > MAX_LOCATIONS:
            self._remove(locs[0])
        self._adds += 1
        if self._adds % SWEEP_EVERY == 0:
            self.sweep()
        return loc

    def forget(self, buf: Buffer, ranges: list[tuple[int, int]], count: bool = True) -> int:
        """Drop entries of ``buf`` overlapping ``ranges`` (their bytes are being
        written); return how many."""
        entries = self._buffers.get(buf.buffer_id)
        if entries is None:
            return 0
        dropped = 0
        for a, b in ranges:
            if b <= a:
                continue
            hit = entries.overlapping(a, b)
            for loc in entries.locs[hit.start:hit.stop]:
                self._unlink(loc)
            del entries.locs[hit.start:hit.stop]
            del entries.starts[hit.start:hit.stop]
            dropped += len(hit)
        if not entries.locs:
            del self._buffers[buf.buffer_id]
        if count:
            self.counters["forgotten"] += dropped
        return dropped

    def sweep(self) -> int:
        """Remove the entries of released buffers; return how many buffers."""
        dead = [e.buf for e in self._buffers.values() if e.buf.released]
        for buf in dead:
            self.forget(buf, [(0, buf.size)], count=False)
        return len(dead)

    def _remove(self, loc: Location) -> None:
        entries = self._buffers.get(loc.buf.buffer_id)
        if entries is not None and loc in entries.locs:
            i = entries.locs.index(loc)
            del entries.locs[i]
            del entries.starts[i]
            if not entries.locs:
                del self._buffers[loc.buf.buffer_id]
        self._unlink(loc)

    def _unlink(self, loc: Location) -> None:
        by_hash = self._tenants.get(loc.buf.tenant)
        if by_hash is None:
            return
        locs = by_hash.get(loc.digest)
        if locs and loc in locs:
            locs.remove(loc)
            if not locs:
                del by_hash[loc.digest]
        if not by_hash:
            del self._tenants[loc.buf.tenant]

    # -- the disk cache, written in the background ----------------------------------

    def keep_on_disk(self, registry: Registry, loc: Location) -> None:
        """Copy ``loc``'s bytes into the disk cache in the background (the buffer
        stays pinned until then, so its memory is not reused meanwhile)."""
        cache = self.cache
        if cache is None or cache.has(loc.buf.tenant, loc.digest, loc.nbytes) \
                or not cache.accepts(loc.nbytes):
            return
        registry.pin(loc.buf)

        async def write() -> None:
            try:
                async with self._write_slots:
                    view = loc.buf.pool.arena.view(loc.buf.offset + loc.offset, loc.nbytes)
                    await asyncio.to_thread(cache.write, loc.buf.tenant, loc.digest,
                                            loc.checksum, view)
            except Exception:  # the cache is best effort; a failed write loses nothing
                log.exception("disk cache write failed")
            finally:
                registry.unpin(loc.buf)

        task = asyncio.get_running_loop().create_task(write())
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def aclose(self, timeout: float = 30.0) -> None:
        """Let pending disk-cache writes finish (bounded)."""
        if self._writes:
            await asyncio.wait(list(self._writes), timeout=timeout)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.counters, "entries": len(self),
                               "pending_disk_writes": len(self._writes)}
        if self.cache is not None:
            out["disk_cache"] = self.cache.stats()
        return out
