"""The host arena: one reserved range, one sealed memfd per buffer."""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable

import numpy as np
import pytest

from rpcbuf.dataplane import shm
from rpcbuf.dataplane.arena import HostArena

PAGE = mmap.PAGESIZE


def _maps_of(arena: HostArena) -> list[str]:
    lo, hi = arena.address, arena.address + arena.size
    out = []
    for line in open("/proc/self/maps").read().splitlines():
        a, b = (int(x, 16) for x in line.split()[0].split("-"))
        if a < hi and b > lo:
            out.append(line)
    return out


def test_back_maps_one_memfd_per_block_and_unback_drops_it() -> None:
    arena = HostArena(64 * PAGE)
    arena.back(4 * PAGE, 8 * PAGE)
    view = arena.view(4 * PAGE, 8 * PAGE)
    view[:] = 7  # the daemon writes through its own mapping, made before the seal
    assert sum("memfd:rpcbuf-buffer" in m for m in _maps_of(arena)) == 1
    fd = arena.export(4 * PAGE, 8 * PAGE)
    try:
        assert os.fstat(fd).st_size == 8 * PAGE
        assert shm.seals(fd) & shm.READ_ONLY_SEALS == shm.READ_ONLY_SEALS
        ro = mmap.mmap(fd, 8 * PAGE, mmap.MAP_SHARED, mmap.PROT_READ)
        assert ro[:3] == b"\x07\x07\x07"
        view[0] = 9  # a reader sees the daemon's later writes at once: same pages
        assert ro[0] == 9
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 8 * PAGE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        ro.close()
    finally:
        os.close(fd)
    arena.unback(4 * PAGE, 8 * PAGE)
    assert not any("memfd" in m for m in _maps_of(arena))
    assert not arena.view(4 * PAGE, 8 * PAGE).any()  # fresh memory there: never the old bytes
    assert arena.backed == 0


def test_exactly_one_block_is_exported() -> None:
    arena = HostArena(16 * PAGE)
    arena.back(0, 2 * PAGE)
    arena.back(2 * PAGE, 2 * PAGE)
    for off, n in ((0, PAGE), (0, 4 * PAGE), (PAGE, PAGE), (4 * PAGE, PAGE)):
        with pytest.raises(ValueError):
            arena.export(off, n)
    fd = arena.export(2 * PAGE, 2 * PAGE)
    os.close(fd)
    arena.unback(0, 2 * PAGE)
    arena.unback(2 * PAGE, 2 * PAGE)


def test_bad_backs_are_refused() -> None:
    arena = HostArena(16 * PAGE)
    for off, n in ((1, PAGE), (0, PAGE + 1), (0, 0), (15 * PAGE, 2 * PAGE)):
        with pytest.raises(ValueError):
            arena.back(off, n)
    arena.back(0, PAGE)
    with pytest.raises(RuntimeError):  # twice: a bug in the caller, said so
        arena.back(0, PAGE)
    with pytest.raises(RuntimeError):
        arena.unback(0, 2 * PAGE)
    with pytest.raises(KeyError):
        arena.unback(PAGE, PAGE)
    arena.unback(0, PAGE)


def test_many_buffers_come_and_go_without_leaking_fds() -> None:
    arena = HostArena(256 * PAGE)
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        for i in range(64):
            arena.back(i * 4 * PAGE, 4 * PAGE)
        for i in range(64):
            arena.unback(i * 4 * PAGE, 4 * PAGE)
    assert len(os.listdir("/proc/self/fd")) == before
    assert np.frombuffer(arena.view(0, arena.size), np.uint8).sum() == 0


def _mapped(addr: int) -> bool:
    for line in open("/proc/self/maps").read().splitlines():
        a, b = (int(x, 16) for x in line.split()[0].split("-"))
        if a <= addr < b:
            return True
    return False


def test_each_component_keeps_the_arena_mapped_while_it_lives() -> None:
    """A component's method handed to a worker on its own
    (``sweeps.run(host.prefault.populate, ...)``, ``host.kept.zero_now``,
    ``host.clones.copy_out``) may outlive the arena: each component alone
    holds the arena's mapping, so none ever touches unmapped memory
    (``madvise`` said ENOMEM when ``Prefault`` held only the address), and
    the last one gone unmaps it (no garbage collector needed)."""
    import gc

    from rpcbuf.dataplane.clones import Clones
    from rpcbuf.dataplane.kept import KeptBlocks
    from rpcbuf.dataplane.prefault import Prefault

    parts: list[Callable[[HostArena], Prefault | KeptBlocks | Clones]] = [
        lambda a: a.prefault, lambda a: a.kept, lambda a: a.clones]
    for take in parts:
        arena = HostArena(64 * PAGE)
        addr, part = arena.address, take(arena)
        del arena
        gc.collect()
        assert _mapped(addr), part
        if isinstance(part, Prefault):
            assert part.populate(0, 64 * PAGE) in (True, False)  # False: a kernel before 5.14
        elif isinstance(part, KeptBlocks):
            part.zero_now(0)  # nothing taken over: nothing to do
        del part
        assert not _mapped(addr)
