"""Same-host sessions cost what they hold, and give it all back when they end:
a daemon with the garbage collector off keeps no staging mapping or memfd of
a closed session, a tenant cannot take every session, and a client whose
session ends mid-store prints no stray traceback."""

from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from conftest import DaemonProc, pool_free, wait_free

STAGING = "memfd:rpcbuf-staging"


@pytest.fixture(autouse=True)
def _same_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RPCBUF_SAME_HOST", raising=False)  # these are about that path


def _staging_held(pid: int) -> tuple[int, int]:
    """(staging mappings, staging memfds) the process ``pid`` holds."""
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(STAGING in line for line in f)
    fds = 0
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            fds += STAGING in os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            pass  # closed meanwhile
    return maps, fds


async def _held_settles(pid: int, timeout: float = 15.0) -> tuple[int, int]:
    """What ``pid`` holds once it stops changing to (0, 0), or at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        held = _staging_held(pid)
        if held == (0, 0) or time.monotonic() > deadline:
            return held
        await asyncio.sleep(0.1)


async def test_closed_sessions_leave_no_staging_behind_without_gc(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProc = daemon_factory("--device", "cpu:64MiB", gc_disabled=True)
    pid = d.proc.pid
    start = await pool_free(d)
    data = np.arange(2 << 20, dtype=np.uint8)  # the ring (2 chunks) ...
    small = np.arange(1000, dtype=np.uint8)  # ... and a small slot

    async def one() -> None:
        async with d.connect() as c:
            assert c.same_host
            bid = await c.request_buffer(data.nbytes)
            await c.store_tensor(bid, data)
            await c.store_tensor(bid, small, offset=7)
            assert np.array_equal(await c.read_buffer(bid, 7, 1000), small)
            # session-scoped: released when the session closes

    for _ in range(10):  # 100 sessions, 10 at a time
        await asyncio.gather(*(one() for _ in range(10)))
    assert await _held_settles(pid) == (0, 0)
    assert await wait_free(d, start) == start
