"""Zero-copy read-only attach (``ctx.attach``): a local reader maps one
buffer's own memfd, read-only; stores into an attached buffer are BUSY;
release is deferred until the last detach; a killed reader detaches; many
readers share one copy of the pages.  Real daemons, real processes."""

from __future__ import annotations

import asyncio
import gc
import mmap
import os
import pwd
import subprocess
import sys
import time

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc, pool_free, wait_free
from rpcbuf.control.client.handles import check_read_only
from rpcbuf.control.wire import protocol as P
from rpcbuf.dataplane import shm

READER = """
import asyncio, os, sys, numpy as np, rpcbuf
rpcbuf.connect  # the public names load on first use: load the client now
if len(sys.argv) > 4:  # become another user once everything is imported (as root)
    os.setgid(int(sys.argv[5])); os.setuid(int(sys.argv[4]))
    assert os.getuid() == int(sys.argv[4])
async def main():
    async with rpcbuf.connect(sys.argv[1], token=sys.argv[2]) as c:
        assert c.same_host, c.hello.get("same_host_why")
        async with c.attach(await c.open_buffer(sys.argv[3])) as view:
            a = view.array()
            total = int(a[::4096].astype(np.uint64).sum())  # touch every page
            smaps = open("/proc/self/smaps").read().split("\\n")
            at = next(i for i, l in enumerate(smaps) if "rpcbuf-buffer" in l)
            fields = dict(l.split(":", 1) for l in smaps[at + 1:at + 20] if ":" in l)
            private = int(fields["Private_Dirty"].split()[0]) + int(
                fields["Private_Clean"].split()[0])
            print("attached", total, int(a[0]), private, flush=True)
            sys.stdin.readline()
asyncio.run(main())
"""


def _reader(d: DaemonProc, name: str, tenant: str = "alice",
            user: str | None = None) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": "src", "UCX_WARN_UNUSED_ENV_VARS": "n"}
    ids: list[str] = []
    if user is not None:  # this interpreter may live where that user cannot read
        pw = pwd.getpwnam(user)
        env["HOME"] = "/tmp"
        ids = [str(pw.pw_uid), str(pw.pw_gid)]
    return subprocess.Popen([sys.executable, "-c", READER, d.addr, d.token(tenant), name, *ids],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _ready(p: subprocess.Popen[str], timeout: float = 60) -> list[int]:
    assert p.stdout is not None
    deadline = time.monotonic() + timeout
    line = p.stdout.readline()
    if not line.startswith("attached") or time.monotonic() > deadline:
        p.kill()
        raise AssertionError(f"reader failed: {line!r} {p.stderr.read() if p.stderr else ''}")
    return [int(x) for x in line.split()[1:]]


async def test_attach_maps_the_stored_bytes_read_only(clean_pool: DaemonProc) -> None:
    async with clean_pool.connect() as c:
        assert c.same_host
        bid = await c.request_buffer(3 << 20)
        w = np.arange(1 << 18, dtype=np.float32)
        b = np.full((64, 64), 7, np.int16)
        await c.store_tensors(bid, {"w": w, "b": b})
        async with c.attach(bid) as view:
            ts = view.tensors()
            assert set(ts) == {"w", "b"}
            assert np.array_equal(ts["w"], w) and ts["w"].dtype == np.float32
            assert ts["b"].shape == (64, 64) and (ts["b"] == 7).all()
            for a in (ts["w"], view.array(), view.array(100, 10)):
                assert not a.flags.writeable
                with pytest.raises(ValueError):
                    a.setflags(write=True)  # not even NumPy can make it writable
            assert view.array(100, 10).tobytes() == w.view(np.uint8)[100:110].tobytes()
            with pytest.raises(rpcbuf.BadRequest):
                view.array(3 << 20, 1)
            # one mapping of the buffer's own memfd, exactly its size (ours: an
            # earlier test's attachment may still be mapped in this process)
            line = next(x for x in open("/proc/self/maps").read().splitlines()
                        if "memfd:rpcbuf-buffer" in x
                        and int(x.split("-")[0], 16) == view.address)
            lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
            block = (await c.get_buffer_meta(bid, tensors=False))["alloc_size"]
            assert lo == view.address and hi - lo == block and line.split()[1] == "r--s"
            del ts
        assert view.closed
        with pytest.raises(rpcbuf.BadRequest, match="closed"):
            view.tensors()
        await c.release_buffer(bid)


async def test_the_handle_cannot_be_made_writable(clean_pool: DaemonProc) -> None:
    """The fd that leaves the daemon: exactly the buffer's block, opened
    read-only, sealed: a writable mapping, mprotect to writable and write()
    all fail."""
    async with clean_pool.connect() as c:
        bid = await c.request_buffer(10_000)  # not whole pages: the block is
        await c.clear_buffer(bid, 3)
        req_id = c._conn.next_id()
        msg = await c._conn.submit(req_id, P.Attach(buffer_id=bid))
        block = msg["result"]["alloc_size"]
        assert msg["ok"] and block % mmap.PAGESIZE == 0 and 10_000 <= block
        nbytes, fd = await c._handles.fd_for(req_id, 10)
        try:
            assert nbytes == os.fstat(fd).st_size == block
            check_read_only(fd, block)
            with pytest.raises(PermissionError):
                mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            with pytest.raises(OSError):
                os.write(fd, b"x")
            with pytest.raises(OSError):
                os.ftruncate(fd, 0)
            try:  # a new open for writing may be had, but the seals hold for it too
                rw = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)
            except OSError:
                rw = None
            if rw is not None:
                try:
                    with pytest.raises(PermissionError):
                        os.write(rw, b"x")
                    with pytest.raises(PermissionError):
                        os.ftruncate(rw, 0)
                    with pytest.raises(PermissionError):
                        mmap.mmap(rw, nbytes, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(rw)
            ro = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
            addr = np.frombuffer(ro, np.uint8).ctypes.data
            libc = shm._libc
            assert libc.mprotect(shm.ctypes.c_void_p(addr), nbytes,
                                 mmap.PROT_READ | mmap.PROT_WRITE) != 0
            assert shm.ctypes.get_errno() == 13  # EACCES
            assert ro[:10_000] == b"\x03" * 10_000
            ro.close()
        finally:
            os.close(fd)
        await c._call(P.Detach(buffer_id=bid))
        await c.release_buffer(bid)


async def test_writes_into_an_attached_buffer_are_busy(clean_pool: DaemonProc) -> None:
    async with clean_pool.connect() as c, clean_pool.connect(same_host=False) as net:
        bid = await c.request_buffer(1 << 20)
        other = await c.request_buffer(1 << 20)
        await c.clear_buffer(bid, 1)
        async with c.attach(bid):
            for write in (c.store_tensor(bid, np.zeros(10, np.uint8)),
                          c.store_tensor(bid, np.zeros(1 << 20, np.uint8)),
                          net.store_tensor(bid, np.zeros(10, np.uint8)),
                          c.store_tensors(bid, {"x": np.zeros(4, np.float32)}),
                          c.clear_buffer(bid),
                          c.copy_buffer(other, 0, bid, 0, 100)):
                with pytest.raises(rpcbuf.Busy) as err:
                    await write
                assert err.value.details["attached"] == 1
            assert (await c.read_buffer(bid, 0, 100) == 1).all()  # reads go on
            await c.copy_buffer(bid, 0, other, 0, 100)  # and so do copies out of it
        await c.store_tensor(bid, np.zeros(10, np.uint8))  # detached: writable again
        await c.release_buffer(bid)
        await c.release_buffer(other)


async def test_release_and_lease_expiry_wait_for_the_last_detach(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:8MiB")
    start = await pool_free(d)
    async with d.connect() as c:
        bid = await c.request_buffer(1 << 20)
        leased = await c.request_buffer(1 << 20, ttl=1.0)
        await c.clear_buffer(bid, 5)
        await c.clear_buffer(leased, 6)
        view, lview = await c.attach(bid), await c.attach(leased)
        await c.release_buffer(bid)
        with pytest.raises(rpcbuf.NotFound):
            await c.get_buffer_meta(bid)  # gone from every view at once ...
        await asyncio.sleep(1.5)  # ... the lease ran out too
        with pytest.raises(rpcbuf.NotFound):
            await c.get_buffer_meta(leased)
        assert await pool_free(d) == start - (2 << 20)  # ... but both still held
        assert (view.array() == 5).all() and (lview.array() == 6).all()
        await view.close()
        assert await wait_free(d, start - (1 << 20)) == start - (1 << 20)
        await lview.close()
        assert await wait_free(d, start) == start


async def test_arrays_keep_their_attachment_after_close(clean_pool: DaemonProc) -> None:
    """A closed view never becomes a segfault: an array still alive keeps
    the mapping and the attachment (so its bytes never change); the detach
    goes when the last array is gone."""
    async with clean_pool.connect() as c:
        bid = await c.request_buffer(1 << 16)
        await c.clear_buffer(bid, 9)
        async with c.attach(bid) as view:
            kept = view.array(0, 100)
        assert view.closed
        with pytest.raises(rpcbuf.Busy):
            await c.clear_buffer(bid, 1)  # still attached: ``kept`` lives
        assert (kept == 9).all()
        del kept
        gc.collect()
        for _ in range(100):
            try:
                await c.clear_buffer(bid, 1)
                break
            except rpcbuf.Busy:
                await asyncio.sleep(0.02)
        assert (await c.read_buffer(bid, 0, 100) == 1).all()
        await c.release_buffer(bid)


async def test_only_the_tenant_attaches_and_only_on_the_same_host(
        clean_pool: DaemonProc) -> None:
    async with clean_pool.connect("alice") as a, clean_pool.connect("bob") as b, \
            clean_pool.connect("alice", same_host=False) as net:
        bid = await a.request_buffer(4096)
        with pytest.raises(rpcbuf.NotFound):
            await b.attach(bid)
        with pytest.raises(rpcbuf.BadRequest, match="same-host"):
            await net.attach(bid)
        msg = await net._conn.submit(net._conn.next_id(), P.Attach(buffer_id=bid))
        assert msg["error"]["details"]["reason"] == "not_same_host"  # the daemon says so too
        with pytest.raises(rpcbuf.NotFound):
            await a.attach("b-" + "x" * 24)
        with pytest.raises(rpcbuf.NotFound):
            await a._call(P.Detach(buffer_id=bid))  # never attached
        await a.store_tensor(bid, np.ones(10, np.uint8))  # no attachment was left behind
        await a.release_buffer(bid)


async def test_another_process_attaches_what_this_one_stored(clean_pool: DaemonProc) -> None:
    async with clean_pool.connect() as c:
        bid = await c.request_buffer(8 << 20, name="shared-weights")
        await c.store_tensor(bid, np.full(8 << 20, 42, np.uint8))
        reader = _reader(clean_pool, "shared-weights")
        try:
            total, first, private_kb = _ready(reader)
            assert first == 42 and total == 42 * (8 << 20) // 4096
            assert private_kb == 0  # the daemon's pages, not a copy
            with pytest.raises(rpcbuf.Busy):
                await c.store_tensor(bid, np.zeros(8, np.uint8))
        finally:
            reader.kill()
            reader.wait()
        for _ in range(200):  # the killed reader's session ends: its attachment with it
            try:
                await c.store_tensor(bid, np.zeros(8, np.uint8))
                break
            except rpcbuf.Busy:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("a killed reader kept its attachment")
        await c.release_buffer(bid)


def _used_kib() -> int:
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    return int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])


async def test_eight_readers_share_one_copy_of_a_gib(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:1100MiB")
    async with d.connect() as c:
        bid = await c.request_buffer(1 << 30, name="gib")
        await c.store_tensor(bid, np.full(1 << 30, 1, np.uint8))
        before = _used_kib()
        readers = [_reader(d, "gib") for _ in range(8)]
        try:
            got = [_ready(r, 120) for r in readers]
            grown = _used_kib() - before
            assert all(g[0] == (1 << 30) // 4096 and g[2] == 0 for g in got)
            # Eight Python processes cost their interpreters (~30-60 MiB
            # each), not 8 GiB: the pages are the daemon's, mapped eight times.
            assert grown < 600 * 1024, f"used memory grew by {grown / 1024:.0f} MiB"
        finally:
            for r in readers:
                r.kill()
                r.wait()
        await c.release_buffer(bid)


@pytest.mark.skipif(os.geteuid() != 0, reason="a second uid needs root (as in CI)")
async def test_a_client_of_another_user_can_attach(clean_pool: DaemonProc) -> None:
    """No ptrace, no shared uid: a process of another user (nobody) gets the
    same-host path and attaches what this one stored."""
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no 'nobody' user here")
    async with clean_pool.connect() as c:
        bid = await c.request_buffer(1 << 20, name="for-nobody")
        await c.clear_buffer(bid, 17)
        reader = _reader(clean_pool, "for-nobody", user="nobody")
        try:
            _, first, private_kb = _ready(reader)
            assert first == 17 and private_kb == 0
        finally:
            reader.kill()
            reader.wait()
        await c.release_buffer(bid)
