"""Allocators that hand out offsets inside an arena, never touching its memory.

A bad or double free raises ``AllocatorError``; ``stats()`` and
``check_invariants()`` let property tests check every step. Offsets are multiples
of ``min_block`` (256 by default), and ``block_size(size)`` is exactly what a
request takes and ``stats().used`` counts, so quotas are charged before allocating.

- ``buddy`` (default): power-of-two blocks that coalesce on free; a size that is
  no power of two is laid out as its binary decomposition, largest first, so the
  ``offset ^ size`` rule never crosses a root. O(log(arena / min_block)).
- ``linear``: a bump pointer that moves back over freed blocks when the top is
  freed; interior holes wait until then. O(1) amortised.
- ``slab``: requests up to ``max_class`` rounded to a size class (under 20% waste)
  and served from slabs, buddy blocks cut into equal objects; larger ones are
  buddy blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class AllocatorError(Exception):
    """A bad or double free, or a size that is not positive."""


@dataclass(frozen=True)
class AllocatorStats:
    total: int
    used: int
    free: int
    largest_free: int
    count: int

    @classmethod
    def of(cls, total: int, used: int, largest_free: int, count: int) -> AllocatorStats:
        """The figures of an allocator that counts ``used`` bytes of ``total``."""
        return cls(total=total, used=used, free=total - used, largest_free=largest_free,
                   count=count)

    @property
    def fragmentation(self) -> float:
        """0.0 when all free space is one block; close to 1.0 when it is dust."""
        return 0.0 if self.free == 0 else 1.0 - self.largest_free / self.free

    def as_dict(self) -> dict[str, float | int]:
        return {
            "total": self.total,
            "used": self.used,
            "free": self.free,
            "largest_free": self.largest_free,
            "count": self.count,
            "fragmentation": round(self.fragmentation, 6),
        }


@runtime_checkable
class Allocator(Protocol):
    name: str  # a class attribute: the ``--allocator`` choice
    total: int  # usable bytes: offsets lie in [0, total)
    max_size: int  # the largest request that can ever succeed (in the empty arena)

    def __init__(self, size: int, min_block: int = 256) -> None: ...

    def allocate(self, size: int) -> int | None:
        """Offset of ``block_size(size)`` bytes, or None when it cannot fit now.
        AllocatorError for ``size <= 0``."""

    def free(self, offset: int) -> int:
        """Give back the block at ``offset``; its bytes. AllocatorError on a bad free."""

    def block_size(self, size: int) -> int:
        """The exact bytes ``allocate(size)`` takes (and ``used`` counts)."""

    def allocate_at(self, offset: int, size: int) -> bool:
        """Take the block of ``size`` at exactly ``offset`` if it can be handed out now;
        False, nothing changed, otherwise (always False where blocks cannot be placed)."""

    def largest_free(self) -> int: ...

    def stats(self) -> AllocatorStats: ...

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""


def _check_block(min_block: int) -> int:
    """The order (log2) of ``min_block``; raises ValueError if it is not a power of two."""
    if min_block <= 0 or min_block & (min_block - 1):
        raise ValueError("min_block must be a power of two")
    return min_block.bit_length() - 1


def _positive(size: int) -> None:
    if size <= 0:
        raise AllocatorError(f"size must be positive, got {size}")


# -- buddy ----------------------------------------------------------------------


class BuddyAllocator:
    """Power-of-two buddy allocator over ``[0, size)``; offsets only."""

    name = "buddy"

    def __init__(self, size: int, min_block: int = 256) -> None:
        self.min_order = _check_block(min_block)
        self.total = (size >> self.min_order) << self.min_order
        if self.total <= 0:
            raise ValueError(f"arena of {size} bytes is smaller than one block ({min_block})")
        self.max_order = self.total.bit_length() - 1
        self.max_size = 1 << self.max_order  # the largest root block
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._allocated: dict[int, int] = {}  # offset -> order
        self._used = 0
        offset = 0
        for order in range(self.max_order, self.min_order - 1, -1):
            if self.total & (1 << order):
                self._free[order].add(offset)
                offset += 1 << order

    def block_size(self, size: int) -> int:
        return 1 << self._order_for(size)

    def _order_for(self, size: int) -> int:
        _positive(size)
        return max(self.min_order, (size - 1).bit_length())

    def allocate(self, size: int) -> int | None:
        order = self._order_for(size)
        if order > self.max_order:
            return None
        k = order
        while k <= self.max_order and not self._free[k]:
            k += 1
        if k > self.max_order:
            return None
        offset = self._free[k].pop()
        while k > order:  # split, keeping the lower half
            k -= 1
            self._free[k].add(offset + (1 << k))
        self._allocated[offset] = order
        self._used += 1 << order
        return offset

    def allocate_at(self, offset: int, size: int) -> bool:
        """Take the block at exactly ``offset`` if free (splitting down to it); else False."""
        order = self._order_for(size)
        if order > self.max_order or offset < 0 or offset % (1 << order):
            return False
        for k in range(order, self.max_order + 1):
            start = offset & ~((1 << k) - 1)
            if start in self._free[k]:
                break
            if start in self._allocated:
                return False
        else:
            return False
        self._free[k].remove(start)
        while k > order:  # split, keeping the half that holds ``offset``
            k -= 1
            half = 1 << k
            if offset >= start + half:
                self._free[k].add(start)
                start += half
            else:
                self._free[k].add(start + half)
        self._allocated[offset] = order
        self._used += 1 << order
        return True

    def free(self, offset: int) -> int:
        """Free the block at ``offset``; return its size. Raises on a bad free."""
        order = self._allocated.pop(offset, None)
        if order is None:
            raise AllocatorError(f"free of offset {offset} that is not allocated")
        self._used -= 1 << order
        size = 1 << order
        while order < self.max_order:
            buddy = offset ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].discard(buddy)
            offset = min(offset, buddy)
            order += 1
        self._free[order].add(offset)
        return size

    def allocated_size(self, offset: int) -> int | None:
        """Size of the allocated block at ``offset``, None if there is none."""
        order = self._allocated.get(offset)
        return None if order is None else 1 << order

    def largest_free(self) -> int:
        for order in range(self.max_order, self.min_order - 1, -1):
            if self._free[order]:
                return 1 << order
        return 0

    def stats(self) -> AllocatorStats:
        return AllocatorStats.of(self.total, self._used, self.largest_free(),
                                 len(self._allocated))

    def check_invariants(self) -> None:
        spans: list[tuple[int, int]] = [(o, 1 << k) for o, k in self._allocated.items()]
        free_bytes = 0
        for order, offsets in enumerate(self._free):
            for o in offsets:
                assert order >= self.min_order, "free block below the minimum order"
                assert o % (1 << order) == 0, f"free block {o} misaligned for order {order}"
                spans.append((o, 1 << order))
                free_bytes += 1 << order
        for o, k in self._allocated.items():
            assert o % (1 << k) == 0, f"allocated block {o} misaligned"
        spans.sort()
        pos = 0
        for o, size in spans:
            assert o == pos, f"gap or overlap at {pos} (next block at {o})"
            pos = o + size
        assert pos == self.total, "blocks do not cover the arena"
        assert free_bytes + self._used == self.total, "used + free != total"


# -- linear ---------------------------------------------------------------------


class LinearAllocator:
    """Bump pointer over ``[0, size)`` that moves back when the top is freed; a freed
    block below the top stays a hole until every block above it is freed."""

    name = "linear"

    def __init__(self, size: int, min_block: int = 256) -> None:
        order = _check_block(min_block)
        self.align = min_block
        self.total = (size >> order) << order
        if self.total <= 0:
            raise ValueError(f"arena of {size} bytes is smaller than one block ({min_block})")
        self.max_size = self.total
        self._stack: list[tuple[int, int]] = []  # (offset, size), ascending, contiguous from 0
        self._live: dict[int, int] = {}  # offset -> size
        self._top = 0
        self._used = 0

    def block_size(self, size: int) -> int:
        _positive(size)
        return -(-size // self.align) * self.align

    def allocate(self, size: int) -> int | None:
        n = self.block_size(size)
        offset = self._top
        if offset + n > self.total:
            return None
        self._stack.append((offset, n))
        self._live[offset] = n
        self._top = offset + n
        self._used += n
        return offset

    def free(self, offset: int) -> int:
        n = self._live.pop(offset, None)
        if n is None:
            raise AllocatorError(f"free of offset {offset} that is not allocated")
        self._used -= n
        if not self._live:  # everything free: start over from 0
            self._stack.clear()
            self._top = 0
        elif offset + n == self._top:  # the top block: move back over holes below it
            stack, live = self._stack, self._live
            stack.pop()
            while stack[-1][0] not in live:
                stack.pop()
            last_offset, last_size = stack[-1]
            self._top = last_offset + last_size
        return n

    def allocate_at(self, offset: int, size: int) -> bool:
        """Never: blocks go at the top, in order (``Allocator.allocate_at``)."""
        return False

    def largest_free(self) -> int:
        return self.total - self._top

    def stats(self) -> AllocatorStats:
        return AllocatorStats.of(self.total, self._used, self.largest_free(),
                                 len(self._live))

    def check_invariants(self) -> None:
        pos = 0
        for offset, n in self._stack:
            assert offset == pos, f"gap or overlap at {pos} (next block at {offset})"
            assert n > 0 and n % self.align == 0, f"block {offset} has bad size {n}"
            pos = offset + n
        assert pos == self._top, f"top {self._top} is not the end of the last block ({pos})"
        assert self._top <= self.total, "top beyond the arena"
        assert not self._stack or self._stack[-1][0] in self._live, "top block is a hole"
        sizes = dict(self._stack)
        assert all(sizes.get(o) == n for o, n in self._live.items()), "live block not on the stack"
        assert self._used == sum(self._live.values()), "used != sum of live blocks"
