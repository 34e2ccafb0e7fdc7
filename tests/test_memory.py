"""Memory comes back: release, leases, sessions, waiting, and killed clients."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import rpcbuf
from conftest import pool_free, wait_free

pytestmark = pytest.mark.both_paths  # the same-host and the UCX data path


async def test_release_returns_exact_bytes(ctx: rpcbuf.RpcContext, clean_pool) -> None:  # type: ignore[no-untyped-def]
    start = await pool_free(clean_pool)
    ids = [await ctx.request_buffer(s) for s in (1, 300, 4096, 5000, 1 << 20, 3 << 20)]
    metas = [await ctx.get_buffer_meta(b) for b in ids]
    assert await pool_free(clean_pool) == start - sum(m["alloc_size"] for m in metas)
    for b in ids:
        await ctx.release_buffer(b)
    assert await pool_free(clean_pool) == start


async def test_ttl_expires_and_renew_extends(ctx: rpcbuf.RpcContext, clean_pool) -> None:  # type: ignore[no-untyped-def]
    start = await pool_free(clean_pool)
    short = await ctx.request_buffer(1 << 20, ttl=0.5)
    kept = await ctx.request_buffer(1 << 20, ttl=0.5)
    for _ in range(4):
        await asyncio.sleep(0.25)
        expires = await ctx.renew_buffer(kept, 0.5)
        assert expires is not None and expires > time.time()
    with pytest.raises(rpcbuf.NotFound):
        await ctx.get_buffer_meta(short)  # expired a while ago
    assert (await ctx.get_buffer_meta(kept))["size"] == 1 << 20
    assert await pool_free(clean_pool) == start - (1 << 20)
    await asyncio.sleep(0.8)
    with pytest.raises(rpcbuf.NotFound):
        await ctx.renew_buffer(kept)
    assert await pool_free(clean_pool) == start
    assert (await ctx.stats())["expired_total"] >= 2


async def test_session_buffers_go_with_the_session(clean_pool) -> None:  # type: ignore[no-untyped-def]
    start = await pool_free(clean_pool)
    async with clean_pool.connect("alice") as c:
        await c.request_buffer(1 << 20)  # session-scoped
        named = await c.request_buffer(1 << 20, name="model/shard0")
        leased = await c.request_buffer(1 << 20, ttl=30)
        await c.store_tensor(named, np.arange(1000, dtype=np.float32), verify="checksum")
    assert await wait_free(clean_pool, start - (2 << 20)) == start - (2 << 20)
    async with clean_pool.connect("alice") as c:  # another process of the same tenant
        back = await c.read_buffer(named, 0, 4000)
        np.testing.assert_array_equal(back.view(np.float32), np.arange(1000, dtype=np.float32))
        assert (await c.get_buffer_meta(leased))["expires_at"] is not None
        await c.release_buffer(named)
        await c.release_buffer(leased)
    assert await pool_free(clean_pool) == start


async def test_wait_for_memory(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:8MiB")
    async with d.connect("alice") as a, d.connect("bob") as b:
        big = await a.request_buffer(8 << 20)
        t0 = time.monotonic()
        with pytest.raises(rpcbuf.OutOfMemory) as info:
            await b.request_buffer(4 << 20, timeout=0.3)
        assert time.monotonic() - t0 >= 0.25
        assert info.value.details == {"requested": 4 << 20, "block": 4 << 20, "free": 0,
                                      "largest_free": 0, "device": "cpu:0"}
        with pytest.raises(rpcbuf.OutOfMemory):
            await b.request_buffer(1 << 20)  # no timeout: fail at once
        # first come, first served: the 4 MiB waiter is ahead of the 1 MiB one
        first = asyncio.create_task(b.request_buffer(4 << 20, timeout=10))
        await asyncio.sleep(0.1)
        second = asyncio.create_task(b.request_buffer(1 << 20, timeout=10))
        await asyncio.sleep(0.2)
        assert not first.done() and not second.done()
        assert (await b.stats())["waiters"] == {"cpu:0": 2}  # a tenant sees its own
        await a.release_buffer(big)
        got1, got2 = await asyncio.gather(first, second)
        await b.release_buffer(got1)
        await b.release_buffer(got2)
        # a waiter whose client goes away is removed and memory is not lost
        hog = await a.request_buffer(8 << 20)
        async with d.connect("carol") as c:
            waiting = asyncio.create_task(c.request_buffer(1 << 20, timeout=30))
            await asyncio.sleep(0.2)
        with pytest.raises(rpcbuf.ConnectionLost):
            await waiting
        await asyncio.sleep(0.2)
        async with d.connect("carol") as c:
            assert (await c.stats())["waiters"] == {"cpu:0": 0}
        await a.release_buffer(hog)
        assert await wait_free(d, 8 << 20) == 8 << 20


KILLED_CLIENT = textwrap.dedent("""
    import asyncio, os, sys, numpy as np, rpcbuf, uvloop
    async def main():
        ctx = await rpcbuf.connect(os.environ["ADDR"], token=os.environ["TOKEN"])
        buf = await ctx.request_buffer(256 << 20)
        data = np.ones(256 << 20, np.uint8)
        print("storing", flush=True)
        await ctx.store_tensor(buf, data)
        print("done", flush=True)
        await asyncio.sleep(60)
    uvloop.run(main())
""")


async def test_client_killed_mid_store(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:512MiB")
    start = await pool_free(d)
    env = {**os.environ, "ADDR": d.addr, "TOKEN": d.token("alice")}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), 30)
        assert line.strip() == "storing"
        await asyncio.sleep(0.02)  # somewhere inside the 256 MiB transfer
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(10)
    assert await wait_free(d, start, timeout=20) == start
    async with d.connect("alice") as c:  # still serving, memory reusable
        buf = await c.request_buffer(256 << 20)
        await c.store_tensor(buf, np.zeros(1 << 20, np.uint8), verify="checksum")
        await c.release_buffer(buf)
    assert d.proc.poll() is None


async def test_release_during_transfer_is_deferred(ctx: rpcbuf.RpcContext, clean_pool) -> None:  # type: ignore[no-untyped-def]
    start = await pool_free(clean_pool)
    buf = await ctx.request_buffer(64 << 20)
    store = asyncio.create_task(ctx.store_tensor(buf, np.ones(64 << 20, np.uint8)))
    await asyncio.sleep(0)  # the store request is on the wire before the release
    await ctx.release_buffer(buf)
    with pytest.raises(rpcbuf.NotFound):
        await ctx.get_buffer_meta(buf)
    try:
        await store  # either finished before the release was seen, or refused
    except rpcbuf.NotFound:
        pass
    assert await wait_free(clean_pool, start) == start


async def test_daemon_killed_fails_every_pending_call(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:512MiB")
    async with d.connect("alice") as c:
        buf = await c.request_buffer(256 << 20)
        hog = await c.request_buffer(256 << 20)
        pending = [
            asyncio.create_task(c.request_buffer(1 << 20, timeout=60)),  # waits for memory
            asyncio.create_task(c.store_tensor(buf, np.ones(256 << 20, np.uint8))),
            asyncio.create_task(c.read_buffer(hog, 0, 256 << 20)),
        ]
        await asyncio.sleep(0.05)
        d.proc.send_signal(signal.SIGKILL)
        done, not_done = await asyncio.wait(pending, timeout=20)
        assert not not_done, "a call hung after the daemon died"
        for t in done:
            exc = t.exception()
            # the store or read may have finished before the kill; nothing else is allowed
            assert exc is None or isinstance(exc, rpcbuf.ConnectionLost), exc
        assert isinstance(pending[0].exception(), rpcbuf.ConnectionLost)
        with pytest.raises(rpcbuf.ConnectionLost):
            await c.ping()
    d.proc.wait(10)


async def test_transfer_deadline_aborts_a_stalled_store(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    from rpcbuf.control.wire import protocol as P

    d = daemon_factory("--device", "cpu:16MiB", "--transfer-timeout", "1s")
    start = await pool_free(d)
    async with d.connect("alice", same_host=False) as c:  # the UCX path: a receive can stall
        buf = await c.request_buffer(1 << 20)
        # announce a store but never send its payload: the daemon's receive stalls
        conn = c._conn
        fut = conn.submit(conn.next_id(), P.Store(buffer_id=buf, offset=0, nbytes=1 << 20))
        with pytest.raises(rpcbuf.ConnectionLost):
            await asyncio.wait_for(fut, 10)
    assert await wait_free(d, start) == start
    assert "transfer deadline passed" in d.log()


@pytest.mark.parametrize("allocator", ["linear", "slab"])
async def test_other_allocators_serve_end_to_end(daemon_factory, allocator: str) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:8MiB", "--allocator", allocator)
    start = await pool_free(d)
    async with d.connect("alice") as c:
        ids = [await c.request_buffer(s) for s in (100, 5000, 70_000, 1 << 20)]
        metas = [await c.get_buffer_meta(b) for b in ids]
        assert all(m["base_addr"] % 256 == 0 for m in metas)
        assert (await c.list_devices())[0]["allocator"] == allocator
        for b, m in zip(ids, metas, strict=True):
            await c.store_tensor(b, np.full(m["size"], 5, np.uint8), verify="checksum")
        for b in ids:
            await c.release_buffer(b)
    assert await wait_free(d, start) == start


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def test_a_big_new_buffer_is_backed_with_memory_before_the_answer(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """request_buffer answers once a new host buffer's pages are resident
    (control/daemon/accounting/prefault.py), so its first store does not fault them in;
    a small one is answered at once; the pool comes back whole."""
    from rpcbuf.dataplane.arena import HostArena

    if not HostArena(1 << 16).prefault.populate(0, 1 << 16):
        pytest.skip("this kernel lacks MADV_POPULATE_WRITE (Linux 5.14+)")
    d = daemon_factory("--device", "cpu:256MiB")
    start = await pool_free(d)
    async with d.connect("alice") as c:
        before = _rss_kib(d.proc.pid)
        small = await c.request_buffer(1 << 20)
        big = await c.request_buffer(96 << 20)
        assert _rss_kib(d.proc.pid) - before >= 90 << 10, "the new buffer is not resident"
        data = np.arange(96 << 20, dtype=np.uint8)
        await c.store_tensor(big, data, verify="checksum")
        assert np.array_equal(await c.read_buffer(big, 0, 1 << 20), data[: 1 << 20])
        for bid in (small, big):
            await c.release_buffer(bid)
    assert await wait_free(d, start) == start


async def test_out_of_memory_names_what_fits_and_the_rounding(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 37 item 4: "no block of 200.0 MiB free on cpu:0; 254.9 MiB free"
    read as a bug.  The refusal says the largest free block (what fits) and,
    where the buddy allocator rounds up, the block the request takes."""
    d = daemon_factory("--device", "cpu:16MiB")
    async with d.connect("alice") as c:
        small = await c.request_buffer(100 << 10)  # splits the arena: 8 MiB is the largest left
        with pytest.raises(rpcbuf.OutOfMemory) as info:
            await c.request_buffer(9 << 20)
        msg = str(info.value)
        assert "9.0 MiB" in msg and "block of 16.0 MiB" in msg, msg  # the rounding
        assert "largest free block is 8.0 MiB" in msg, msg  # what fits
        assert info.value.details["largest_free"] == 8 << 20
        assert info.value.details["block"] == 16 << 20
        await c.release_buffer(small)
