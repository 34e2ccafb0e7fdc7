"""The ``slab`` allocator: small requests rounded to a size class and served from
slabs (buddy blocks cut into equal objects, an O(1) free-slot stack each), larger
ones plain buddy blocks.
"""

from __future__ import annotations

from bisect import bisect_left

from rpcbuf.dataplane.allocator import (
    AllocatorError,
    AllocatorStats,
    BuddyAllocator,
    _check_block,
    _positive,
)


def size_classes(min_block: int, max_class: int) -> list[int]:
    """min_block x 1..4, then four steps per doubling: 5/4, 6/4, 7/4, 8/4 of a power of two."""
    classes = [min_block * i for i in (1, 2, 3, 4)]
    base = 4 * min_block
    while classes[-1] < max_class:
        classes += [base * i // 4 for i in (5, 6, 7, 8)]
        base *= 2
    return [c for c in classes if c <= max_class]


class _Slab:
    """One buddy block cut into ``nslots`` objects of ``obj_size`` bytes."""

    __slots__ = ("base", "cls", "count", "free_slots", "fresh", "live", "nslots", "obj_size", "pos")

    def __init__(self, base: int, cls: int, obj_size: int, nslots: int) -> None:
        self.base = base
        self.cls = cls  # index into the size classes
        self.obj_size = obj_size
        self.nslots = nslots
        self.count = 0  # live objects
        self.fresh = 0  # slots >= fresh were never handed out (no O(n) set-up)
        self.free_slots: list[int] = []  # freed slots below ``fresh``, reused LIFO
        self.live = bytearray(nslots)  # 1 = allocated: catches double frees
        self.pos = -1  # index in its class's partial list, -1 when full


class SlabAllocator:
    """Small requests from per-class slabs, large ones from the buddy allocator."""

    name = "slab"

    def __init__(self, size: int, min_block: int = 256, slab_size: int = 1 << 20,
                 max_class: int = 64 << 10) -> None:
        self.buddy = BuddyAllocator(size, min_block)
        self.total = self.buddy.total
        self.max_size = self.buddy.max_size
        self.min_block = min_block
        _check_block(slab_size)
        # A slab must fit in the arena's largest root block and hold at least 16 objects.
        self.slab_size = max(min_block, min(slab_size, 1 << self.buddy.max_order))
        self.max_class = min(max_class, self.slab_size // 16)
        self.classes = size_classes(min_block, self.max_class)
        self.max_class = self.classes[-1] if self.classes else 0
        # class index for each size rounded up to min_block: O(1) lookup
        self._class_of = [bisect_left(self.classes, (i + 1) * min_block)
                          for i in range(self.max_class // min_block)]
        self._partial: list[list[_Slab]] = [[] for _ in self.classes]
        self._slabs: dict[int, _Slab] = {}  # base -> slab
        self._mask = ~(self.slab_size - 1)
        self._large: dict[int, int] = {}  # offset -> block size
        self._large_used = 0
        self._small_used = 0
        self._small_count = 0

    def block_size(self, size: int) -> int:
        _positive(size)
        if size <= self.max_class:
            return self.classes[self._class_of[(size - 1) // self.min_block]]
        return self.buddy.block_size(size)

    def allocate(self, size: int) -> int | None:
        _positive(size)
        if size > self.max_class:
            offset = self.buddy.allocate(size)
            if offset is not None:
                n = self.buddy.block_size(size)
                self._large[offset] = n
                self._large_used += n
            return offset
        cls = self._class_of[(size - 1) // self.min_block]
        partial = self._partial[cls]
        if partial:
            slab = partial[-1]
        else:
            base = self.buddy.allocate(self.slab_size)
            if base is None:
                return None
            obj = self.classes[cls]
            slab = _Slab(base, cls, obj, self.slab_size // obj)
            self._slabs[base] = slab
            slab.pos = len(partial)
            partial.append(slab)
        slot = slab.free_slots.pop() if slab.free_slots else self._take_fresh(slab)
        slab.live[slot] = 1
        slab.count += 1
        if slab.count == slab.nslots:  # full: leave the partial list
            self._unlink(slab)
        self._small_used += slab.obj_size
        self._small_count += 1
        return slab.base + slot * slab.obj_size

    @staticmethod
    def _take_fresh(slab: _Slab) -> int:
        slot = slab.fresh
        slab.fresh += 1
        return slot

    def _unlink(self, slab: _Slab) -> None:
        """Remove ``slab`` from its partial list in O(1) (swap with the last)."""
        partial = self._partial[slab.cls]
        last = partial.pop()
        if last is not slab:
            partial[slab.pos] = last
            last.pos = slab.pos
        slab.pos = -1

    def free(self, offset: int) -> int:
        slab = self._slabs.get(offset & self._mask)
        if slab is None:
            n = self._large.pop(offset, None)
            if n is None:
                raise AllocatorError(f"free of offset {offset} that is not allocated")
            self.buddy.free(offset)
            self._large_used -= n
            return n
        slot, rem = divmod(offset - slab.base, slab.obj_size)
        if rem or slot >= slab.nslots or not slab.live[slot]:
            raise AllocatorError(f"free of offset {offset} that is not allocated")
        slab.live[slot] = 0
        slab.count -= 1
        self._small_used -= slab.obj_size
        self._small_count -= 1
        if slab.count == 0:  # empty: back to the buddy allocator
            if slab.pos >= 0:
                self._unlink(slab)
            del self._slabs[slab.base]
            self.buddy.free(slab.base)
        else:
            slab.free_slots.append(slot)
            if slab.pos < 0:  # was full: partial again
                partial = self._partial[slab.cls]
                slab.pos = len(partial)
                partial.append(slab)
        return slab.obj_size

    def allocate_at(self, offset: int, size: int) -> bool:
        """Never: this allocator alone places slabs and their blocks."""
        return False

    def largest_free(self) -> int:
        return self.buddy.largest_free()

    def stats(self) -> AllocatorStats:
        return AllocatorStats.of(self.total, self._small_used + self._large_used,
                                 self.buddy.largest_free(), self._small_count + len(self._large))

    def check_invariants(self) -> None:
        self.buddy.check_invariants()
        small_used = small_count = 0
        for base, slab in self._slabs.items():
            assert base == slab.base and base % self.slab_size == 0, f"slab {base} misaligned"
            assert self.buddy.allocated_size(base) == self.slab_size, f"slab {base} not in buddy"
            assert slab.obj_size == self.classes[slab.cls]
            assert slab.nslots == self.slab_size // slab.obj_size
            assert 0 < slab.count <= slab.nslots, f"slab {base} empty or overfull"
            assert slab.count == slab.live.count(1), f"slab {base} count mismatch"
            assert not any(slab.live[slab.fresh:]), f"slab {base} live slot beyond fresh"
            free = set(slab.free_slots)
            assert len(free) == len(slab.free_slots), f"slab {base} slot freed twice"
            assert all(s < slab.fresh and not slab.live[s] for s in free), "bad free slot"
            assert len(free) + slab.count == slab.fresh, f"slab {base} lost a slot"
            partial = self._partial[slab.cls]
            if slab.count < slab.nslots:
                assert 0 <= slab.pos < len(partial) and partial[slab.pos] is slab
            else:
                assert slab.pos == -1, f"full slab {base} on the partial list"
            small_used += slab.count * slab.obj_size
            small_count += slab.count
        assert sum(map(len, self._partial)) == sum(
            s.count < s.nslots for s in self._slabs.values()), "stray slab on a partial list"
        for offset, n in self._large.items():
            assert n > self.max_class and self.buddy.allocated_size(offset) == n
        assert small_used == self._small_used and small_count == self._small_count
        assert self._large_used == sum(self._large.values())
        bst = self.buddy.stats()
        assert bst.used == len(self._slabs) * self.slab_size + self._large_used
        assert bst.count == len(self._slabs) + len(self._large)
