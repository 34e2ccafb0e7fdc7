"""The keyed block tier: each tenant's blocks by key, their LRU order, TTLs
and counters.  Plain synchronous code (decide here; ``blockops`` does the
I/O), as the ``Registry`` is.

A block is a light buffer of the registry (``Buffer.block_key`` set) over a
slot of one of its tenant's segments (``segments.py``: a few large memfds per
tenant, carved by a slab allocator; ``Registry.add_block``): its bytes lie in
the arena like any buffer's, so the data paths (UCX, the same-host staging
area) carry them exactly as they carry buffers, and the registry's rules
hold for them: one of the tenant's N buffers, pinned while a transfer reads
them (a block removed or evicted meanwhile is freed when the read ends),
freed once, into its segment (``_slot_freed``).  The segments hold the
memory and the charges (bytes, an fd and a mapping each), so the daemon's
fds and mappings stay as they are while a tenant's block count grows.  The
block store owns those buffers: they have no name, no lease and no
session, are never listed as buffers, and their ids never leave the daemon.

Writes are two-phase: ``allocate`` gives a put its buffers (pending: in no
key map, so no reader can see them), and only ``commit``, once every byte
landed and matched its checksum, makes them the keys' blocks, all at once
(replacing what the keys named before).  A put that fails hands its
buffers back with ``discard``.

A full tier evicts instead of refusing: when no segment of the tenant has a
free slot for a new block and its quota (or the device) has no room for a
new segment, ``allocate`` releases the tenant's least recently used blocks
that no transfer holds, one at a time, until a slot is free or a segment
emptied (and given back) makes room for one of the size needed. Only the
tenant's own blocks are ever evicted, a batch bigger than the whole quota is
refused before anything is evicted, and nothing is evicted when what the put
waits for is the queue of requests waiting for memory, not room
(``Registry.queued_ahead``): another tenant's waiter never costs a tenant
its blocks. Expired blocks (``ttl``) go when their time comes (``expire``,
called by the daemon's expiry timer) and are never served after it
(``lookup`` checks).

No tenant-sized work on the event loop: each tier keeps its blocks three
ways, each O(1) or O(log n) to change.  ``blocks`` by key; ``lru``, per
device, only the blocks nobody holds (``pins == 0``), least recently used
first, so eviction takes the first entry and never walks past attached or
read blocks: the registry tells the store when a block's first pin is taken
and its last one dropped (``Registry.on_pin``), and the block leaves the
order or comes back as the most recently used (a detach is a use).  (A
put's blocks enter the order at commit, in the put's key order, while its
request still holds them; eviction drops such an entry from the order, once,
if it finds one at the head.)  And ``order``, the keys sorted
(``SortedKeys``), so a page of ``keys`` costs O(log n + page).  ``steps``
counts the entries eviction and listing looked at (what the tests bound).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rpcbuf.control.daemon.accounting.buffers import Buffer, Pool
from rpcbuf.control.daemon.accounting.leases import Leases
from rpcbuf.control.daemon.accounting.registry import Registry
from rpcbuf.control.daemon.content.segments import (
    SEGMENT,
    Segment,
    Segments,
    pool_of,
    segment_size,
    slot_size,
)
from rpcbuf.control.daemon.content.sortedkeys import SortedKeys
from rpcbuf.control.wire.errors import OutOfMemory, QuotaExceeded

COUNTERS = ("hits", "misses", "puts", "evictions", "expired", "removed")


@dataclass
class Block:
    key: str
    buf: Buffer
    nbytes: int
    checksum: int  # xxh3-64 of its bytes, as they landed
    meta: bytes | None
    created_at: float
    expires_at: float | None  # the registry's clock (time.time())

    def describe(self, meta: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"key": self.key, "nbytes": self.nbytes, "checksum": self.checksum,
                               "created_at": self.created_at, "expires_at": self.expires_at}
        if meta:
            out["meta"] = self.meta
        return out


@dataclass
class Tier:
    """One tenant's blocks (see the module): ``blocks`` by key, ``lru`` per
    device the unpinned ones from least to most recently used, ``order``
    their keys sorted."""

    blocks: dict[str, Block] = field(default_factory=dict)
    lru: dict[str, OrderedDict[str, Block]] = field(default_factory=dict)
    order: SortedKeys = field(default_factory=SortedKeys)
    nbytes: int = 0  # their bytes (what the blocks hold, not the blocks' alloc sizes)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def evictable(self, pool: Pool) -> OrderedDict[str, Block]:
        lru = self.lru.get(pool.key)
        if lru is None:
            lru = self.lru[pool.key] = OrderedDict()
        return lru

    def used(self, block: Block) -> None:
        """``block`` is the most recently used now (if nobody holds it: a
        held one comes back as the most recently used when let go)."""
        lru = self.lru.get(block.buf.pool.key)
        if lru is not None and block.key in lru:
            lru.move_to_end(block.key)


class BlockStore:
    def __init__(self, registry: Registry) -> None:
        self._registry = registry
        self._tiers: dict[str, Tier] = {}
        self._leases: Leases[tuple[str, str]] = Leases(self._expires_at, self._live_leases)
        self.steps = 0  # entries eviction and listing looked at (see the module)
        self._segments: dict[tuple[str, str], Segments] = {}  # (tenant, pool key) ->
        self._segment_of: dict[str, Segment] = {}  # a segment's buffer id -> it
        registry.on_pin = self._pinned
        registry.on_block_free = self._slot_freed
        registry.on_unexported = self._unexported

    def _tier(self, tenant: str) -> Tier:
        tier = self._tiers.get(tenant)
        if tier is None:
            tier = self._tiers[tenant] = Tier()
        return tier

    def _pinned(self, buf: Buffer, held: bool) -> None:
        """The registry's ``on_pin``: ``buf``'s first pin was taken (``held``)
        or its last one dropped.  A committed block leaves the eviction order
        while held, and comes back as the most recently used."""
        if not buf.block_key:
            return  # not a block, or a pending one (in no order yet)
        tier = self._tiers.get(buf.tenant)
        block = None if tier is None else tier.blocks.get(buf.block_key)
        if tier is None or block is None or block.buf is not buf:
            return  # replaced or dropped meanwhile: released, out of every order
        lru = tier.evictable(buf.pool)
        if held:
            lru.pop(block.key, None)
        else:
            lru[block.key] = block

    def _slot_freed(self, buf: Buffer) -> None:
        """The registry's ``on_block_free``: ``buf``'s slot is free again; a
        segment left empty goes back to the registry (and its bytes to the
        tenant's quota), unless a live session was handed its fd: then its
        bytes stay charged whatever becomes of it (``Registry.export``), so
        it stays the tenant's, its slots free for the next puts, until the
        last such session ends (``_unexported``)."""
        seg_buf = buf.segment
        assert seg_buf is not None
        seg = self._segment_of[seg_buf.buffer_id]
        seg.give(buf.offset - seg_buf.offset)
        if seg.live == 0 and not seg_buf.exported_to:
            self._drop_segment(buf.tenant, buf.pool, seg)

    def _unexported(self, buf: Buffer) -> None:
        """The registry's ``on_unexported``: no live session holds an fd of
        ``buf`` any more; an empty segment goes back now."""
        seg = self._segment_of.get(buf.buffer_id)
        if seg is not None and seg.live == 0 and seg.buf is buf:
            self._drop_segment(buf.tenant, buf.pool, seg)

    def to_prepare(self, bufs: list[Buffer]) -> tuple[list[Buffer], list[Buffer]]:
        """The segments of a put's pending ``bufs`` that need work before a
        byte lands: (kept blocks still being zeroed, which nothing may write
        before ``zeroed`` is done; new ones whose pages to back once, each
        handed out once: ``populated``)."""
        zeroing: list[Buffer] = []
        fresh: list[Buffer] = []
        seen: set[str] = set()
        for buf in bufs:
            seg_buf = buf.segment
            if seg_buf is None or seg_buf.buffer_id in seen:
                continue
            seen.add(seg_buf.buffer_id)
            if seg_buf.zeroed is not None and not seg_buf.zeroed.done():
                zeroing.append(seg_buf)
            seg = self._segment_of[seg_buf.buffer_id]
            if not seg.populated:
                seg.populated = True
                if seg_buf.zeroed is None:  # a kept block is backed already
                    fresh.append(seg_buf)
        return zeroing, fresh

    def _drop_segment(self, tenant: str, pool: Pool, seg: Segment) -> None:
        pool_of(self._segments, tenant, pool).remove(seg)
        del self._segment_of[seg.buf.buffer_id]
        self._registry.release(seg.buf)

    # -- reads ---------------------------------------------------------------------------

    def lookup(self, tenant: str, key: str, touch: bool = True) -> Block | None:
        """The tenant's live block of ``key`` (most recently used now, when
        ``touch``), or None: no such key, expired, or another tenant's (the
        same answer)."""
        tier = self._tiers.get(tenant)
        if tier is None:
            return None
        block = tier.blocks.get(key)
        if block is None:
            return None
        if block.expires_at is not None and block.expires_at <= self._registry.clock():
            self._drop(tenant, tier, block, "expired")
            return None
        if touch:
            tier.used(block)
        return block

    def touch(self, tenant: str, blocks: Iterable[Block]) -> None:
        """``blocks`` (found by ``lookup(..., touch=False)``) are used now: the
        most recently used of their tier, those still under their key."""
        tier = self._tiers.get(tenant)
        if tier is None:
            return
        for b in blocks:
            if tier.blocks.get(b.key) is b:
                tier.used(b)

    def count(self, tenant: str, name: str, n: int = 1) -> None:
        self._tier(tenant).counts[name] += n

    def keys(self, tenant: str, prefix: str | None, start_after: str | None,
             limit: int) -> tuple[list[str], bool]:
        """The tenant's keys in sorted order: at most ``limit`` after
        ``start_after``, starting with ``prefix``; and whether more follow.
        O(log n + limit): the page starts where the cursor (``start_after``,
        or the prefix) lies in ``order`` and stops at the first key past the
        prefix; what has expired is dropped first (each block once)."""
        self.expire()
        tier = self._tiers.get(tenant)
        if tier is None:
            return [], False
        if prefix is not None and (start_after is None or start_after < prefix):
            keys = tier.order.since(prefix, inclusive=True)
        else:
            keys = tier.order.since(start_after, inclusive=False)
        found: list[str] = []
        for k in keys:
            self.steps += 1
            if prefix is not None and not k.startswith(prefix):
                break  # sorted: every later key is past the prefix too
            if len(found) == limit:
                return found, True
            found.append(k)
        return found, False

    def stats(self, tenant: str) -> dict[str, Any]:
        tier = self._tiers.get(tenant) or Tier()
        segs = [s for (t, _), s in self._segments.items() if t == tenant]
        return {"blocks": len(tier.blocks), "bytes": tier.nbytes, **tier.counts,
                "segments": sum(len(s.all) for s in segs),
                "segment_bytes": sum(s.nbytes for s in segs)}

    def totals(self) -> dict[str, dict[str, Any]]:
        """Every tenant's ``stats`` (the operator's view: metrics)."""
        return {t: self.stats(t) for t in sorted(self._tiers)}

    # -- writes --------------------------------------------------------------------------

    def allocate(self, tenant: str, pool: Pool, sizes: list[int]) -> list[Buffer]:
        """Pending buffers for a put of blocks of ``sizes`` on ``pool``, all
        or none, evicting the tenant's least recently used unpinned blocks
        while there is no room (never while the queue of waiting requests, not
        room, is what stops it: OUT_OF_MEMORY, ``reason: waiters``).
        QUOTA_EXCEEDED or OUT_OF_MEMORY, with nothing evicted, when the
        batch could never fit the quota or the device (``admit``); the error
        of the last try when evicting everything it may did not make room
        (what was evicted stays evicted: a cache)."""
        self.admit(tenant, pool, sizes)
        return self.allocate_admitted(tenant, pool, sizes)

    def admit(self, tenant: str, pool: Pool, sizes: list[int]) -> None:
        """Refuse, before anything is allocated or evicted, a put of blocks
        of ``sizes`` that could never fit the tenant's quota or the device."""
        reg = self._registry
        alloc = pool.allocator
        total = sum(map(slot_size, sizes))
        quota = reg.books.quota_for(tenant)
        if quota.bytes_per_device is not None and total > quota.bytes_per_device:
            raise QuotaExceeded(
                f"{len(sizes)} blocks take {total} bytes on {pool.key}; tenant {tenant!r}'s "
                f"quota is {quota.bytes_per_device}",
                {"requested": total, "quota": quota.bytes_per_device})
        if quota.buffers is not None and len(sizes) > quota.buffers:
            raise QuotaExceeded(f"{len(sizes)} blocks; tenant {tenant!r} may hold "
                                f"{quota.buffers} buffers and blocks",
                                {"blocks": len(sizes), "quota": quota.buffers})
        if any(alloc.block_size(s) > alloc.max_size for s in sizes if s > SEGMENT) \
                or total > alloc.stats().total:
            raise OutOfMemory(f"{len(sizes)} blocks of {total} bytes can never fit on "
                              f"{pool.key}", {"requested": total, "device": pool.key})

    def allocate_admitted(self, tenant: str, pool: Pool, sizes: list[int]) -> list[Buffer]:
        """``allocate`` of (a slice of) a put that ``admit`` let through."""
        reg = self._registry
        self.expire()
        segs = pool_of(self._segments, tenant, pool)
        out: list[Buffer] = []
        want = sum(map(slot_size, sizes))  # what the rest of the put takes: a new segment's hint
        try:
            for size in sizes:
                while True:
                    error: Exception | None = None
                    try:
                        buf = self._slot(tenant, pool, segs, size, want)
                    except (QuotaExceeded, OutOfMemory) as exc:
                        buf, error = None, exc
                    if buf is not None:
                        break
                    if error is None and reg.queued_ahead(tenant, pool):
                        # Requests waiting for memory come first, and evicting
                        # would not let this put pass them: no room is lacking.
                        raise OutOfMemory(
                            f"requests waiting for memory on {pool.key} come first",
                            {**pool.oom_details(size), "reason": "waiters"})
                    if not self._evict_one(tenant, pool):
                        raise error or reg.out_of_memory(pool, size)
                out.append(buf)  # pending: the store's, in no key map yet
                want -= slot_size(size)
        except BaseException:
            self.discard(out)
            raise
        return out

    def _slot(self, tenant: str, pool: Pool, segs: Segments, size: int,
              want: int) -> Buffer | None:
        """A pending block of ``size`` in a free slot of the tenant's
        segments, or of a new one (``Registry.allocate_segment``); None when
        there is neither (the caller evicts).  QUOTA_EXCEEDED: the tenant
        holds its N already, or no segment may be charged."""
        reg = self._registry
        reg.books.check_count(tenant)
        got = segs.take(size)
        if got is None:
            room, by_quota = reg.books.room(tenant, pool)
            nbytes = segment_size(size, room, want, segs.nbytes)
            if not nbytes:
                if not by_quota:
                    raise reg.out_of_memory(pool, size)
                raise QuotaExceeded(f"no room in tenant {tenant!r}'s quota for a segment of "
                                    f"{size} bytes on {pool.key}",
                                    {"requested": size, "room": room, "device": pool.key})
            seg_buf = reg.allocate_segment(tenant, pool, nbytes)
            if seg_buf is None:
                return None
            seg = segs.add(seg_buf, single=size > SEGMENT)
            self._segment_of[seg_buf.buffer_id] = seg
            got = segs.take(size)
            if got is None:  # a bug: a fresh segment is sized for it
                self._drop_segment(tenant, pool, seg)
                raise reg.out_of_memory(pool, size)
        seg, offset = got
        alloc = seg.buf.alloc_size if seg.alloc is None else seg.alloc.block_size(size)
        try:
            return reg.add_block(seg.buf, offset, size, alloc)
        except BaseException:
            seg.give(offset - seg.buf.offset)
            if seg.live == 0:
                self._drop_segment(tenant, pool, seg)
            raise

    def _evict_one(self, tenant: str, pool: Pool) -> bool:
        """Release the tenant's least recently used block on ``pool`` that
        nobody holds (the first of its ``lru``: O(1)); False when there is
        none."""
        tier = self._tiers.get(tenant)
        lru = None if tier is None else tier.lru.get(pool.key)
        if tier is None:
            return False
        while lru:
            self.steps += 1
            block = next(iter(lru.values()))
            if block.buf.pins:
                # Committed while its put's request still held it (``commit``):
                # out of the order until let go, then the most recently used.
                # Each such step is paid for by that commit: O(1) amortized.
                del lru[block.key]
                continue
            self._drop(tenant, tier, block, "evictions")
            return True
        return False

    def discard(self, bufs: list[Buffer]) -> None:
        """Hand back a failed put's pending buffers (freed once unpinned); one
        a key names already (committed: ``block_key`` set) is never handed back."""
        for buf in bufs:
            if not buf.block_key:
                self._registry.release(buf)

    def commit(self, tenant: str, keys: list[str], bufs: list[Buffer], sizes: list[int],
               checksums: list[int], metas: list[bytes] | None,
               ttl: float | None) -> bool:
        """The put's blocks become the keys' blocks, all at once; what the
        keys named before is released (freed when its readers end).  True
        when one of them has a ttl (the expiry timer needs a look)."""
        tier = self._tier(tenant)
        now = self._registry.clock()
        expires = None if ttl is None else now + ttl
        for i, (key, buf) in enumerate(zip(keys, bufs, strict=True)):
            old = tier.blocks.get(key)
            if old is not None:
                self._drop(tenant, tier, old, None, keep_key=True)  # the key stays
            else:
                tier.order.add(key)
            buf.block_key = key
            block = Block(key, buf, sizes[i], checksums[i], None if metas is None else metas[i],
                          now, expires)
            tier.blocks[key] = block
            # In the order now, in the put's key order, even while the put's
            # request still holds it: let go (``_pinned``) it keeps its place
            # (its request unpins last key first, which reversed a put's order).
            tier.evictable(buf.pool)[key] = block
            tier.nbytes += block.nbytes
            if expires is not None:
                self._leases.count += 1
                self._leases.push((tenant, key), expires)
        tier.counts["puts"] += len(keys)
        return expires is not None

    def remove(self, tenant: str, keys: list[str]) -> int:
        tier = self._tiers.get(tenant)
        if tier is None:
            return 0
        n = 0
        for key in keys:
            block = tier.blocks.get(key)
            if block is not None:
                self._drop(tenant, tier, block, "removed")
                n += 1
        return n

    def _drop(self, tenant: str, tier: Tier, block: Block, counter: str | None,
              keep_key: bool = False) -> None:
        del tier.blocks[block.key]
        lru = tier.lru.get(block.buf.pool.key)
        if lru is not None:
            lru.pop(block.key, None)
        if not keep_key:
            tier.order.discard(block.key)
        tier.nbytes -= block.nbytes
        if block.expires_at is not None:
            self._leases.count -= 1
        if counter is not None:
            tier.counts[counter] += 1
        self._registry.release(block.buf)  # freed now, or when its last reader ends

    # -- time ----------------------------------------------------------------------------

    def _expires_at(self, tk: tuple[str, str]) -> float | None:
        tier = self._tiers.get(tk[0])
        block = None if tier is None else tier.blocks.get(tk[1])
        return None if block is None else block.expires_at

    def _live_leases(self) -> Iterable[tuple[tuple[str, str], float]]:
        return (((t, k), b.expires_at) for t, tier in self._tiers.items()
                for k, b in tier.blocks.items() if b.expires_at is not None)

    def next_expiry(self) -> float | None:
        return self._leases.next()

    def expire(self) -> list[Block]:
        """Drop every block whose ttl ran out; return them."""
        out: list[Block] = []
        for (tenant, key), _ in self._leases.due(self._registry.clock()):
            tier = self._tiers[tenant]
            block = tier.blocks[key]
            self._drop(tenant, tier, block, "expired")
            out.append(block)
        return out
