"""Buddy allocator: hypothesis state machine checked after every step."""

from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dataplane.allocator import AllocatorError, BuddyAllocator, make_allocator


class BuddyMachine(RuleBasedStateMachine):
    @initialize(size=st.integers(256, 1 << 22))
    def setup(self, size: int) -> None:
        self.alloc = BuddyAllocator(size)
        self.live: dict[int, int] = {}  # offset -> requested size

    @rule(size=st.integers(1, 1 << 20))
    def allocate(self, size: int) -> None:
        before = self.alloc.stats()
        off = self.alloc.allocate(size)
        if off is None:
            assert before.largest_free < size or self.alloc.block_size(size) > before.largest_free
            return
        assert off % 256 == 0
        assert off + size <= self.alloc.total
        for o, s in self.live.items():
            assert off + size <= o or o + s <= off, "overlap"
        self.live[off] = size

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        off = data.draw(st.sampled_from(sorted(self.live)))
        del self.live[off]
        self.alloc.free(off)
        with pytest.raises(AllocatorError):
            self.alloc.free(off)  # double free

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_invariants()
        st_ = self.alloc.stats()
        assert st_.count == len(self.live)
        assert st_.used == sum(self.alloc.block_size(s) for s in self.live.values())
        assert st_.used + st_.free == st_.total

    def teardown(self) -> None:
        for off in list(self.live):
            self.alloc.free(off)
        st_ = self.alloc.stats()
        assert st_.used == 0 and st_.free == self.alloc.total
        self.alloc.check_invariants()
        if self.alloc.total & (self.alloc.total - 1) == 0:
            assert st_.largest_free == self.alloc.total  # one block again


TestBuddy = BuddyMachine.TestCase
TestBuddy.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)


def test_non_power_of_two_arena_is_fully_usable() -> None:
    a = BuddyAllocator(3 * 1024 + 512)  # 2048 + 1024 + 512
    got = [a.allocate(512) for _ in range(7)]
    assert None not in got and a.allocate(256) is None
    assert a.stats().free == 0
    for off in got:
        a.free(off)  # type: ignore[arg-type]
    assert a.stats().largest_free == 2048
    a.check_invariants()


def test_rounding_and_bad_input() -> None:
    a = BuddyAllocator(1 << 20)
    assert a.block_size(1) == 256 and a.block_size(257) == 512 and a.block_size(1 << 20) == 1 << 20
    assert a.allocate((1 << 20) + 1) is None
    with pytest.raises(AllocatorError):
        a.allocate(0)
    with pytest.raises(AllocatorError):
        a.free(12345)
    with pytest.raises(ValueError):
        BuddyAllocator(100)
    with pytest.raises(ValueError, match="unknown allocator"):
        make_allocator("best-effort", 1 << 20)


def test_many_operations_are_fast_enough() -> None:
    a, live, rng = BuddyAllocator(1 << 30), [], random.Random(1)
    for _ in range(100_000):  # O(log n): well under a second
        if live and rng.random() < 0.5:
            a.free(live.pop(rng.randrange(len(live))))
        else:
            off = a.allocate(rng.choice([256, 4096, 65536, 1 << 20]))
            if off is not None:
                live.append(off)
    for off in live:
        a.free(off)
    assert a.stats().largest_free == 1 << 30
