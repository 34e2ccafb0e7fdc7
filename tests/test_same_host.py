"""The same-host path: a client on the daemon's host has the daemon copy its
arrays directly (process_vm_readv/writev, ``dataplane/cma.py``) after
reconnecting on the daemon's Unix socket.  Real daemons, real copies.

The rest of the suite runs on this path too (it is the default for a loopback
client); ``make test`` runs the data-path files again with
``RPCBUF_SAME_HOST=0`` for the UCX path.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import errno
import gc
import mmap
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc, pool_free, privileged, wait_free
from control.wire import protocol as P
from dataplane import cma


@pytest.fixture(autouse=True)
def _default_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the same-host path: a RPCBUF_SAME_HOST=0 run of
    the suite (the UCX path) must not turn it off here."""
    monkeypatch.delenv("RPCBUF_SAME_HOST", raising=False)


# -- dataplane/cma.py on its own -------------------------------------------------------


def test_cma_copies_in_this_process_and_splits_calls() -> None:
    peer = cma.Peer(os.getpid())
    try:
        src = np.random.default_rng(1).integers(0, 256, 20 << 20, dtype=np.uint8)
        dst = np.zeros_like(src)
        peer.read([dst.ctypes.data], [src.ctypes.data], [src.nbytes])  # cut into 8 MiB calls
        assert np.array_equal(src, dst)
        n = 3000  # more pieces than IOV_MAX: several calls
        offs = np.arange(n, dtype=np.uint64) * 4096
        dst[:] = 0
        peer.write(dst.ctypes.data + offs, src.ctypes.data + offs, np.full(n, 4096))
        assert np.array_equal(src[: n * 4096], dst[: n * 4096])
        calls = cma._calls(offs, offs, np.full(n, 4096))
        assert all(hi - lo <= cma.IOV_MAX for lo, hi, *_ in calls)
        assert sum(c[4] for c in calls) == n * 4096
        assert peer.probe(src.ctypes.data, src[:16].tobytes()) is None
        assert peer.probe(src.ctypes.data, b"x" * 16) is not None
        with pytest.raises(cma.CmaError) as info:
            peer.read([dst.ctypes.data], [8], [100])  # unmapped
        assert info.value.errno == errno.EFAULT
        with pytest.raises(cma.CmaError) as info:
            peer.read([dst.ctypes.data], [src.ctypes.data], [src.nbytes], cancelled=lambda: True)
        assert info.value.errno == errno.ECANCELED
    finally:
        peer.close()


def test_cma_refuses_a_process_that_has_exited() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    peer = cma.Peer(child.pid)
    child.wait()
    try:
        assert not peer.alive()
        buf = np.zeros(16, np.uint8)
        with pytest.raises(cma.CmaError) as info:
            peer.read([buf.ctypes.data], [buf.ctypes.data], [16])
        assert info.value.errno == errno.ESRCH  # never a copy into whoever gets the pid next
    finally:
        peer.close()


# -- through a real daemon ---------------------------------------------------------------


async def test_loopback_client_gets_the_same_host_path(daemon: DaemonProc) -> None:
    start = await pool_free(daemon)
    async with daemon.connect() as fast, daemon.connect(same_host=False) as net:
        assert fast.same_host and not net.same_host
        assert fast._ep is None  # no UCX endpoint until a GPU array needs one
        data = np.random.default_rng(2).integers(0, 256, 3 << 20, dtype=np.uint8)
        bid = await fast.request_buffer(data.nbytes)
        await fast.store_tensor(bid, data, verify="checksum")
        # The other path reads what this one stored (same buffer, same tenant).
        assert np.array_equal(await net.read_buffer(bid), data)
        await net.store_tensor(bid, data[::-1].copy(), offset=0)
        assert np.array_equal(await fast.read_buffer(bid), data[::-1])
        small = np.arange(100, dtype=np.uint8)
        await fast.store_tensor(bid, small, offset=17)
        assert np.array_equal(await fast.read_buffer(bid, 17, 100), small)
        await fast.release_buffer(bid)
    assert await wait_free(daemon, start) == start


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


async def test_socket_file_path(daemon_factory, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
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


async def _raw(c: rpcbuf.RpcContext, req: P.Request) -> dict:
    req_id = c._conn.next_id()
    msg = await asyncio.wait_for(c._conn.submit(req_id, req), 10)
    return msg


async def test_bad_addresses_are_bad_requests(daemon: DaemonProc) -> None:
    start = await pool_free(daemon)
    async with daemon.connect() as c, daemon.connect(same_host=False) as net:
        bid = await c.request_buffer(1 << 20)
        await c.clear_buffer(bid, 9)
        # unmapped source: nothing lands, the session goes on
        msg = await _raw(c, P.Store(buffer_id=bid, offset=0, nbytes=4096, addr=4096))
        assert msg["error"]["code"] == "BAD_REQUEST"
        assert msg["error"]["details"]["reason"] == "bad_address"
        # a read into read-only memory
        ro = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)
        addr = np.frombuffer(ro, dtype=np.uint8).ctypes.data
        msg = await _raw(c, P.Read(buffer_id=bid, offset=0, nbytes=4096, addr=addr))
        assert msg["error"]["details"]["reason"] == "bad_address"
        # partly mapped: a range running past the end of an array's mapping
        msg = await _raw(c, P.Read(buffer_id=bid, offset=0, nbytes=8192, addr=addr))
        assert msg["error"]["code"] == "BAD_REQUEST"
        ro.close()
        # addresses and items that do not line up
        one = np.ones(8, np.uint8)
        req = P.StoreBatch(buffer_id=bid, offsets=P.pack_u64([0, 64]), sizes=P.pack_u64([8, 8]),
                           addrs=P.pack_u64([one.ctypes.data]))
        msg = await _raw(c, req)
        assert msg["error"]["code"] == "BAD_REQUEST" and "addresses" in msg["error"]["message"]
        # addresses on a session that is not same-host
        msg = await _raw(net, P.Store(buffer_id=bid, offset=0, nbytes=8, addr=one.ctypes.data))
        assert msg["error"]["details"]["reason"] == "not_same_host"
        # out of range is checked before any copy
        msg = await _raw(c, P.Store(buffer_id=bid, offset=(1 << 20) - 4, nbytes=8,
                                    addr=one.ctypes.data))
        assert msg["error"]["code"] == "OUT_OF_RANGE"
        assert (await c.read_buffer(bid) == 9).all()  # nothing landed anywhere
        assert await c.ping() and await net.ping()
        await c.release_buffer(bid)
    assert await wait_free(daemon, start) == start


async def test_arrays_stay_referenced_until_the_daemon_answers(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A caller that gives up (TIMEOUT) must not free the array the daemon
    will still copy into: the context keeps it until the answer arrives."""
    d = daemon_factory("--device", "cpu:4MiB", "--transfer-timeout", "1s")
    async with d.connect(same_host=False) as net, rpcbuf.connect(
            d.addr, token=d.token(), timeout=0.3) as fast:
        assert fast.same_host
        bid = await fast.request_buffer(1 << 20, name="held")
        await fast.clear_buffer(bid, 5)
        # a UCX store that never sends its payload holds the range for ~1 s
        stalled = net._conn.submit(net._conn.next_id(),
                                   P.Store(buffer_id=bid, offset=0, nbytes=1 << 20))
        await asyncio.sleep(0.2)
        out = np.zeros(4096, np.uint8)
        ref = weakref.ref(out)
        with pytest.raises(rpcbuf.Timeout):
            await fast.read_buffer(bid, 0, out=out)  # queued behind the stalled store
        del out
        gc.collect()
        assert ref() is not None and fast._conn._held  # the daemon may still write into it
        with pytest.raises(rpcbuf.ConnectionLost):
            await asyncio.wait_for(stalled, 10)
        for _ in range(300):  # the read runs once the lock frees, then answers
            if not fast._conn._held:
                break
            await asyncio.sleep(0.01)
        assert not fast._conn._held
        gc.collect()
        assert ref() is None  # and only then is it let go
        await fast.release_buffer(bid)


async def test_pipelined_copies_keep_their_order(daemon: DaemonProc) -> None:
    """A small same-host store that arrives right behind a big one on the same
    range (both frames in one write, so one read) must not overtake it: the
    big one runs as a task, the small one could be done on the spot."""
    async with daemon.connect() as c:
        assert c.same_host
        bid = await c.request_buffer(8 << 20)
        big, small = np.full(6 << 20, 1, np.uint8), np.full(4096, 2, np.uint8)
        conn = c._conn
        for _ in range(5):
            futs, frames = [], b""
            for a in (big, small):
                req_id = conn.next_id()
                req = P.Store(buffer_id=bid, offset=0, nbytes=a.nbytes, addr=a.ctypes.data)
                frames += P.encode_frame(req.to_wire(req_id))
                fut = asyncio.get_running_loop().create_future()
                conn._pending[req_id] = fut
                futs.append(fut)
            conn._transport.write(frames)
            for fut in futs:
                assert (await asyncio.wait_for(fut, 10))["ok"]
            assert (await c.read_buffer(bid, 0, 4096) == 2).all()  # the later one wins
        await c.release_buffer(bid)


def test_short_probe_is_refused() -> None:
    peer = cma.Peer(os.getpid())
    try:
        assert peer.probe(0, b"") is not None
        secret = np.frombuffer(os.urandom(cma.PROBE_BYTES), np.uint8).copy()
        assert peer.probe(secret.ctypes.data, secret.tobytes()) is None
    finally:
        peer.close()


async def test_partly_mapped_range_is_a_bad_request(daemon: DaemonProc) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    region = mmap.mmap(-1, 2 * mmap.PAGESIZE)
    base = np.frombuffer(region, dtype=np.uint8)
    addr = base.ctypes.data
    assert libc.mprotect(addr + mmap.PAGESIZE, mmap.PAGESIZE, 0) == 0  # PROT_NONE
    async with daemon.connect() as c:
        bid = await c.request_buffer(2 * mmap.PAGESIZE)
        for req in (P.Store(buffer_id=bid, offset=0, nbytes=2 * mmap.PAGESIZE, addr=addr),
                    P.Read(buffer_id=bid, offset=0, nbytes=2 * mmap.PAGESIZE, addr=addr)):
            msg = await _raw(c, req)
            assert msg["error"]["details"]["reason"] == "bad_address"
        assert await c.ping()  # the session goes on
        await c.release_buffer(bid)
    libc.mprotect(addr + mmap.PAGESIZE, mmap.PAGESIZE, mmap.PROT_READ | mmap.PROT_WRITE)
    del base
    region.close()


async def test_client_killed_mid_copy_frees_its_memory(daemon: DaemonProc) -> None:
    """A same-host client SIGKILLed while the daemon copies its 256 MiB: the
    copy fails (the process is gone), the session closes, memory comes back."""
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
    req = P.Store(buffer_id="b", offset=0, nbytes=8, addr=1 << 47)
    got = P.parse_request(req.to_wire(5))
    assert got == (5, req)
    with pytest.raises(P.RequestError):
        P.parse_request({**req.to_wire(5), "addr": -1})
    batch = dataclasses.replace(P.StoreBatch(buffer_id="b", offsets=P.pack_u64([0]),
                                             sizes=P.pack_u64([8])), addrs=b"\x00" * 7)
    with pytest.raises(P.RequestError):
        P.parse_request(batch.to_wire(6))


async def test_small_copy_waits_for_a_busy_range(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A small same-host store is done on the spot only when its range is
    free: here a UCX store holds the range (announced, payload never sent)
    and the same-host store waits until that one ends (deadline: aborted)."""
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
        back = await fast.read_buffer(bid, 4096, 4096)
        assert (back == 3).all()
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
    """After fork a same-host context would make the daemon copy the parent's
    bytes at the child's addresses: refused instead."""
    async with daemon.connect() as c:
        bid = await c.request_buffer(64)
        real = os.getpid()
        monkeypatch.setattr(os, "getpid", lambda: real + 1)  # as seen in a forked child
        with pytest.raises(rpcbuf.ConnectionLost, match="another process"):
            await c.store_tensor(bid, np.ones(64, np.uint8))
        monkeypatch.undo()
        await c.release_buffer(bid)


async def test_no_copy_into_a_client_that_went_away(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A same-host read queued behind a range lock must not copy once its
    client has closed the connection (the client lets go of its arrays).
    With one request in flight allowed, the session's reader is parked and
    does not see the close before the read gets its lock."""
    d = daemon_factory("--device", "cpu:4MiB", "--transfer-timeout", "1s", "--max-inflight", "1")
    async with d.connect(same_host=False) as net:
        fast = await d.connect()
        assert fast.same_host
        bid = await fast.request_buffer(1 << 20, name="gone")
        await fast.clear_buffer(bid, 5)
        stalled = net._conn.submit(net._conn.next_id(),
                                   P.Store(buffer_id=bid, offset=0, nbytes=1 << 20))
        await asyncio.sleep(0.2)  # the stalled store holds the range for ~1 s
        out = np.zeros(4096, np.uint8)  # kept alive here, to see whether it gets written
        fast._conn.submit(fast._conn.next_id(), P.Read(buffer_id=bid, offset=0, nbytes=4096,
                                                        addr=out.ctypes.data))
        await asyncio.sleep(0.1)
        fast.abort()  # the client goes away while its read waits for the lock
        with pytest.raises(rpcbuf.ConnectionLost):
            await asyncio.wait_for(stalled, 10)
        await asyncio.sleep(0.5)
        assert not out.any()  # never written
    async with d.connect() as c:  # (the stalled session was aborted at its deadline)
        await c.release_buffer(await c.open_buffer("gone"))


# -- who the daemon may copy into ----------------------------------------------------------


@pytest.mark.skipif(not privileged(), reason="needs root or CAP_SYS_PTRACE (as in CI)")
async def test_a_privileged_daemon_refuses_the_same_host_path(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A daemon that is root or holds CAP_SYS_PTRACE could be made to write
    into any process (a client that execs a setuid program after its probe):
    without --unsafe-privileged-same-host it refuses the path and says why,
    and the client works on over UCX."""
    sock = "@rpcbufd-test-" + os.urandom(4).hex()
    d = daemon_factory("--device", "cpu:4MiB", "--local-socket", sock,
                       privileged_same_host=False)
    async with d.connect() as c:
        assert not c.same_host
        assert "CAP_SYS_PTRACE" in c.hello["same_host_why"]
        bid = await c.request_buffer(4096)
        await c.store_tensor(bid, np.full(4096, 9, np.uint8), verify="checksum")
        assert (await c.read_buffer(bid) == 9).all()
        await c.release_buffer(bid)
    async with rpcbuf.connect(f"unix:{sock}", token=d.token()) as c:  # directly: refused too
        assert not c.same_host and "CAP_SYS_PTRACE" in c.hello["same_host_why"]
        assert await c.ping()
    with pytest.raises(rpcbuf.BadRequest, match="CAP_SYS_PTRACE"):
        await d.connect(same_host=True)
    assert d.stop() == 0
    assert "unsafe-privileged-same-host" not in d.log()


def test_privilege_is_read_from_the_effective_capabilities() -> None:
    root = "Name:\tx\nCapEff:\t0000000000000000\n"
    assert cma.privileged_why(root, euid=0) is not None
    assert cma.privileged_why("CapEff:\t0000000000080000\n", euid=1000) is not None  # bit 19
    assert cma.privileged_why("CapEff:\t0000000000001000\n", euid=1000) is None  # not ptrace
    assert cma.privileged_why("", euid=1000) is not None  # unreadable: assume the worst


def test_the_peer_is_the_process_that_connected() -> None:
    """The pidfd is taken from the socket at accept (SO_PEERPIDFD, else
    pidfd_open of SO_PEERCRED's pid there and then): a Peer built from it
    follows that process, and stops being alive when it exits, whatever
    later holds the socket or gets the pid."""
    import socket

    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind("\0rpcbuf-test-peer-" + os.urandom(4).hex())
    srv.listen(1)
    child = subprocess.Popen([sys.executable, "-c",
                              "import socket, sys, time\n"
                              "s = socket.socket(socket.AF_UNIX)\n"
                              f"s.connect({srv.getsockname()!r})\n"
                              "sys.stdin.read()\n"], stdin=subprocess.PIPE)
    conn, _ = srv.accept()
    peer = cma.Peer.of_socket(conn)
    try:
        assert peer.pid == child.pid and peer.alive()
        assert child.stdin is not None
        child.stdin.close()
        child.wait()
        assert not peer.alive()
    finally:
        peer.close()
        conn.close()
        srv.close()
