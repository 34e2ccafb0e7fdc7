"""Kept blocks: a freed, never-exported block's memfd stays mapped for the
next buffer of the same block, and is all zero before anyone gets it."""

from __future__ import annotations

import mmap
import os
import threading
from typing import Any

import pytest
from test_arena import _maps_of

from rpcbuf.dataplane import arena as A, kept as K, zeroer as Z
from rpcbuf.dataplane.arena import HostArena, Zeroing

PAGE = mmap.PAGESIZE


def _memfd_maps(arena: HostArena) -> list[str]:
    return [m for m in _maps_of(arena) if "memfd:rpcbuf-buffer" in m]


def _inode(arena: HostArena, offset: int) -> str:
    addr = arena.address + offset
    for line in _memfd_maps(arena):
        a, b = (int(x, 16) for x in line.split()[0].split("-"))
        if a <= addr < b:
            return line.split()[4]
    raise AssertionError(f"nothing mapped at {offset}")


class HeldZeroer:
    """The background zeroer, held: what it was given waits for ``run``."""

    def __init__(self) -> None:
        self.items: list[tuple[int, Zeroing, object]] = []

    def put(self, addr: int, kept: Zeroing, owner: object = None) -> None:
        self.items.append((addr, kept, owner))

    def run(self) -> None:
        real = Z.Zeroer()
        for item in self.items:
            real.put(*item)


def _held_arena(monkeypatch: pytest.MonkeyPatch, chunk: int | None = None
                ) -> tuple[HostArena, HeldZeroer]:
    """A 64-page arena that keeps everything, with small on-demand zeroing
    (``chunk``: the zeroer's chunk too) and its zeroer held."""
    monkeypatch.setattr(K, "ZERO_NOW", PAGE)
    if chunk is not None:
        monkeypatch.setattr(Z, "ZERO_CHUNK", chunk)
    arena = HostArena(64 * PAGE)
    arena.kept.limit = 64 * PAGE
    held = HeldZeroer()
    arena.kept._zeroer = held  # type: ignore[assignment]
    return arena, held


def _taken_again(arena: HostArena, fill: int | None = None) -> Zeroing:
    """A 16-page block backed (written with ``fill``), released (kept) and
    taken over again before the held zeroer ran: its ``Zeroing``."""
    arena.back(0, 16 * PAGE)
    if fill is not None:
        arena.view(0, 16 * PAGE)[:] = fill
    arena.unback(0, 16 * PAGE)
    z = arena.back(0, 16 * PAGE)
    assert isinstance(z, Zeroing)
    return z


def _wait_clean(z: Zeroing, timeout: float = 10.0) -> None:
    done = threading.Event()
    z.then(done.set)
    assert done.wait(timeout), "the zeroer never finished"


def test_a_freed_block_is_kept_zeroed_and_taken_over_by_the_same_block() -> None:
    arena = HostArena(64 * PAGE)
    arena.kept.limit = 16 * PAGE
    assert arena.back(8 * PAGE, 8 * PAGE) is None
    inode = _inode(arena, 8 * PAGE)
    arena.view(8 * PAGE, 8 * PAGE)[:] = 0xAB  # one tenant's bytes
    arena.unback(8 * PAGE, 8 * PAGE)
    assert arena.backed == 0 and arena.kept.nbytes == 8 * PAGE
    assert len(_memfd_maps(arena)) == 1  # still mapped: that is the point
    assert not arena.view(8 * PAGE, 8 * PAGE).any()  # zeroed already (small: at once)
    assert arena.back(8 * PAGE, 8 * PAGE) is None  # all zero: no wait
    assert arena.kept.reused == 1 and arena.kept.nbytes == 0 and arena.backed == 1
    assert _inode(arena, 8 * PAGE) == inode  # the same memfd, no new one
    assert not arena.view(8 * PAGE, 8 * PAGE).any()  # the next tenant sees zeros
    arena.unback(8 * PAGE, 8 * PAGE)


def test_an_exported_block_is_never_kept_and_its_old_handle_sees_nothing_new() -> None:
    arena = HostArena(64 * PAGE)
    arena.kept.limit = 64 * PAGE
    arena.back(0, 4 * PAGE)
    arena.view(0, 4 * PAGE)[:] = 1
    fd = arena.export(0, 4 * PAGE)  # a reader keeps its fd (and maps it later)
    try:
        arena.unback(0, 4 * PAGE)
        assert arena.kept.nbytes == 0 and not _memfd_maps(arena)
        arena.back(0, 4 * PAGE)
        assert arena.kept.reused == 0
        arena.view(0, 4 * PAGE)[:] = 2  # the next tenant's bytes
        old = mmap.mmap(fd, 4 * PAGE, mmap.MAP_SHARED, mmap.PROT_READ)
        assert set(old[:]) == {1}  # the old handle reaches only the old bytes
        old.close()
        arena.unback(0, 4 * PAGE)
    finally:
        os.close(fd)


def test_any_other_block_overlapping_a_kept_one_drops_it() -> None:
    arena = HostArena(64 * PAGE)
    arena.kept.limit = 64 * PAGE
    for off in (0, 8 * PAGE, 16 * PAGE):
        arena.back(off, 8 * PAGE)
        arena.view(off, 8 * PAGE)[:] = 5
    for off in (0, 8 * PAGE, 16 * PAGE):
        arena.unback(off, 8 * PAGE)
    assert arena.kept.nbytes == 24 * PAGE
    arena.back(4 * PAGE, 8 * PAGE)  # straddles the first two: both go, the third stays
    assert arena.kept.reused == 0 and arena.kept.nbytes == 8 * PAGE
    assert not arena.view(0, 24 * PAGE).any()
    arena.back(0, 4 * PAGE)  # the dropped range is plain free memory now
    arena.back(16 * PAGE, 8 * PAGE)  # the third: taken over
    assert arena.kept.reused == 1 and arena.kept.nbytes == 0
    assert len(_memfd_maps(arena)) == 3


def test_keep_is_a_bound_and_the_least_recently_kept_go_first() -> None:
    arena = HostArena(64 * PAGE)
    arena.kept.limit = 8 * PAGE
    for off in (0, 8 * PAGE):
        arena.back(off, 8 * PAGE)
    arena.back(16 * PAGE, 16 * PAGE)
    arena.unback(0, 8 * PAGE)
    arena.unback(8 * PAGE, 8 * PAGE)  # the first one makes room for it
    arena.unback(16 * PAGE, 16 * PAGE)  # larger than keep: not kept at all
    assert arena.kept.nbytes == 8 * PAGE and len(_memfd_maps(arena)) == 1
    arena.back(0, 8 * PAGE)
    assert arena.kept.reused == 0  # it was dropped
    arena.back(8 * PAGE, 8 * PAGE)
    assert arena.kept.reused == 1
    arena.kept.limit = 0
    arena.unback(0, 8 * PAGE)
    arena.unback(8 * PAGE, 8 * PAGE)
    assert not _memfd_maps(arena) and arena.kept.nbytes == 0


def test_a_large_block_is_zeroed_in_the_background_before_it_is_usable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    arena, held = _held_arena(monkeypatch, chunk=2 * PAGE)
    z = _taken_again(arena, fill=0xCD)  # taken over before it was zeroed
    assert not z.clean and arena.kept.reused == 1
    assert arena.view(0, 16 * PAGE).all()  # still the old bytes: the caller must wait
    held.run()
    _wait_clean(z)
    assert not arena.view(0, 16 * PAGE).any()
    z.then(lambda: None)  # once clean, a late ``then`` runs at once
    arena.unback(0, 16 * PAGE)


def test_a_block_freed_again_before_it_was_zeroed_is_never_written_by_the_old_job(
        monkeypatch: pytest.MonkeyPatch) -> None:
    arena, held = _held_arena(monkeypatch)
    z = _taken_again(arena)
    called: list[Any] = []
    z.then(lambda: called.append(1))
    arena.unback(0, 16 * PAGE)  # freed again: its zeroing stops, it is kept dirty again
    arena.back(0, 8 * PAGE)  # another block over it: the kept one is dropped
    arena.view(0, 8 * PAGE)[:] = 7  # a new buffer's bytes
    held.run()  # both stale jobs run now: neither may write a byte
    for _, kept, _ in held.items:
        with kept.lock:
            assert kept.stopped
    import time
    time.sleep(0.2)
    assert (arena.view(0, 8 * PAGE) == 7).all()
    assert called == [1]  # its waiter was let go when it was freed, not left waiting
    arena.unback(0, 8 * PAGE)


def test_a_waiter_on_a_block_freed_before_it_was_zeroed_is_let_go(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The buffer on a kept block is locked until ``then``: a block freed
    while it was still being zeroed must call it too (at once), or whatever
    waits for that buffer waits forever."""
    arena, _ = _held_arena(monkeypatch)
    z = _taken_again(arena)
    called: list[int] = []
    z.then(lambda: called.append(1))
    assert not called
    arena.unback(0, 16 * PAGE)  # released while still being zeroed
    assert called == [1]
    z.then(lambda: called.append(2))  # a late waiter: at once too
    assert called == [1, 2]


def test_the_block_a_request_takes_is_zeroed_on_demand_not_after_those_kept_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept blocks are zeroed in the order they were kept, and the one a
    request takes is the most recently kept: the last in that order.  Its
    requester zeroes it itself (``zero_now``), so it is all zero while every
    block kept before it still waits for the (here held) zeroer."""
    arena, held = _held_arena(monkeypatch, chunk=2 * PAGE)
    for i in range(4):
        arena.back(i * 8 * PAGE, 8 * PAGE)
        arena.view(i * 8 * PAGE, 8 * PAGE)[:] = 0xCD  # a tenant's bytes
    for i in range(4):
        arena.unback(i * 8 * PAGE, 8 * PAGE)
    last = arena.kept.newest(8 * PAGE)
    assert last == 3 * 8 * PAGE and len(held.items) == 4  # queued last
    z = arena.back(last, 8 * PAGE)
    assert isinstance(z, Zeroing)
    called: list[int] = []
    z.then(lambda: called.append(1))
    arena.kept.zero_now(last)
    assert z.clean and called == [1] and not arena.view(last, 8 * PAGE).any()
    assert arena.view(0, 3 * 8 * PAGE).all()  # the others: not yet, and not needed
    held.run()  # the zeroer reaches them, and finds the taken one done already
    for i in range(3):
        _wait_clean(held.items[i][1])
    assert not arena.view(0, 4 * 8 * PAGE).any() and called == [1]
    arena.kept.zero_now(last)  # nothing left to do: no-op
    arena.kept.zero_now(0)  # not a taken block: no-op
    arena.unback(last, 8 * PAGE)


def test_zero_now_beside_the_zeroer_writes_each_chunk_once_and_finishes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(K, "ZERO_NOW", PAGE)
    monkeypatch.setattr(Z, "ZERO_CHUNK", PAGE)
    arena = HostArena(256 * PAGE)
    arena.kept.limit = 256 * PAGE
    arena.back(0, 128 * PAGE)
    arena.view(0, 128 * PAGE)[:] = 0x5A
    arena.unback(0, 128 * PAGE)  # the real zeroer starts on it
    z = arena.back(0, 128 * PAGE)
    if z is not None:  # the zeroer may have been quicker
        workers = [threading.Thread(target=arena.kept.zero_now, args=(0,)) for _ in range(3)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(10)
        assert z.clean and z.at == 128 * PAGE
    assert not arena.view(0, 128 * PAGE).any()
    arena.unback(0, 128 * PAGE)


def test_many_kept_blocks_come_and_go_without_leaking_fds() -> None:
    arena = HostArena(256 * PAGE)
    arena.kept.limit = 128 * PAGE
    before = len(os.listdir("/proc/self/fd"))
    for r in range(10):
        size = (r // 2 % 3 + 1) * PAGE * 4  # two rounds a size: reuse, then overlaps
        n = 256 * PAGE // size
        for i in range(n):
            arena.back(i * size, size)
            arena.view(i * size, size)[:] = r + 1
        for i in range(n):
            arena.unback(i * size, size)
        assert arena.kept.nbytes <= arena.kept.limit
    assert arena.kept.reused > 0
    assert not arena.view(0, arena.size).any()
    arena.kept.limit = 0
    arena.kept.drop_all()
    assert len(os.listdir("/proc/self/fd")) == before


def test_an_arena_dropped_while_its_zeroer_runs_is_not_written_after_unmapping() -> None:
    """The zeroer holds the arena (its mapping) until each block is done: an
    arena dropped while a large kept block is still being zeroed (the
    daemon's arenas go when ``serve`` returns, right after the last
    session's buffers were released) must not have the zeroer write into
    unmapped memory (it crashed the process: SIGSEGV)."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent("""
        import gc, time
        from rpcbuf.dataplane.arena import HostArena
        MIB = 1 << 20
        a = HostArena(512 * MIB)
        a.kept.limit = 512 * MIB
        a.back(0, 256 * MIB)
        a.view(0, 256 * MIB)[:] = 7
        a.unback(0, 256 * MIB)  # kept, zeroed in the background from now on
        del a
        gc.collect()
        time.sleep(1.0)  # the zeroer goes on meanwhile
        print("survived")
        import rpcbuf.dataplane.arena as m
        print("arena from", m.__file__)
    """)
    src = os.path.dirname(os.path.dirname(os.path.abspath(A.__file__)))  # .../src/rpcbuf
    env = {**os.environ, "PYTHONPATH": os.path.dirname(src)}  # the tree under test
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "survived" in done.stdout, (done.returncode, done.stderr)
    assert f"arena from {src}" in done.stdout, done.stdout  # not another checkout's
