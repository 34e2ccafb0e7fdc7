"""Byte-range locks: the synchronous decisions, step by step."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from rpcbuf.control.daemon.accounting.locks import RangeLocks


def test_shared_and_exclusive() -> None:
    locks = RangeLocks()
    r1 = locks.acquire([(0, 100)], exclusive=False)
    r2 = locks.acquire([(50, 150)], exclusive=False)
    assert r1.granted and r2.granted  # readers share
    woke: list[str] = []
    w = locks.acquire([(90, 95)], exclusive=True, ready=lambda: woke.append("w"))
    assert not w.granted
    other = locks.acquire([(200, 300)], exclusive=True)
    assert other.granted  # disjoint ranges run in parallel
    r3 = locks.acquire([(0, 10)], exclusive=False, ready=lambda: woke.append("r3"))
    assert r3.granted  # does not overlap the waiting writer
    r4 = locks.acquire([(94, 96)], exclusive=False, ready=lambda: woke.append("r4"))
    assert not r4.granted  # queued behind the writer: no starvation
    locks.release(r1)
    assert woke == []
    locks.release(r2)
    assert woke == ["w"] and w.granted and not r4.granted
    locks.release(w)
    assert woke == ["w", "r4"]
    for g in (other, r3, r4):
        locks.release(g)
    assert locks.idle


def test_withdrawn_waiter_unblocks_the_queue() -> None:
    locks = RangeLocks()
    held = locks.acquire([(0, 10)], exclusive=True)
    waiting = locks.acquire([(0, 10)], exclusive=True)
    behind = locks.acquire([(5, 20)], exclusive=False)
    assert not waiting.granted and not behind.granted
    locks.release(waiting)  # cancelled before it was granted
    locks.release(held)
    assert behind.granted
    locks.release(behind)
    locks.release(behind)  # releasing twice is harmless
    assert locks.idle


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 50), st.integers(1, 20), st.booleans(),
                          st.integers(0, 3)), min_size=1, max_size=30))
def test_no_conflicting_grants_ever(ops: list[tuple[int, int, bool, int]]) -> None:
    locks = RangeLocks()
    live = []
    for start, length, exclusive, release_k in ops:
        live.append(locks.acquire([(start, start + length)], exclusive))
        for _ in range(release_k):
            if live:
                locks.release(live.pop(0))
        held = locks.held
        for i, a in enumerate(held):
            for b in held[i + 1:]:
                assert not a.conflicts(b)
    while live:
        locks.release(live.pop())
    assert locks.idle
