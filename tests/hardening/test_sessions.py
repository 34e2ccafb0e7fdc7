"""Same-host sessions cost what they hold, and give it all back when they end:
a daemon with the garbage collector off keeps no staging mapping or memfd of
a closed session, a tenant cannot take every session, and a client whose
session ends mid-store prints no stray traceback."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc, pool_free, wait_free
from rpcbuf.control.daemon.ops.mapops import GRANT_PAGE_BYTES
from rpcbuf.dataplane import staging

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


def _our_staging_maps() -> int:
    """How many staging mappings this (the client's) process holds."""
    with open("/proc/self/maps") as f:
        return sum(STAGING in line for line in f)


async def test_a_client_keeps_no_staging_of_closed_sessions_without_gc(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """The client side of the same rule: with the collector off, a client
    that opens and closes (or aborts) same-host sessions keeps none of
    their 6 MiB staging mappings, even one closed while its ring op streams
    (it used to keep every one until a collection: 60 sessions, 60)."""
    d: DaemonProc = daemon_factory("--device", "cpu:64MiB")
    data = np.arange(2 << 20, dtype=np.uint8)  # the ring (2 chunks) ...
    small = np.arange(1000, dtype=np.uint8)  # ... and a small slot
    big = np.ones(32 << 20, dtype=np.uint8)
    gc.collect()
    start = _our_staging_maps()
    gc.disable()
    try:
        for i in range(12):
            c = await d.connect()
            assert c.same_host
            assert _our_staging_maps() == start + 1
            bid = await c.request_buffer(big.nbytes)
            await c.store_tensor(bid, data)
            await c.store_tensor(bid, small, offset=7)
            assert np.array_equal(await c.read_buffer(bid, 7, 1000), small)
            if i % 3 == 2:  # closed while the client's thread streams a store
                store = asyncio.ensure_future(c.store_tensor(bid, big))
                await asyncio.sleep(0.01)
            if i % 2:
                await c.close()
            else:
                c.abort()
            if i % 3 == 2:
                try:
                    await store
                except rpcbuf.RpcBufError:
                    pass  # cut short (or done before the close): either is fine
            await asyncio.sleep(0)  # a ring thread's end is reported on the loop
        for _ in range(200):  # a stopped ring thread lets go within a chunk: 10 s at most
            if _our_staging_maps() == start:
                break
            await asyncio.sleep(0.05)
        assert _our_staging_maps() == start
    finally:
        gc.enable()


STORER = """
import asyncio, gc, sys, time, numpy as np, rpcbuf
async def main():
    async with rpcbuf.connect(sys.argv[1], token=sys.argv[2]) as c:
        assert c.same_host
        bid = await c.request_buffer(16 << 20)  # a ring op (> SMALL), quick under load
        data = np.ones(16 << 20, np.uint8)
        stores, deadline = 0, time.monotonic() + 30
        try:
            while time.monotonic() < deadline:  # through the ring, back to back
                await c.store_tensor(bid, data)
                stores += 1
        except rpcbuf.RpcBufError as exc:
            print("ended", stores, type(exc).__name__, flush=True)
try:
    asyncio.run(main())
except rpcbuf.RpcBufError:
    pass  # closing a context whose session ended may say so again
gc.collect()  # a future dropped with its exception unread complains here at the latest
"""


def test_a_store_cut_short_by_its_session_ending_prints_nothing(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """The daemon ends the session (its token expires) while the client's
    thread streams a store through the ring: the store fails with an error,
    and no 'Future exception was never retrieved' (or any traceback) is
    printed."""
    d: DaemonProc = daemon_factory("--device", "cpu:256MiB")
    env = {**os.environ, "PYTHONPATH": "src", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    # A store is under way when the session ends, most times; the token must
    # outlast connect and request_buffer on a loaded machine.
    for ttl in (4.0, 5.0):
        p = subprocess.run([sys.executable, "-c", STORER, d.addr, d.token("bob", ttl=ttl)],
                           capture_output=True, text=True, env=env, timeout=90)
        assert p.returncode == 0, p.stderr
        assert p.stdout.startswith("ended"), (p.stdout, p.stderr)
        assert int(p.stdout.split()[1]) > 0
        assert "never retrieved" not in p.stderr, p.stderr
        assert "Traceback" not in p.stderr, p.stderr


def _shmem_kib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Shmem:"))


async def test_one_tenant_cannot_take_every_session(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d: DaemonProc = daemon_factory("--device", "cpu:64MiB", "--max-sessions", "12",
                                   "--max-sessions-per-tenant", "3")
    held = [await d.connect("greedy").__aenter__() for _ in range(3)]
    try:
        with pytest.raises(rpcbuf.QuotaExceeded) as info:
            await d.connect("greedy")
        assert info.value.details == {"limit": "max_sessions_per_tenant",
                                      "max_sessions_per_tenant": 3, "sessions": 3}
        async with d.connect("other") as other:  # another tenant still gets in
            assert await other.ping()
        await held.pop().close()
        async with d.connect("greedy") as again:  # room again once one left
            assert await again.ping()
    finally:
        for c in held:
            await c.close()
    assert "tenant 'greedy' has 3 sessions on this node" in d.log()


async def test_staging_is_charged_to_its_tenant(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A same-host session's staging area counts against its tenant's quota
    while the session lives; a tenant whose quota cannot spare it gets the
    network path, and its sessions make the daemon hold no staging memory."""
    d: DaemonProc = daemon_factory("--device", "cpu:64MiB", "--quota", "tiny:64KiB:1",
                                   "--quota", "carol:16MiB:-")
    pid = d.proc.pid
    async with d.connect("carol") as c:
        assert c.same_host
        assert (await c.stats())["bytes"] == {"cpu:0": staging.SIZE}
        with pytest.raises(rpcbuf.QuotaExceeded):
            await c.request_buffer(16 << 20)  # the staging area holds part of carol's 16 MiB
        bid = await c.request_buffer(8 << 20)
        await c.store_tensor(bid, np.ones(8 << 20, np.uint8))
        await c.release_buffer(bid)
    async with d.connect("carol", same_host=False) as c:
        assert (await c.stats())["bytes"] == {"cpu:0": 0}  # back once the session ended

    before = _shmem_kib()
    tiny = []
    for _ in range(20):
        c = await d.connect("tiny").__aenter__()
        tiny.append(c)
        assert not c.same_host and "quota" in c.hello["same_host_why"]
    try:
        assert _staging_held(pid) == (0, 0)
        with pytest.raises(rpcbuf.BadRequest, match="quota"):
            await d.connect("tiny", same_host=True)
        # Host Shmem is shared with everything else on the machine: only a
        # loose bound (20 staging areas touched would be 125 MiB).
        assert _shmem_kib() - before < 32 << 10
    finally:
        for c in tiny:
            await c.close()


def _dup_of_attached(address: int) -> int:
    """A new fd of the memfd mapped at ``address`` in this process (what a
    reader that keeps a ``dup`` of its attach handle holds)."""
    with open("/proc/self/maps") as f:
        span = next(line.split()[0] for line in f if int(line.split("-")[0], 16) == address)
    return os.open(f"/proc/self/map_files/{span}", os.O_RDONLY)


async def test_attached_memory_stays_charged_while_the_session_lives(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Request, store, attach, keep a dup of the handle, detach, release: the
    released block is still pinned by the dup, so it stays charged to its
    tenant until the session ends, and the quota bounds what a live session
    can pin this way (it was 19x the quota)."""
    d: DaemonProc = daemon_factory("--device", "cpu:256MiB", "--quota", "mallory:24MiB:-")
    quota, block = 24 << 20, 8 << 20
    kept: list[int] = []
    before = _shmem_kib()
    try:
        async with d.connect("mallory") as c:
            assert c.same_host
            room = quota - staging.SIZE  # the session's staging area is charged too
            rounds = 0
            with pytest.raises(rpcbuf.QuotaExceeded):
                for _ in range(40):
                    bid = await c.request_buffer(block)
                    await c.store_tensor(bid, np.ones(block, np.uint8))
                    async with c.attach(bid) as view:
                        kept.append(_dup_of_attached(view.address))
                    await c.release_buffer(bid)
                    rounds += 1
            assert rounds == room // block
            # Its stores went in place: the session's grant page is charged too.
            page = GRANT_PAGE_BYTES if c.in_place_counts()["grants"] else 0
            assert (await c.stats())["bytes"] == {"cpu:0": staging.SIZE + page + rounds * block}
            grown = _shmem_kib() - before
        async with d.connect("mallory", same_host=False) as c:
            assert (await c.stats())["bytes"] == {"cpu:0": 0}  # the session ended: uncharged
            await c.release_buffer(await c.request_buffer(block))
    finally:
        for fd in kept:
            os.close(fd)
    # Loose (the host's Shmem moves with everything else on it): what 40
    # rounds pinned before was 320 MiB.
    assert grown < 96 << 10, grown
