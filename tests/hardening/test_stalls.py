"""A hostile same-host client that stops half-way: it asks for a store
through the staging ring and never fills it (or a read, and never empties
it).  The daemon never touches the client's memory, so nothing can block it
inside a system call; what is left to bound is the wait: the op runs on the
daemon's bounded copy threads, within the tenant's share of them, and ends
at the transfer deadline; the event loop, other tenants' small and big ops
go on, and its buffer stays pinned and locked until the copy thread returns.
(The daemon's own staging area is size-sealed: no client can make its
copies fault, ``test_same_host.py``.)"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc, pool_free, wait_free
from rpcbuf.control.wire import protocol as P
from rpcbuf.dataplane import staging


async def _served(d: DaemonProc, tenant: str, nbytes: int, timeout: float = 3.0) -> None:
    """A same-host store and read of ``nbytes`` by ``tenant``, each within ``timeout``."""
    async with asyncio.timeout(timeout * 4):
        async with rpcbuf.connect(d.addr, token=d.token(tenant), timeout=timeout) as c:
            assert c.same_host
            bid = await c.request_buffer(nbytes)
            data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
            await asyncio.wait_for(c.store_tensor(bid, data), timeout)
            assert np.array_equal(await asyncio.wait_for(c.read_buffer(bid), timeout), data)
            await c.release_buffer(bid)


def _stall(c: rpcbuf.RpcContext, bid: str, nbytes: int, read: bool = False
           ) -> asyncio.Future[dict]:
    """A ring op whose chunks we never produce (or consume)."""
    c._handles.area.reset()
    cls = P.Read if read else P.Store
    return c._conn.submit(c._conn.next_id(), cls(buffer_id=bid, offset=0, nbytes=nbytes,
                                                  path="staged", stage=staging.RING))


@pytest.mark.parametrize("read", [False, True], ids=["store", "read"])
async def test_a_stalled_ring_op_stalls_nobody_else(daemon_factory, read: bool) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:32MiB", "--transfer-timeout", "3s")
    start = await pool_free(d)
    async with d.connect("mallory") as m:
        assert m.same_host
        nbytes = (staging.RING_SLOTS + 4) * staging.RING_CHUNK  # more than the ring holds
        bid = await m.request_buffer(nbytes)
        stalled = _stall(m, bid, nbytes, read)
        await asyncio.sleep(0.3)  # the daemon waits on the ring now
        assert not stalled.done()
        await _served(d, "alice", 4096)
        await _served(d, "alice", 6 << 20)
        msg = await asyncio.wait_for(stalled, 10)  # its deadline: the op ends, the session not
        assert msg["error"]["code"] == "CONNECTION_LOST"
        assert "did not keep up" in msg["error"]["message"]
        assert await m.ping()
        await m.release_buffer(bid)
    assert await wait_free(d, start, timeout=10) == start


async def test_one_tenant_cannot_fill_the_copy_threads(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Ten stalled ring ops of one tenant (ten sessions) take at most half
    the copy threads: another tenant's big op runs on the others."""
    d = daemon_factory("--device", "cpu:96MiB", "--transfer-timeout", "20s",
                       "--copy-threads", "4")
    start = await pool_free(d)
    n, size = 10, (staging.RING_SLOTS + 2) * staging.RING_CHUNK
    sessions = [await d.connect("mallory") for _ in range(n)]
    try:
        stalls = []
        for m in sessions:
            stalls.append(_stall(m, await m.request_buffer(size), size))
        await asyncio.sleep(0.5)
        assert not any(s.done() for s in stalls)
        await _served(d, "alice", 6 << 20)  # big: on a copy thread mallory cannot take
        await _served(d, "bob", 4096)
    finally:
        for m in sessions:
            await m.close()  # their copies stop within a wait slice
    assert await wait_free(d, start, timeout=10) == start


async def test_a_daemon_with_a_stalled_ring_op_still_stops(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM while a ring op waits for a client that does nothing: the
    session closes, its copy stops, the daemon exits 0."""
    d = daemon_factory("--device", "cpu:16MiB", "--drain-timeout", "1s",
                       "--transfer-timeout", "120s")
    async with d.connect("mallory") as m:
        size = (staging.RING_SLOTS + 2) * staging.RING_CHUNK
        stalled = _stall(m, await m.request_buffer(size), size)
        await asyncio.sleep(0.3)
        assert await asyncio.to_thread(d.stop, timeout=20) == 0
        try:  # an error answer is as good as a lost connection
            assert not (await asyncio.wait_for(stalled, 10)).get("ok")
        except rpcbuf.ConnectionLost:
            pass
