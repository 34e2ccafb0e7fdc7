"""Allocators that hand out offsets inside an arena.

An allocator never touches the arena's memory: it deals in offsets and keeps
all of its bookkeeping outside (like spaskalev/buddy_alloc and
sebbbi/OffsetAllocator).  A bad or double free raises ``AllocatorError``;
``stats()`` and ``check_invariants()`` let property tests check it after every
step.

The buddy allocator splits the arena into power-of-two blocks of at least
``min_block`` bytes (256 by default, so every offset is GPU-friendly aligned).
An arena whose size is not a power of two is laid out as its binary
decomposition, largest block first, so every root block is aligned to its own
size and the usual ``offset ^ size`` buddy rule never crosses a root.  Free
lists are sets per order: allocate and free are O(log(arena / min_block)).
"""

from __future__ import annotations

from dataclasses import dataclass


class AllocatorError(Exception):
    """A bad or double free, or a request the allocator can never satisfy."""


@dataclass(frozen=True)
class AllocatorStats:
    total: int
    used: int
    free: int
    largest_free: int
    count: int

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


class BuddyAllocator:
    """Power-of-two buddy allocator over ``[0, size)``; offsets only."""

    name = "buddy"

    def __init__(self, size: int, min_block: int = 256) -> None:
        if min_block <= 0 or min_block & (min_block - 1):
            raise ValueError("min_block must be a power of two")
        self.min_order = min_block.bit_length() - 1
        self.total = (size >> self.min_order) << self.min_order
        if self.total <= 0:
            raise ValueError(f"arena of {size} bytes is smaller than one block ({min_block})")
        self.max_order = self.total.bit_length() - 1
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]
        self._allocated: dict[int, int] = {}  # offset -> order
        self._used = 0
        offset = 0
        for order in range(self.max_order, self.min_order - 1, -1):
            if self.total & (1 << order):
                self._free[order].add(offset)
                offset += 1 << order

    def block_size(self, size: int) -> int:
        """The bytes a request of ``size`` really takes."""
        return 1 << self._order_for(size)

    def _order_for(self, size: int) -> int:
        if size <= 0:
            raise AllocatorError(f"size must be positive, got {size}")
        return max(self.min_order, (size - 1).bit_length())

    def allocate(self, size: int) -> int | None:
        """Return the offset of a block of at least ``size`` bytes, or None if full."""
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

    def largest_free(self) -> int:
        for order in range(self.max_order, self.min_order - 1, -1):
            if self._free[order]:
                return 1 << order
        return 0

    def can_fit(self, size: int) -> bool:
        try:
            return self._order_for(size) <= self.max_order and self.largest_free() >= size
        except AllocatorError:
            return False

    def stats(self) -> AllocatorStats:
        return AllocatorStats(
            total=self.total,
            used=self._used,
            free=self.total - self._used,
            largest_free=self.largest_free(),
            count=len(self._allocated),
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent."""
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


ALLOCATORS = {"buddy": BuddyAllocator}


def make_allocator(name: str, size: int) -> BuddyAllocator:
    try:
        cls = ALLOCATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown allocator {name!r}; available: {', '.join(sorted(ALLOCATORS))}"
        ) from None
    return cls(size)
