"""Where the KV tier's blocks live: a few large segments per tenant and device, each
one registry buffer (one memfd mapped once, charged bytes, an fd and a mapping),
carved into slots by its own slab allocator.

- fds and mappings grow with bytes cached, not block count (250,000 blocks of
  16 KiB take about 70 segments). A freed slot is the next put's (LIFO: warm pages).
- A segment whose last block is freed goes back to the registry at once. A
  segment is one tenant's: no slot is ever another tenant's block.
- Sizes grow geometrically: a power of two at least the block, ``MIN_SEGMENT``,
  the rest of the put, and half of what the tenant holds, at most ``SEGMENT``, and
  no more than quota or pool room (else none: the caller evicts). A block larger
  than ``SEGMENT`` gets a segment of its own (``single``).
- Finding a slot is O(1) in the steady state: the last segment that served is
  tried first, and one that failed a size is not tried for it again until one of
  its slots is freed (``failed_at``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rpcbuf.control.daemon.accounting.buffers import Buffer, Pool
from rpcbuf.dataplane.slab import SlabAllocator

SEGMENT = 64 << 20  # bytes of a full-size segment
MIN_SEGMENT = 1 << 20  # a tenant's first segment, room allowing
SLOT = 4096  # the smallest slot (a page: a block costs at least what a memfd did)
SLAB = 1 << 20  # a slab of small slots of one class
MAX_CLASS = 64 << 10  # blocks up to this size share slabs; larger ones are buddy blocks

_TEMPLATE = SlabAllocator(SEGMENT, SLOT, SLAB, MAX_CLASS)


def slot_size(size: int) -> int:
    """The bytes a block of ``size`` takes in a full-size segment (the quota check)."""
    if size > SEGMENT:
        return -(-size // SLOT) * SLOT
    return _TEMPLATE.block_size(size)


def segment_size(size: int, room: int, want: int = 0, held: int = 0) -> int:
    """A new segment's size for a block of ``size`` given ``room``, ``want`` and ``held``
    (see the module); 0 when it cannot hold even that block."""
    if size > SEGMENT:
        need = -(-size // SLOT) * SLOT
        return need if need <= room else 0
    need = _pow2(max(size, SLOT))  # a buddy block
    target = min(SEGMENT, _pow2(max(need, MIN_SEGMENT, min(want, SEGMENT), held // 2)))
    fit = 1 << (room.bit_length() - 1) if room > 0 else 0
    seg = min(target, fit)
    return seg if seg >= need else 0


def _pow2(n: int) -> int:
    """The least power of two >= ``n`` (>= 1)."""
    return 1 << (n - 1).bit_length()


@dataclass(eq=False)
class Segment:
    buf: Buffer  # the registry's buffer: its memfd and its charges
    alloc: SlabAllocator | None  # None: ``single``, one block at offset 0
    live: int = 0  # blocks in it, pending or committed, freed or not yet
    failed_at: int = 1 << 62  # the smallest size it could not serve since its last free
    populated: bool = False  # its pages backed once (``BlockStore.to_prepare``)

    def take(self, size: int) -> int | None:
        """A slot for ``size`` bytes: its offset in the segment, or None."""
        if size >= self.failed_at:
            return None
        if self.alloc is None:
            got: int | None = 0 if self.live == 0 and size <= self.buf.alloc_size else None
        else:
            got = self.alloc.allocate(size)
        if got is None:
            self.failed_at = size
            return None
        self.live += 1
        return got

    def give(self, offset: int) -> None:
        if self.alloc is not None:
            self.alloc.free(offset)
        self.live -= 1
        self.failed_at = 1 << 62


@dataclass
class Segments:
    all: list[Segment] = field(default_factory=list)
    last: Segment | None = None  # the one that served last: tried first
    nbytes: int = 0  # their sizes together

    def take(self, size: int) -> tuple[Segment, int] | None:
        """A slot for ``size``: (segment, arena offset), or None (make one, or evict)."""
        last = self.last
        if last is not None:
            got = last.take(size)
            if got is not None:
                return last, last.buf.offset + got
        for seg in self.all:
            if seg is last:
                continue
            got = seg.take(size)
            if got is not None:
                self.last = seg
                return seg, seg.buf.offset + got
        return None

    def add(self, buf: Buffer, single: bool) -> Segment:
        alloc = None if single else SlabAllocator(buf.alloc_size, SLOT, SLAB, MAX_CLASS)
        seg = Segment(buf, alloc)
        self.all.append(seg)
        self.nbytes += buf.alloc_size
        return seg

    def remove(self, seg: Segment) -> None:
        """Forget an empty segment (the caller releases its buffer)."""
        if seg.live:
            raise RuntimeError(f"segment {seg.buf.buffer_id} still holds {seg.live} blocks")
        self.all.remove(seg)  # O(segments): a segment empties rarely
        self.nbytes -= seg.buf.alloc_size
        if self.last is seg:
            self.last = None


def pool_of(segments: dict[tuple[str, str], Segments], tenant: str, pool: Pool) -> Segments:
    key = (tenant, pool.key)
    got = segments.get(key)
    if got is None:
        got = segments[key] = Segments()
    return got
