"""Same-host copies of memory that never arrives (a userfaultfd range, as a
hostile client's FUSE- or userfaultfd-backed pages would be): the copy
stalls, but only on the daemon's bounded copy threads and only within the
stalling tenant's share of them; the event loop, other tenants' small and big
copies go on; the stalled copy has a deadline (its session is aborted), and
its buffer stays pinned and locked until the copy thread returns."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest

import rpcbuf
import uffd
from conftest import DaemonProc, pool_free, wait_free
from control.wire import protocol as P

pytestmark = pytest.mark.skipif(uffd.available() is not None,
                                reason=f"needs userfaultfd: {uffd.available()}")


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


async def test_a_stalled_small_copy_stalls_nobody_else(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:16MiB", "--transfer-timeout", "3s")
    start = await pool_free(d)
    stalled = uffd.Stalled(1 << 20)
    try:
        async with d.connect("mallory") as m:
            assert m.same_host
            bid = await m.request_buffer(4096)
            store = await m.store_tensor(bid, stalled.array[:4096], sync=False)
            await asyncio.sleep(0.3)  # the daemon is inside process_vm_readv now
            assert not store.done()
            await _served(d, "alice", 4096)  # (before: the event loop itself was stuck)
            await _served(d, "alice", 6 << 20)
            with pytest.raises(rpcbuf.ConnectionLost):  # its deadline: the session ends
                await asyncio.wait_for(store, 10)
    finally:
        stalled.release()  # the copy thread returns; then the buffer goes
    assert await wait_free(d, start, timeout=10) == start
    assert "transfer deadline passed" in d.log()


async def test_one_tenant_cannot_fill_the_copy_threads(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Seen: six stalled copies filled the default thread pool and every
    other tenant's big copy waited behind them."""
    d = daemon_factory("--device", "cpu:96MiB", "--transfer-timeout", "20s")
    start = await pool_free(d)
    n, size = 10, 4 << 20
    stalled = uffd.Stalled(n * size)
    try:
        async with d.connect("mallory") as m:
            bids = [await m.request_buffer(size) for _ in range(n)]
            stores = [await m.store_tensor(b, stalled.array[i * size:(i + 1) * size], sync=False)
                      for i, b in enumerate(bids)]
            await asyncio.sleep(0.5)
            assert not any(s.done() for s in stores)
            await _served(d, "alice", 6 << 20)  # big: on a copy thread mallory cannot take
            await _served(d, "bob", 4096)
            stalled.release()
            await asyncio.wait_for(asyncio.gather(*stores), 20)  # and mallory's finish too
            for b in bids:
                await m.release_buffer(b)
    finally:
        stalled.release()
    assert await wait_free(d, start, timeout=10) == start


async def test_a_probe_of_stalled_memory_does_not_stall_hello(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """The hello probe reads client memory too: a probe address in memory
    that never arrives gets a prompt answer without the same-host path."""
    d = daemon_factory("--device", "cpu:4MiB")
    async with d.connect(same_host=False) as net:
        sock_name = net.hello["local"]["socket"]
    stalled = uffd.Stalled(4096)
    try:
        reader, writer = await asyncio.open_unix_connection(sock=_unix(sock_name))
        writer.write(P.encode_frame({"op": "hello", "id": 1, "token": d.token("mallory"),
                                     "version": 1, "probe": b"\x01" * 16,
                                     "probe_addr": stalled.array.ctypes.data}))
        dec = P.FrameDecoder()
        msgs: list[dict[str, object]] = []
        async with asyncio.timeout(3):  # (before: the event loop was stuck in the probe)
            while not msgs:
                msgs = dec.feed(await reader.read(1 << 16))
        result = msgs[0]["result"]
        assert isinstance(result, dict)
        assert result["same_host"] is False and "probe" in result["same_host_why"]
        await _served(d, "alice", 4096)
        writer.close()
    finally:
        stalled.release()


def _unix(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect("\0" + name[1:] if name.startswith("@") else name)
    return sock


async def test_a_daemon_with_a_stuck_copy_still_stops(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """SIGTERM while a copy is stuck for good: the drain gives up on it and
    the daemon exits 0 (its memory goes with the process)."""
    d = daemon_factory("--device", "cpu:4MiB", "--drain-timeout", "1s")
    stalled = uffd.Stalled(4096)
    try:
        async with d.connect("mallory") as m:
            bid = await m.request_buffer(4096)
            store = await m.store_tensor(bid, stalled.array, sync=False)
            await asyncio.sleep(0.3)
            assert await asyncio.to_thread(d.stop, timeout=20) == 0
            with pytest.raises(rpcbuf.ConnectionLost):
                await asyncio.wait_for(store, 10)
    finally:
        stalled.release()
