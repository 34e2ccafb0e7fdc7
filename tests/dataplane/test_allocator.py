"""Allocators: one hypothesis state machine per allocator, checked after every step.

The machine is the same for all three (no overlap, 256-byte alignment, stats
that add up, double frees raise, freeing everything gives one free block);
each subclass builds its allocator and says when a failed allocation is
justified.  Unit tests below pin down what is specific to each one.
"""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from rpcbuf.dataplane.allocator import (
    Allocator,
    AllocatorError,
    AllocatorStats,
    BuddyAllocator,
    LinearAllocator,
)
from rpcbuf.dataplane.allocators import ALLOCATORS, make_allocator
from rpcbuf.dataplane.slab import SlabAllocator


def take(a: Allocator, size: int) -> int:
    off = a.allocate(size)
    assert off is not None, f"allocate({size}) failed"
    return off


MACHINE_SETTINGS = settings(max_examples=100, stateful_step_count=80, deadline=None)
# Small sizes hit the slab classes, large ones the buddy blocks.
SIZES = st.one_of(st.integers(1, 8 << 10), st.integers(1, 1 << 20))


class AllocatorMachine(RuleBasedStateMachine):
    alloc: Allocator

    def make(self, size: int, data: st.DataObject) -> Allocator:
        raise NotImplementedError

    def failure_is_justified(self, size: int, before: AllocatorStats) -> bool:
        return self.alloc.block_size(size) > before.largest_free

    @initialize(size=st.integers(256, 1 << 22), data=st.data())
    def setup(self, size: int, data: st.DataObject) -> None:
        self.alloc = self.make(size, data)
        self.live: dict[int, int] = {}  # offset -> requested size

    @rule(size=SIZES)
    def allocate(self, size: int) -> None:
        before = self.alloc.stats()
        off = self.alloc.allocate(size)
        if off is None:
            assert self.failure_is_justified(size, before)
            assert self.alloc.stats() == before, "a failed allocate changed the stats"
            return
        n = self.alloc.block_size(size)
        assert n >= size and n % 256 == 0
        assert off % 256 == 0
        assert off + n <= self.alloc.total
        for o, s in self.live.items():
            assert off + n <= o or o + self.alloc.block_size(s) <= off, "overlap"
        self.live[off] = size
        assert self.alloc.stats().used == before.used + n

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.live)))
        size = self.live.pop(off)
        assert self.alloc.free(off) == self.alloc.block_size(size)
        with pytest.raises(AllocatorError):
            self.alloc.free(off)  # double free

    @rule(off=st.integers(0, 1 << 22))
    def bad_free(self, off: int) -> None:
        if off not in self.live:
            before = self.alloc.stats()
            with pytest.raises(AllocatorError):
                self.alloc.free(off)
            assert self.alloc.stats() == before

    @rule(size=st.integers(-3, 0))
    def bad_size(self, size: int) -> None:
        with pytest.raises(AllocatorError):
            self.alloc.allocate(size)

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_invariants()
        st_ = self.alloc.stats()
        assert st_.total == self.alloc.total
        assert st_.count == len(self.live)
        assert st_.used == sum(self.alloc.block_size(s) for s in self.live.values())
        assert st_.used + st_.free == st_.total
        assert 0 <= st_.largest_free <= min(st_.free, self.alloc.max_size)
        assert st_.largest_free == self.alloc.largest_free()

    def teardown(self) -> None:
        for off in list(self.live):
            self.alloc.free(off)
        st_ = self.alloc.stats()
        assert st_.used == 0 and st_.free == self.alloc.total and st_.count == 0
        self.alloc.check_invariants()
        if self.alloc.total & (self.alloc.total - 1) == 0:
            assert st_.largest_free == self.alloc.total  # one block again


class BuddyMachine(AllocatorMachine):
    def make(self, size: int, data: st.DataObject) -> Allocator:
        return BuddyAllocator(size)

    @precondition(lambda self: hasattr(self, "alloc"))
    @rule(size=st.integers(1, 1 << 16), at=st.integers(0, 1 << 22))
    def allocate_at(self, size: int, at: int) -> None:
        """Taking a given block: exactly it when it is free (not
        overlapping anything live), else False with nothing changed."""
        a: BuddyAllocator = self.alloc  # type: ignore[assignment]
        n = a.block_size(size)
        at = at // n * n  # a block's own alignment
        before = a.stats()
        free = at + n <= a.total and all(
            at + n <= o or o + a.block_size(s) <= at for o, s in self.live.items())
        got = a.allocate_at(at, size)
        if n > a.max_size or at + n > a.total:
            assert not got
        else:
            assert got == free, (at, n, sorted(self.live.items()))
        if got:
            self.live[at] = size
            assert a.stats().used == before.used + n
        else:
            assert a.stats() == before


class LinearMachine(AllocatorMachine):
    def make(self, size: int, data: st.DataObject) -> Allocator:
        return LinearAllocator(size)

    def teardown(self) -> None:
        super().teardown()
        assert self.alloc.largest_free() == self.alloc.total  # back to 0 whatever the size


class SlabMachine(AllocatorMachine):
    def make(self, size: int, data: st.DataObject) -> Allocator:
        # Small slabs, so that small arenas hold several and slabs fill up and empty.
        slab = data.draw(st.sampled_from([4 << 10, 16 << 10, 64 << 10, 1 << 20]), label="slab")
        return SlabAllocator(size, slab_size=slab)

    def failure_is_justified(self, size: int, before: AllocatorStats) -> bool:
        a = self.alloc
        assert isinstance(a, SlabAllocator)
        if size > a.max_class:
            return a.block_size(size) > before.largest_free
        # A class with room never fails; a new slab needs a free slab-sized block.
        return not a._partial[a._class_of[(size - 1) // 256]] and before.largest_free < a.slab_size


TestBuddy = BuddyMachine.TestCase
TestBuddy.settings = MACHINE_SETTINGS
TestLinear = LinearMachine.TestCase
TestLinear.settings = MACHINE_SETTINGS
TestSlab = SlabMachine.TestCase
TestSlab.settings = MACHINE_SETTINGS


# -- the common interface --------------------------------------------------------


def test_registry_of_allocators() -> None:
    assert set(ALLOCATORS) == {"buddy", "linear", "slab"}
    for name, cls in ALLOCATORS.items():
        a = make_allocator(name, 1 << 20)
        assert type(a) is cls and a.name == name and a.total == 1 << 20
        assert isinstance(a, Allocator)
    with pytest.raises(ValueError, match="unknown allocator"):
        make_allocator("best-effort", 1 << 20)


@pytest.mark.parametrize("name", sorted(ALLOCATORS))
def test_bad_input(name: str) -> None:
    a = make_allocator(name, 1 << 20)
    assert a.allocate((1 << 20) + 1) is None
    for bad in (0, -1):
        with pytest.raises(AllocatorError):
            a.allocate(bad)
        with pytest.raises(AllocatorError):
            a.block_size(bad)
    with pytest.raises(AllocatorError):
        a.free(12345)
    off = take(a, 1000)
    with pytest.raises(AllocatorError):
        a.free(off + 256)  # inside a block, not its start
    assert a.free(off) == a.block_size(1000)
    with pytest.raises(AllocatorError):
        a.free(off)
    with pytest.raises(ValueError):
        ALLOCATORS[name](100)  # smaller than one block
    with pytest.raises(ValueError):
        ALLOCATORS[name](1 << 20, min_block=300)  # type: ignore[call-arg]


@pytest.mark.parametrize("name", ["linear", "slab"])
def test_allocators_that_do_not_place_blocks_say_so_and_change_nothing(name: str) -> None:
    """``allocate_at`` is every allocator's (the registry asks it for a
    kept block, no probing); only buddy places blocks, the others say False."""
    a = make_allocator(name, 1 << 20)
    before = a.stats()
    for at, size in ((0, 4096), (1 << 16, 1 << 16), (0, 256)):
        assert a.allocate_at(at, size) is False
    assert a.stats() == before
    a.check_invariants()


@pytest.mark.parametrize("name", sorted(ALLOCATORS))
def test_many_operations_are_fast_enough(name: str) -> None:
    """200k mixed operations; bench_alloc.py times the full million."""
    a, rng = make_allocator(name, 1 << 30), random.Random(1)
    live: list[int] = []
    sizes = [256, 1000, 4096, 20_000, 65536, 300_000, 1 << 20]
    start = time.perf_counter()
    for _ in range(200_000):
        if live and rng.random() < 0.5:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            off = a.allocate(rng.choice(sizes))
            if off is not None:
                live.append(off)
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"{name}: 200k ops took {elapsed:.1f} s"  # ~0.2 s measured
    for off in live:
        a.free(off)
    assert a.stats().largest_free == 1 << 30
    a.check_invariants()


@pytest.mark.parametrize("name", sorted(ALLOCATORS))
@pytest.mark.parametrize("size", [1 << 20, (1 << 20) + (1 << 18) + 768])
def test_max_size_is_the_largest_request_that_can_ever_fit(name: str, size: int) -> None:
    a = make_allocator(name, size)
    assert a.allocate(a.max_size + 1) is None  # not even in the empty arena
    off = take(a, a.max_size)
    assert a.block_size(a.max_size) == a.max_size and a.largest_free() <= a.total - a.max_size
    a.free(off)
    assert a.largest_free() == a.max_size


# -- buddy -----------------------------------------------------------------------


def test_buddy_non_power_of_two_arena_is_fully_usable() -> None:
    a = BuddyAllocator(3 * 1024 + 512)  # 2048 + 1024 + 512
    got = [take(a, 512) for _ in range(7)]
    assert a.allocate(256) is None
    assert a.stats().free == 0
    for off in got:
        a.free(off)
    assert a.stats().largest_free == 2048
    a.check_invariants()


def test_buddy_rounding() -> None:
    a = BuddyAllocator(1 << 20)
    assert a.block_size(1) == 256 and a.block_size(257) == 512 and a.block_size(1 << 20) == 1 << 20


# -- linear ----------------------------------------------------------------------


def test_linear_moves_back_over_freed_blocks_and_resets() -> None:
    a = LinearAllocator(4096)
    offs = [a.allocate(256) for _ in range(4)]
    assert offs == [0, 256, 512, 768] and a.block_size(257) == 512
    a.free(256)  # an interior hole: not reusable yet
    assert a.largest_free() == 4096 - 1024
    assert a.stats().fragmentation > 0
    a.free(768)  # the top: back to the end of the block at 512 ...
    assert a.largest_free() == 4096 - 768
    a.free(512)  # ... and over the hole at 256, down to 256
    assert a.largest_free() == 4096 - 256
    assert a.allocate(300) == 256
    a.check_invariants()
    a.free(256)
    a.free(0)  # everything free: back to 0
    assert a.stats() == AllocatorStats(4096, 0, 4096, 4096, 0)
    a.check_invariants()


def test_linear_fills_without_rounding_to_powers_of_two() -> None:
    a = LinearAllocator(3 * 1024)
    assert [a.allocate(768) for _ in range(4)] == [0, 768, 1536, 2304]
    assert a.allocate(1) is None and a.stats().free == 0


# -- slab ------------------------------------------------------------------------


def test_slab_classes_and_routing() -> None:
    a = SlabAllocator(16 << 20)
    assert a.classes[:8] == [256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert a.classes[-1] == 64 << 10 and all(c % 256 == 0 for c in a.classes)
    assert a.block_size(1025) == 1280 and a.block_size(64 << 10) == 64 << 10
    assert a.block_size((64 << 10) + 1) == 128 << 10  # above the classes: buddy
    small = [take(a, 700) for _ in range(10)]
    assert small == [small[0] + 768 * i for i in range(10)]  # one slab, packed
    assert a.buddy.stats().used == 1 << 20  # one slab taken from buddy
    big = take(a, 100_000)
    assert big % (128 << 10) == 0
    assert a.stats().used == 10 * 768 + (128 << 10)
    with pytest.raises(AllocatorError):
        a.free(small[0] + 256)  # inside an object
    with pytest.raises(AllocatorError):
        a.free(small[0] + 768 * 20)  # a slot never handed out
    for off in small:
        a.free(off)
    assert not a._slabs and a.buddy.stats().used == 128 << 10  # the empty slab went back
    a.free(big)
    assert a.largest_free() == 16 << 20
    a.check_invariants()


def test_slab_full_slab_reopens_and_tiny_arena_has_no_classes() -> None:
    a = SlabAllocator(1 << 20, slab_size=4096)  # classes: 256 only, 16 per slab
    offs = [take(a, 200) for _ in range(17)]
    assert len(a._slabs) == 2
    a.free(offs[3])  # the first slab was full: partial again, slot reused
    assert a.allocate(1) == offs[3]
    a.check_invariants()
    tiny = SlabAllocator(2048)  # no slab fits 16 objects: everything is a buddy block
    assert tiny.classes == [] and tiny.block_size(1) == 256 and tiny.allocate(300) == 0
