"""The content index: tenant -> xxh3-128 of bytes -> where they lie (buffer, offset,
nbytes, xxh3-64), so a client uploads only what the daemon lacks.

Plain synchronous bookkeeping. The hashes are the daemon's own (over bytes as
they landed, or a verified copy), never a client's claim. An entry is trusted:
its bytes are exactly what was hashed, because every write passes ``forget`` first.

- Overwritten ranges drop their entries at once: every writer takes an exclusive
  range lock, and locking calls ``forget`` before a byte moves.
- Deferred entries (a batch not indexed yet, ``defer``) are proved by a write log
  per buffer: ``index_deferred`` indexes only entries no logged write touched
  since they were hashed; an overflowed log proves nothing (hash again).
- Released buffers drop out lazily (skipped by lookups, swept every
  ``SWEEP_EVERY`` additions); buffer ids are never reused.
- Lookups see only the asking tenant's entries.
- Memory written behind the daemon's back (a writable mapping) must not be
  indexed at all (``Buffer.trusted``).
- A buffer's entries never overlap, kept sorted by offset: ``forget`` bisects.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from rpcbuf.dataplane.arena import host_memory

if TYPE_CHECKING:
    from rpcbuf.control.daemon.accounting.registry import Buffer, Registry
    from rpcbuf.control.daemon.content.diskcache import DiskCache
    from rpcbuf.dataplane.copypool import CopyPool

log = logging.getLogger("rpcbuf.daemon")
SWEEP_EVERY = 1024
MAX_LOCATIONS = 16  # places remembered per (tenant, hash): a few copies (and clones) suffice
MAX_DEFERRED = 10_000  # stored batches per tenant waiting to be indexed
WRITE_LOG = 32  # writes remembered per buffer that has deferred entries
MAX_LOGGED = 4096  # buffers with a write log; past it the oldest log is dropped

Entry = dict[str, Any]


@dataclass(eq=False)
class Location:
    buf: Buffer
    offset: int
    nbytes: int
    checksum: int
    digest: int  # xxh3-128


class _Writes:
    """The writes into one buffer while it has deferred entries: ``(seq, start, end)``,
    at most ``WRITE_LOG``. ``lost``: the newest write whose record was dropped (an
    entry hashed before it proves nothing)."""

    __slots__ = ("log", "lost", "pending")

    def __init__(self) -> None:
        self.lost = -1
        self.pending = 0  # deferred batches that refer to this log
        self.log: deque[tuple[int, int, int]] = deque()

    def write(self, seq: int, ranges: list[tuple[int, int]]) -> None:
        for a, b in ranges:
            if b > a:
                if len(self.log) >= WRITE_LOG:
                    self.lost = self.log.popleft()[0]
                self.log.append((seq, a, b))

    def since(self, seq: int) -> list[tuple[int, int]] | None:
        """The ranges written after ``seq``; None when the log cannot tell."""
        if self.lost > seq:
            return None
        return [(a, b) for q, a, b in self.log if q > seq]


@dataclass(eq=False)
class Deferred:
    """A stored batch's entries and the xxh3-128 of each (None: not computed), hashed
    after ``seq`` writes; ``writes`` is its buffer's log."""

    buf: Buffer
    manifest: dict[str, Entry]
    digests: list[int] | None
    seq: int
    writes: _Writes


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
        self.counters = {"lookups": 0, "hits": 0, "forgotten": 0, "deferred_trusted": 0,
                         "deferred_stale": 0, "deferred_rehashed": 0}
        # tenant -> batches stored but not indexed yet (see ``defer``)
        self._deferred: dict[str, deque[Deferred]] = {}
        self._logs: dict[str, _Writes] = {}  # buffer id -> its write log, while it has deferred
        self._seq = 0  # writes told of (``forget``), all buffers

    # -- deferred indexing ----------------------------------------------------------

    def defer(self, buf: Buffer, manifest: dict[str, Entry],
              digests: list[int] | None = None) -> None:
        """Remember a stored batch's entries (and digests) to index at the tenant's next
        dedup query (indexing costs more than a store can spare). Called with the
        range still locked; bounded, oldest forgotten first."""
        q = self._deferred.setdefault(buf.tenant, deque())
        if len(q) >= MAX_DEFERRED:
            self._untrack(q.popleft())
        w = self._logs.get(buf.buffer_id)
        if w is None:
            if len(self._logs) >= MAX_LOGGED:  # drop the oldest log: its entries re-hash
                oldest = self._logs.pop(next(iter(self._logs)))
                oldest.lost = self._seq + 1  # past every entry that refers to it
            w = self._logs[buf.buffer_id] = _Writes()
        w.pending += 1
        q.append(Deferred(buf, manifest, digests, self._seq, w))

    def _untrack(self, d: Deferred) -> None:
        w = d.writes
        w.pending -= 1
        if w.pending <= 0 and self._logs.get(d.buf.buffer_id) is w:
            del self._logs[d.buf.buffer_id]

    def index_deferred(self, tenant: str) -> list[tuple[Buffer, dict[str, Entry]]]:
        """Index what ``tenant`` stored since its last dedup query; drop entries a write
        touched; return, per buffer, what cannot be proved either way (hash again)."""
        q = self._deferred.pop(tenant, None)
        if not q:
            return []
        again: list[tuple[Buffer, dict[str, Entry]]] = []
        for d in q:
            self._untrack(d)
            if d.buf.released or not d.buf.trusted:
                continue
            live = current(d.buf, d.manifest)
            if not live:
                continue
            written = d.writes.since(d.seq)
            if d.digests is None or written is None:
                self.counters["deferred_rehashed"] += len(live)
                again.append((d.buf, live))
                continue
            stale = _touched(live, written) if written else set()
            self.counters["deferred_stale"] += len(stale)
            for (name, e), digest in zip(d.manifest.items(), d.digests, strict=True):
                if name in live and name not in stale and e.get("checksum") is not None:
                    self.add(d.buf, e["offset"], e["nbytes"], digest, e["checksum"])
                    self.counters["deferred_trusted"] += 1
        return again

    # -- queries ----------------------------------------------------------------

    def lookup(self, tenant: str, digest: int, nbytes: int, checksum: int,
               at: tuple[Buffer, int] | None = None) -> Location | None:
        """A live place holding this tenant's bytes with that hash, size and checksum,
        preferring ``at`` (so bytes already in place are not copied)."""
        self.counters["lookups"] += 1
        locs = self._tenants.get(tenant, {}).get(digest)
        if not locs:
            return None
        found = None
        for loc in list(locs):
            if loc.buf.released or not loc.buf.trusted:
                self._remove(loc)
            elif loc.nbytes == nbytes and loc.checksum == checksum:
                if at is None or (loc.buf is at[0] and loc.offset == at[1]):
                    found = loc
                    break
                if found is None:
                    found = loc
        if found is not None:
            self.counters["hits"] += 1
        return found

    def in_place(self, loc: Location, buf: Buffer, offset: int) -> bool:
        """Whether ``buf`` holds ``loc``'s bytes at ``offset`` with no work: the same
        place, or that of a clone sharing its memory, and ``loc`` still indexed."""
        if loc.offset != offset or not self.holds(loc):
            return False
        if loc.buf is buf:
            return True
        host = host_memory(buf.pool.arena)
        return (host is not None and loc.buf.pool is buf.pool
                and host.clones.same_memory(loc.buf.offset, buf.offset))

    def holds(self, loc: Location) -> bool:
        """Whether ``loc`` is still indexed (nothing wrote its bytes since)."""
        entries = self._buffers.get(loc.buf.buffer_id)
        if entries is None or loc.buf.released or not loc.buf.trusted:
            return False
        j = bisect.bisect_left(entries.starts, loc.offset)
        return j < len(entries.locs) and entries.locs[j] is loc

    def __len__(self) -> int:
        return sum(len(e.locs) for e in self._buffers.values())

    # -- updates ----------------------------------------------------------------

    def add(self, buf: Buffer, offset: int, nbytes: int, digest: int,
            checksum: int) -> Location | None:
        """Index ``[offset, offset + nbytes)`` of ``buf`` (replacing what overlapped): the
        caller hashed exactly these bytes, unwritten since."""
        if nbytes <= 0 or buf.released or not buf.trusted:
            return None
        self._drop(buf, [(offset, offset + nbytes)])
        entries = self._buffers.get(buf.buffer_id)
        if entries is None:
            entries = self._buffers[buf.buffer_id] = _BufferEntries(buf)
        loc = Location(buf, offset, nbytes, checksum, digest)
        j = bisect.bisect_left(entries.starts, offset)
        entries.starts.insert(j, offset)
        entries.locs.insert(j, loc)
        locs = self._tenants.setdefault(buf.tenant, {}).setdefault(digest, [])
        locs.append(loc)
        if len(locs) > MAX_LOCATIONS:  # the places of released buffers go first
            dead = [x for x in locs if x.buf.released or not x.buf.trusted]
            for x in dead or locs[:1]:
                self._remove(x)
        self._adds += 1
        if self._adds % SWEEP_EVERY == 0:
            self.sweep()
        return loc

    def clone(self, src: Buffer, dst: Buffer) -> int:
        """``dst`` holds ``src``'s bytes at the same offsets: index them there too; the count."""
        entries = self._buffers.get(src.buffer_id)
        if entries is None:
            return 0
        n = 0
        for loc in list(entries.locs):
            if self.add(dst, loc.offset, loc.nbytes, loc.digest, loc.checksum) is not None:
                n += 1
        return n

    def forget(self, buf: Buffer, ranges: list[tuple[int, int]]) -> int:
        """These ranges of ``buf`` are about to be written: drop overlapping entries and
        log the write for deferred ones. Every writer calls this first; the count dropped."""
        self._seq += 1
        w = self._logs.get(buf.buffer_id)
        if w is not None:
            w.write(self._seq, ranges)
        dropped = self._drop(buf, ranges)
        self.counters["forgotten"] += dropped
        return dropped

    def _drop(self, buf: Buffer, ranges: list[tuple[int, int]]) -> int:
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
        return dropped

    def sweep(self) -> int:
        """Remove the entries of released buffers; return how many buffers."""
        dead = [e.buf for e in self._buffers.values() if e.buf.released]
        for buf in dead:
            self._drop(buf, [(0, buf.size)])
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

    def keep_on_disk(self, registry: Registry, sweeps: CopyPool, loc: Location) -> None:
        """Copy ``loc``'s bytes to the disk cache as a job of its tenant on ``sweeps``
        (the buffer stays pinned until then)."""
        cache = self.cache
        if cache is None or cache.has(loc.buf.tenant, loc.digest, loc.nbytes) \
                or not cache.accepts(loc.nbytes):
            return
        registry.pin(loc.buf)

        async def write() -> None:
            try:
                async with self._write_slots:
                    view = loc.buf.pool.arena.view(loc.buf.offset + loc.offset, loc.nbytes)
                    await sweeps.run(loc.buf.tenant, cache.write, loc.buf.tenant, loc.digest,
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
                               "deferred": sum(len(q) for q in self._deferred.values()),
                               "write_logs": len(self._logs),
                               "pending_disk_writes": len(self._writes)}
        if self.cache is not None:
            out["disk_cache"] = self.cache.stats()
        return out


def current(buf: Buffer, manifest: dict[str, Entry]) -> dict[str, Entry]:
    """The entries still the buffer's very manifest entries."""
    tensors = buf.tensors
    return {name: e for name, e in manifest.items() if tensors.get(name) is e}


def _touched(entries: dict[str, Entry], written: list[tuple[int, int]]) -> set[str]:
    """The names of ``entries`` whose bytes overlap a ``written`` range."""
    names = list(entries)
    starts = np.fromiter((e["offset"] for e in entries.values()), dtype=np.int64,
                         count=len(names))
    ends = starts + np.fromiter((e["nbytes"] for e in entries.values()), dtype=np.int64,
                                count=len(names))
    hit = np.zeros(len(names), dtype=bool)
    for a, b in written:
        hit |= (starts < b) & (ends > a)
    return {names[i] for i in np.flatnonzero(hit).tolist()}
