"""Backing new host buffers with memory (``control/daemon/accounting/prefault.py``,
``HostArena.prefault``): no byte changes, bounds checked, small
buffers and GPU arenas skipped, the work bounded in time, a cancelled request
waiting for the worker's current chunk, a failing kernel call only logged."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from rpcbuf.control.daemon.accounting import prefault
from rpcbuf.dataplane.arena import HostArena
from rpcbuf.dataplane.copypool import CopyPool
from rpcbuf.dataplane.prefault import Prefault

_sweeps: list[CopyPool] = []


@pytest.fixture(autouse=True)
def sweeps() -> Iterator[CopyPool]:
    """The daemon's fair pool for memory work, which ``populate`` runs on."""
    pool = CopyPool(4, name="test-sweep")
    _sweeps.append(pool)
    yield pool
    _sweeps.remove(pool)
    pool.close()


def populate(arena: Any, offset: int, nbytes: int, **kw: Any) -> Any:
    return prefault.populate(arena, offset, nbytes, _sweeps[-1], "alice", **kw)


def resident_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_populate_backs_pages_and_changes_no_byte() -> None:
    arena = HostArena(96 << 20)
    arena.view(10, 4)[:] = [1, 2, 3, 4]
    before = resident_kib()
    ok = arena.prefault.populate(0, 64 << 20)
    if not ok:
        pytest.skip("this kernel lacks MADV_POPULATE_WRITE (Linux 5.14+)")
    assert resident_kib() - before >= 60 << 10  # about 64 MiB more resident
    assert arena.view(10, 4).tolist() == [1, 2, 3, 4]
    assert arena.prefault.populate(5, 3)  # less than a page: nothing to do, fine
    assert arena.prefault.populate(96 << 20, 0)
    for off, n in ((-1, 10), (0, (96 << 20) + 1), (96 << 20, 1), (0, -1)):
        with pytest.raises(IndexError):
            arena.prefault.populate(off, n)


class SlowPages(Prefault):
    """``populate`` that records its calls and can be held or fail."""

    def __init__(self, hold: threading.Event | None = None, fail: bool = False,
                 delay: float = 0.0) -> None:
        super().__init__(0, 0, None)
        self.calls: list[tuple[int, int]] = []
        self.hold, self.fail, self.delay = hold, fail, delay
        self.inside = threading.Event()

    def populate(self, offset: int, nbytes: int) -> bool:
        self.inside.set()
        if self.hold is not None:
            self.hold.wait(10)
        if self.fail:
            raise OSError(12, "Cannot allocate memory")
        time.sleep(self.delay)
        self.calls.append((offset, nbytes))
        return True


def slow_arena(pages: Prefault | None = None, **kw: Any) -> Any:
    """A host arena whose pre-faulting is ``pages`` (else ``SlowPages(**kw)``):
    reached as the daemon reaches it, ``host_memory(arena).prefault``."""
    arena = HostArena(1 << 20)
    arena.prefault = pages if pages is not None else SlowPages(**kw)
    return arena


async def test_populate_covers_the_range_in_chunks_and_skips_small_ones() -> None:
    arena = slow_arena()
    n = 2 * prefault.CHUNK + 4096
    assert await populate(arena, 1000, n) == n
    assert sorted(arena.prefault.calls) == [(1000, prefault.CHUNK),
                                            (1000 + prefault.CHUNK, prefault.CHUNK),
                                            (1000 + 2 * prefault.CHUNK, 4096)]
    assert await populate(arena, 0, prefault.MIN_BYTES - 1) == 0
    assert await populate(object(), 0, 1 << 30) == 0  # no host memory (a GPU arena): nothing to do
    assert len(arena.prefault.calls) == 3


def test_one_worker_per_cpu_at_most_threads_never_more_than_chunks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefault.os, "sched_getaffinity", lambda pid: {0, 1})
    assert prefault.workers(16 * prefault.CHUNK) == 2
    assert prefault.workers(prefault.CHUNK) == 1
    monkeypatch.setattr(prefault.os, "sched_getaffinity", lambda pid: set(range(64)))
    assert prefault.workers(16 * prefault.CHUNK) == prefault.THREADS


async def test_the_chunks_are_populated_in_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers: two chunks are in the kernel at once (each waits for
    the other to arrive), every chunk exactly once."""
    monkeypatch.setattr(prefault, "workers", lambda nbytes: 2)
    both = threading.Barrier(2, timeout=5)

    first = iter(range(2))

    class Meeting(SlowPages):
        def populate(self, offset: int, nbytes: int) -> bool:
            if next(first, None) is not None:  # the first two calls (GIL-atomic)
                both.wait()  # BrokenBarrierError after 5 s if serial
            return super().populate(offset, nbytes)

    arena = slow_arena(Meeting())
    assert await populate(arena, 0, 6 * prefault.CHUNK) == 6 * prefault.CHUNK
    assert sorted(arena.prefault.calls) == [(i * prefault.CHUNK, prefault.CHUNK) for i in range(6)]


async def test_populate_stops_at_its_budget() -> None:
    arena = slow_arena(delay=0.05)
    done = await populate(arena, 0, 100 * prefault.CHUNK, budget=0.12)
    assert 0 < done < 100 * prefault.CHUNK
    assert len(arena.prefault.calls) <= 4 * prefault.workers(100 * prefault.CHUNK)


async def test_a_failing_kernel_call_is_logged_not_raised(caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    assert await populate(slow_arena(fail=True), 0, 4 * prefault.CHUNK) == 0
    assert "pre-faulting a new buffer failed" in caplog.text


async def test_a_kernel_without_populate_stops_every_worker(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefault, "workers", lambda nbytes: 2)

    class Unsupported(SlowPages):
        def populate(self, offset: int, nbytes: int) -> bool:
            self.calls.append((offset, nbytes))
            return False

    arena = slow_arena(Unsupported())
    assert await populate(arena, 0, 50 * prefault.CHUNK) == 0
    assert len(arena.prefault.calls) <= 2  # one attempt per worker, then all stop


async def test_a_cancelled_populate_waits_for_its_chunks_then_stops(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefault, "workers", lambda nbytes: 2)
    hold = threading.Event()
    arena = slow_arena(hold=hold)
    task = asyncio.ensure_future(populate(arena, 0, 10 * prefault.CHUNK))
    await asyncio.to_thread(arena.prefault.inside.wait, 5)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # still waiting for the chunks in the workers
    hold.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert len(arena.prefault.calls) <= 2  # each worker's current chunk, nothing after the cancel


def test_wanted_only_for_big_host_buffers() -> None:
    arena = HostArena(1 << 20)
    assert prefault.wanted(arena, prefault.MIN_BYTES)
    assert not prefault.wanted(arena, prefault.MIN_BYTES - 1)
    assert not prefault.wanted(np.zeros(1), 1 << 30)
    arena.prefault.always = True  # --prefault: every new buffer
    assert prefault.wanted(arena, 1)
