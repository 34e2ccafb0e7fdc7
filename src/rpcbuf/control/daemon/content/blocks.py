"""The keyed block tier: each tenant's blocks by key, their LRU order, TTLs and
counters. Plain synchronous code (decide here, the ops do the I/O).

- A block is a light registry buffer (``block_key`` set) over a slot of one of its
  tenant's segments, so the data paths carry it like any buffer and the registry's
  rules hold: one of the tenant's N, pinned while read, freed once into its
  segment. Segments hold the memory and the charges (bytes, an fd and a mapping),
  so fds stay flat while block counts grow. Blocks have no name, lease or session,
  are never listed as buffers, and their ids never leave the daemon.
- Writes are two-phase: ``allocate`` gives pending buffers (in no key map, unseen),
  ``commit`` makes them the keys' blocks all at once; a failed put ``discard``s.
- A full tier evicts the tenant's own least recently used unheld blocks, one at a
  time, until a slot or a segment frees. A batch bigger than the quota is refused
  before any eviction, and nothing is evicted while the queue of waiters (not
  room) is what stops the put: another tenant's waiter never costs a tenant blocks.
- Expired blocks go at ``expire`` and are never served after (``lookup`` checks).
- No tenant-sized work on the loop: ``blocks`` by key; ``lru`` per device holds
  only unpinned blocks (``on_pin`` takes them out and back as most recent), so
  eviction takes the head; ``order`` keeps keys sorted, so a page costs
  O(log n + page). ``steps`` counts entries looked at (the tests bound it).
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
        """``block`` is the most recently used now (a held one comes back as such when let go)."""
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
        """``on_pin``: a committed block leaves the eviction order while held."""
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
        """``on_block_free``: an empty segment goes back to the registry, unless a live
        session was handed its fd: then it stays charged and the tenant's until then."""
        seg_buf = buf.segment
        assert seg_buf is not None
        seg = self._segment_of[seg_buf.buffer_id]
        seg.give(buf.offset - seg_buf.offset)
        if seg.live == 0 and not seg_buf.exported_to:
            self._drop_segment(buf.tenant, buf.pool, seg)

    def _unexported(self, buf: Buffer) -> None:
        """``on_unexported``: an empty segment no session holds an fd of goes back now."""
        seg = self._segment_of.get(buf.buffer_id)
        if seg is not None and seg.live == 0 and seg.buf is buf:
            self._drop_segment(buf.tenant, buf.pool, seg)

    def to_prepare(self, bufs: list[Buffer]) -> tuple[list[Buffer], list[Buffer]]:
        """The segments of a put's pending ``bufs`` that need work before a byte lands:
        (kept ones still being zeroed, new ones whose pages to back once)."""
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
        """The tenant's live block of ``key``, or None: missing, expired and another
        tenant's are the same answer."""
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
        """``blocks`` (from ``lookup(touch=False)``) are used now, those still under their key."""
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
        """A page of the tenant's sorted keys (at most ``limit`` after ``start_after``,
        with ``prefix``) and whether more follow; O(log n + limit)."""
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
        """Pending buffers for a put of ``sizes`` on ``pool``, all or none, evicting
        while room (not the queue) is lacking. QUOTA_EXCEEDED or OUT_OF_MEMORY with
        nothing evicted when it could never fit; else the last try's error (what was
        evicted stays evicted: a cache)."""
        self.admit(tenant, pool, sizes)
        return self.allocate_admitted(tenant, pool, sizes)

    def admit(self, tenant: str, pool: Pool, sizes: list[int]) -> None:
        """Refuse, before anything changes, a put that could never fit quota or device."""
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
        """A pending block in a free slot of the tenant's segments or a new one; None:
        neither (the caller evicts). QUOTA_EXCEEDED: N reached, or no segment may be charged."""
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
        """Release the tenant's least recently used unheld block on ``pool`` (O(1));
        False when there is none."""
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
        """Hand back a failed put's pending buffers (never one a key names already)."""
        for buf in bufs:
            if not buf.block_key:
                self._registry.release(buf)

    def commit(self, tenant: str, keys: list[str], bufs: list[Buffer], sizes: list[int],
               checksums: list[int], metas: list[bytes] | None,
               ttl: float | None) -> bool:
        """The put's blocks become the keys' blocks, all at once; what the keys named
        before is released. True when one has a ttl (the expiry timer needs a look)."""
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
