"""The same-host path: a client on the daemon's host reconnects on its Unix
socket, binds a handle channel, and its bytes meet the daemon's in the
staging area the daemon made (``dataplane/staging.py``); nothing of the
client's memory is touched by the daemon.  Real daemons, real copies.

The rest of the suite runs on this path too (it is the default for a loopback
client); tests marked ``both_paths`` run again on the UCX path.
Attachments (zero-copy reads in place) are in ``test_attach.py``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc, pool_free, wait_free
from rpcbuf.control.wire import protocol as P
from rpcbuf.dataplane import shm, staging


@pytest.fixture(autouse=True)
def _default_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the same-host path's staging area: a
    RPCBUF_SAME_HOST=0 run of the suite (the UCX path) must not turn it off
    here, and the verbs copy through it, not in place (``test_map.py``)."""
    monkeypatch.delenv("RPCBUF_SAME_HOST", raising=False)
    monkeypatch.setenv("RPCBUF_IN_PLACE", "0")


async def _raw(c: rpcbuf.RpcContext, req: P.Request) -> dict:
    req_id = c._conn.next_id()
    return await asyncio.wait_for(c._conn.submit(req_id, req), 10)


async def test_loopback_client_gets_the_same_host_path(daemon: DaemonProc) -> None:
    start = await pool_free(daemon)
    async with daemon.connect() as fast, daemon.connect(same_host=False) as net:
        assert fast.same_host and not net.same_host
        assert fast._paths.ucx.ep is None  # no UCX endpoint until a GPU array needs one
        rng = np.random.default_rng(2)
        bid = await fast.request_buffer(8 << 20)
        for n in (1, 4096, staging.SMALL, staging.SMALL + 1, staging.RING_CHUNK,
                  staging.RING_CHUNK * staging.RING_SLOTS + 12345, 8 << 20):
            data = rng.integers(0, 256, n, dtype=np.uint8)
            await fast.store_tensor(bid, data, verify="checksum")
            # The other path reads what this one stored (same buffer, same tenant).
            assert np.array_equal(await net.read_buffer(bid, 0, n), data), n
            await net.store_tensor(bid, data[::-1].copy(), offset=0)
            assert np.array_equal(await fast.read_buffer(bid, 0, n), data[::-1]), n
        small = np.arange(100, dtype=np.uint8)
        await fast.store_tensor(bid, small, offset=17)
        assert np.array_equal(await fast.read_buffer(bid, 17, 100), small)
        await fast.release_buffer(bid)
    assert await wait_free(daemon, start) == start


async def test_batches_stream_through_the_ring(daemon: DaemonProc) -> None:
    """Many tensors (gaps between them, touching ones coalesced) and an
    overlapping read batch, bigger than the ring: bytes land where they belong."""
    async with daemon.connect() as c:
        bid = await c.request_buffer(16 << 20)
        await c.clear_buffer(bid, 0xEE)
        rng = np.random.default_rng(5)
        items, at = [], 0
        for i in range(300):
            n = int(rng.integers(1, 100_000))
            items.append((at, rng.integers(0, 256, n, dtype=np.uint8)))
            at += n + (0 if i % 3 else 4096)  # some touch, some leave a gap
        res = await c.store_batch(bid, items, verify="checksum")
        assert res["messages"] == 0  # no UCX message: all through the staging area
        for off, a in items[::37]:
            assert np.array_equal(await c.read_buffer(bid, off, a.nbytes), a)
        gap = items[3][0] + items[3][1].nbytes  # item 3 (i % 3 == 0) has a gap after it
        assert (await c.read_buffer(bid, gap, 4096) == 0xEE).all()
        ranges = [(off, a.nbytes) for off, a in items] + [(0, 10 << 20)]
        got = await c.read_batch(bid, ranges)
        for (_, a), g in zip(items, got, strict=False):
            assert np.array_equal(g, a)
        assert got[-1].nbytes == 10 << 20
        await c.release_buffer(bid)


async def test_env_and_required(daemon: DaemonProc, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RPCBUF_SAME_HOST", "0")
    async with daemon.connect() as c:
        assert not c.same_host
    monkeypatch.setenv("RPCBUF_SAME_HOST", "1")
    async with daemon.connect() as c:
        assert c.same_host


async def test_unix_address_connects_directly(daemon: DaemonProc) -> None:
    async with daemon.connect(same_host=False) as net:
        sock = net.hello["local"]["socket"]
    assert sock.startswith("@")  # abstract: only this network namespace sees it
    async with rpcbuf.connect(f"unix:{sock}", token=daemon.token()) as c:
        assert c.same_host
        bid = await c.request_buffer(4096)
        await c.store_tensor(bid, np.full(4096, 7, np.uint8))
        assert (await c.read_buffer(bid) == 7).all()
    with pytest.raises(rpcbuf.ConnectionLost):
        await rpcbuf.connect("unix:@no-such-rpcbufd", token=daemon.token(), timeout=5)


async def test_daemon_without_local_socket(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:4MiB", "--local-socket", "none")
    async with d.connect() as c:
        assert not c.same_host and "local" not in c.hello
        bid = await c.request_buffer(1000)
        await c.store_tensor(bid, np.ones(1000, np.uint8))
        assert (await c.read_buffer(bid) == 1).all()
    with pytest.raises(rpcbuf.BadRequest, match="same-host path is not available"):
        await d.connect(same_host=True)


async def test_socket_file_path(daemon_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "rpcbufd.sock"
    path.write_text("")  # a plain file is not a stale socket: the daemon must not delete it
    with pytest.raises(RuntimeError):
        daemon_factory("--device", "cpu:4MiB", "--local-socket", str(path))
    path.unlink()
    d = daemon_factory("--device", "cpu:4MiB", "--local-socket", str(path))
    assert path.is_socket()
    async with rpcbuf.connect(f"unix:{path}", token=d.token()) as c:
        assert c.same_host
        bid = await c.request_buffer(64)
        await c.store_tensor(bid, np.arange(64, dtype=np.uint8))
        assert np.array_equal(await c.read_buffer(bid), np.arange(64, dtype=np.uint8))
    assert d.stop() == 0
    assert not path.exists()  # removed at shutdown


@pytest.mark.skipif(os.geteuid() != 0, reason="/proc/self/map_files needs root (as in CI)")
async def test_the_staging_area_is_the_daemons_and_cannot_shrink(daemon: DaemonProc) -> None:
    """The client gets a memfd the daemon made, exactly the staging size,
    sealed so that nobody can shrink it under the daemon's mapping (which
    would make the daemon's copies fault)."""
    async with daemon.connect() as c:
        area = c._handles.area
        assert area is not None
        line = next(x for x in open("/proc/self/maps").read().splitlines()  # ours: others'
                    if int(x.split("-")[0], 16) == area.address)  # may still be mapped here
        assert "memfd:rpcbuf-staging" in line
        span = line.split()[0]
        fd = os.open(f"/proc/self/map_files/{span}", os.O_RDWR)
        try:
            assert os.fstat(fd).st_size == staging.SIZE
            sealed = shm.seals(fd)
            assert sealed & shm.F_SEAL_SHRINK and sealed & shm.F_SEAL_GROW
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 4096)
        finally:
            os.close(fd)


async def test_bad_stages_are_bad_requests(daemon: DaemonProc) -> None:
    start = await pool_free(daemon)
    async with daemon.connect() as c, daemon.connect(same_host=False) as net:
        bid = await c.request_buffer(1 << 20)
        await c.clear_buffer(bid, 9)
        for stage, nbytes in ((staging.SMALL_SLOTS, 8), (staging.RING + 1, 8),
                              (0, staging.SMALL + 1)):
            msg = await _raw(c, P.Store(buffer_id=bid, offset=0, nbytes=nbytes,
                                        path="staged", stage=stage))
            assert msg["error"]["code"] == "BAD_REQUEST", (stage, nbytes)
            msg = await _raw(c, P.Read(buffer_id=bid, offset=0, nbytes=nbytes,
                                       path="staged", stage=stage))
            assert msg["error"]["code"] == "BAD_REQUEST", (stage, nbytes)
        for req in (P.Store(buffer_id=bid, offset=0, nbytes=8, stage=0),  # off its path
                    P.Read(buffer_id=bid, offset=0, nbytes=8, path="staged")):  # no slot
            msg = await _raw(c, req)
            assert "staging slot" in msg["error"]["message"], msg
        # staging slots on a session that is not same-host
        msg = await _raw(net, P.Store(buffer_id=bid, offset=0, nbytes=8, path="staged",
                                      stage=0))
        assert msg["error"]["details"]["reason"] == "not_same_host"
        # out of range is checked before any copy
        msg = await _raw(c, P.Store(buffer_id=bid, offset=(1 << 20) - 4, nbytes=8,
                                    path="staged", stage=0))
        assert msg["error"]["code"] == "OUT_OF_RANGE"
        assert (await c.read_buffer(bid) == 9).all()  # nothing landed anywhere
        assert await c.ping() and await net.ping()
        await c.release_buffer(bid)
    assert await wait_free(daemon, start) == start


async def test_one_ring_op_at_a_time(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A second ring op while one streams is refused (the client never
    sends one: it takes the ring in turn); the first goes on."""
    d = daemon_factory("--device", "cpu:16MiB", "--transfer-timeout", "2s")
    async with d.connect() as c:
        bid = await c.request_buffer(12 << 20)
        area = c._handles.area
        area.reset()  # a store of 8 chunks whose chunks we produce by hand
        first = c._conn.submit(c._conn.next_id(), P.Store(
            buffer_id=bid, offset=0, nbytes=8 * staging.RING_CHUNK, path="staged",
            stage=staging.RING))
        await asyncio.sleep(0.2)  # it waits for chunk 0 now
        msg = await _raw(c, P.Store(buffer_id=bid, offset=10 << 20,
                                    nbytes=2 * staging.RING_CHUNK, path="staged",
                                    stage=staging.RING))
        assert msg["error"]["details"]["reason"] == "ring_busy", msg
        pieces = [np.full(8 * staging.RING_CHUNK, 4, np.uint8)]
        await asyncio.to_thread(area.pump, pieces, True, lambda: False, 1e18)
        assert (await asyncio.wait_for(first, 10))["ok"]
        assert (await c.read_buffer(bid, 0, 8 * staging.RING_CHUNK) == 4).all()
        await c.release_buffer(bid)


async def test_pipelined_copies_keep_their_order(daemon: DaemonProc) -> None:
    """A small same-host store sent right behind a big one on the same range
    must not overtake it."""
    async with daemon.connect() as c:
        assert c.same_host
        bid = await c.request_buffer(8 << 20)
        big, small = np.full(6 << 20, 1, np.uint8), np.full(4096, 2, np.uint8)
        for _ in range(5):
            await asyncio.gather(c.store_tensor(bid, big), c.store_tensor(bid, small))
            assert (await c.read_buffer(bid, 0, 4096) == 2).all()  # the later one wins
        await c.release_buffer(bid)


async def test_client_killed_mid_copy_frees_its_memory(daemon: DaemonProc) -> None:
    """A same-host client SIGKILLed while its 256 MiB stream through the
    ring: the daemon's copy stops (session closed), memory comes back."""
    start = await pool_free(daemon)
    script = (
        "import asyncio, sys, numpy as np, rpcbuf\n"
        "async def main():\n"
        "    c = await rpcbuf.connect(sys.argv[1], token=sys.argv[2])\n"
        "    assert c.same_host\n"
        "    bid = await c.request_buffer(256 << 20)\n"
        "    data = np.ones(256 << 20, np.uint8)\n"
        "    print('storing', flush=True)\n"
        "    while True:\n"
        "        await c.store_tensor(bid, data)\n"
        "asyncio.run(main())\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, daemon.addr, daemon.token(),
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": "src"})
    assert proc.stdout is not None
    assert (await asyncio.wait_for(proc.stdout.readline(), 30)).strip() == b"storing"
    await asyncio.sleep(0.3)  # a few stores in
    proc.kill()
    await proc.wait()
    assert await wait_free(daemon, start, timeout=20) == start
    async with daemon.connect() as c:  # the daemon serves on
        assert await c.ping()


def test_store_request_fields_round_trip() -> None:
    req = P.Store(buffer_id="b", offset=0, nbytes=8, path="staged", stage=3)
    assert P.parse_request(req.to_wire(5)) == (5, req)
    with pytest.raises(P.RequestError):
        P.parse_request({**req.to_wire(5), "stage": -1})
    with pytest.raises(P.RequestError):  # protocol 2's addresses are gone
        P.parse_request({**req.to_wire(5), "addr": 4096})
    batch = dataclasses.replace(P.StoreBatch(buffer_id="b", offsets=P.pack_u64([0]),
                                             sizes=P.pack_u64([8])),
                                path="staged", stage=staging.RING)
    assert P.parse_request(batch.to_wire(6)) == (6, batch)


async def test_small_copy_waits_for_a_busy_range(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A small same-host store waits for the range lock: here a UCX store
    holds the range (announced, payload never sent) until its deadline."""
    d = daemon_factory("--device", "cpu:4MiB", "--transfer-timeout", "1s")
    async with d.connect(same_host=False) as net, d.connect() as fast:
        assert fast.same_host
        bid = await fast.request_buffer(1 << 20, name="shared")
        await fast.clear_buffer(bid)
        req_id = net._conn.next_id()
        stalled = net._conn.submit(req_id, P.Store(buffer_id=bid, offset=0, nbytes=1 << 20))
        await asyncio.sleep(0.2)  # the daemon holds [0, 1 MiB) for it now
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await fast.store_tensor(bid, np.full(4096, 3, np.uint8), offset=4096)
        waited = loop.time() - t0
        with pytest.raises(rpcbuf.ConnectionLost):
            await asyncio.wait_for(stalled, 10)  # the stalled session was aborted
        assert waited > 0.5  # it waited for the lock instead of writing under it
        assert (await fast.read_buffer(bid, 4096, 4096) == 3).all()
        await fast.release_buffer(bid)


async def test_a_slot_given_up_on_is_never_reused(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A caller that stops waiting (TIMEOUT) leaves its slot to the daemon,
    which may still copy into it: the slot is retired, later ops use others
    and read the right bytes."""
    d = daemon_factory("--device", "cpu:4MiB", "--transfer-timeout", "1s")
    async with d.connect(same_host=False) as net, rpcbuf.connect(
            d.addr, token=d.token(), timeout=0.3) as fast:
        assert fast.same_host
        bid = await fast.request_buffer(1 << 20, name="held")
        await fast.clear_buffer(bid, 5)
        stalled = net._conn.submit(net._conn.next_id(),
                                   P.Store(buffer_id=bid, offset=0, nbytes=1 << 20))
        await asyncio.sleep(0.2)
        path = fast._paths.same_host
        assert path is not None and path._free.qsize() == staging.SMALL_SLOTS
        with pytest.raises(rpcbuf.Timeout):
            await fast.read_buffer(bid, 0, 4096)  # queued behind the stalled store
        with pytest.raises(rpcbuf.ConnectionLost):
            await asyncio.wait_for(stalled, 10)
        await asyncio.sleep(0.2)  # the read ran (into its slot) once the lock freed
        assert path._free.qsize() == staging.SMALL_SLOTS - 1
        for v in range(40):  # more ops than slots: all served, each its own bytes
            await fast.store_tensor(bid, np.full(4096, v, np.uint8))
            assert (await fast.read_buffer(bid, 0, 4096) == v).all()
        await fast.release_buffer(bid)


async def test_replaced_tcp_session_does_not_count(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:1MiB", "--max-sessions", "1")
    async with d.connect() as c:  # TCP hello, then the Unix session takes over its slot
        assert c.same_host
        st = await c.stats()
        assert st["sessions"] == 1 and st["same_host_sessions"] == 1
    assert "aborted" not in d.log()  # a hand-over, not a failure


async def test_a_context_is_not_used_across_fork(daemon: DaemonProc,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """After fork the child shares the parent's staging area and sockets:
    refused instead."""
    async with daemon.connect() as c:
        bid = await c.request_buffer(64)
        real = os.getpid()
        monkeypatch.setattr(os, "getpid", lambda: real + 1)  # as seen in a forked child
        with pytest.raises(rpcbuf.ConnectionLost, match="another process"):
            await c.store_tensor(bid, np.ones(64, np.uint8))
        monkeypatch.undo()
        await c.release_buffer(bid)


async def test_a_root_daemon_serves_the_path(daemon: DaemonProc) -> None:
    """No ptrace rights are needed any more: a daemon running as root (as
    here, in CI) serves the same-host path without any unsafe flag."""
    async with daemon.connect() as c:
        assert c.same_host and "same_host_why" not in c.hello
    assert "unsafe" not in daemon.log()
