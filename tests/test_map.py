"""Writing in place (``ctx.map``, and the verbs' own grants): a same-host
client maps its own buffers writable and copies into and out of them with
no round trip (``daemon/ops/mapops.py``, ``client/mapped.py``,
docs/dataplane.md "Writing in place").  Each rule of the design has a test
here: isolation, release and reuse, readers, verification, the content
index, audit and metrics, a crash of the mapping process.  Real daemons,
real processes, real shared memory."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc, metrics_url, pool_gauge, wait_free
from rpcbuf.control.daemon.ops.mapops import GRANT_PAGE_BYTES
from rpcbuf.control.wire import protocol as P
from rpcbuf.dataplane import shm

MiB = 1 << 20
PAGE = GRANT_PAGE_BYTES  # a session's grant page, charged once it maps


@pytest.fixture(autouse=True)
def _same_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the same-host path: a RPCBUF_SAME_HOST=0 run of
    the suite must not turn it off here."""
    monkeypatch.delenv("RPCBUF_SAME_HOST", raising=False)
    monkeypatch.delenv("RPCBUF_IN_PLACE", raising=False)


@pytest.fixture
def d(daemon_factory) -> DaemonProc:  # type: ignore[no-untyped-def]
    return daemon_factory("--device", "cpu:64MiB", "--metrics", "127.0.0.1:0")


def _gauge(d: DaemonProc, name: str) -> int:
    with urllib.request.urlopen(metrics_url(d), timeout=10) as res:
        text = res.read().decode()
    found = re.search(rf"^{name} (\S+)$", text, re.M)
    assert found, text
    return int(float(found.group(1)))


async def _settles(read: Any, want: int, timeout: float = 10.0) -> bool:
    """Whether ``read()`` (maybe a coroutine) comes to ``want`` within ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if asyncio.iscoroutine(got):
            got = await got
        if got == want or time.monotonic() > deadline:
            return bool(got == want)
        await asyncio.sleep(0.05)


def _charged(st: dict) -> int:
    return int(st["bytes"].get("cpu:0", 0))


async def test_the_verbs_go_in_place_with_no_round_trip(d: DaemonProc) -> None:
    async with d.connect() as c:
        assert c.same_host
        bid = await c.request_buffer(MiB)
        a = np.random.default_rng(1).integers(0, 255, MiB, dtype=np.uint8)
        await c.store_tensor(bid, a)  # asks for the grant once
        sent = c._conn.next_id()
        for i in range(20):
            await c.store_tensor(bid, a[i * 4096:(i + 1) * 4096], offset=i * 4096)
            got = await c.read_buffer(bid, i * 4096, 4096)
            np.testing.assert_array_equal(got, a[i * 4096:(i + 1) * 4096])
        assert c._conn.next_id() == sent + 1  # not one request went out meanwhile
        counts = c.in_place_counts()
        assert counts["stores"] == 21 and counts["reads"] == 20 and counts["grants"] == 1
        assert counts["bytes_stored"] == MiB + 20 * 4096
        # The daemon holds what was written: another session reads it its way.
        async with d.connect() as other:
            np.testing.assert_array_equal(await other.read_buffer(bid), a)
        # Out of range and batch-less errors are still the daemon's.
        with pytest.raises(rpcbuf.OutOfRange):
            await c.store_tensor(bid, a, offset=4096)
        with pytest.raises(rpcbuf.NotFound):
            await c.store_tensor("b-nope", a[:16])
    log = d.log()
    assert "op=map tenant=alice" in log and "writable implicit" in log


async def test_the_ucx_path_and_the_switch_leave_it_off(d: DaemonProc,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    for env, value in (("RPCBUF_SAME_HOST", "0"), ("RPCBUF_IN_PLACE", "0")):
        monkeypatch.setenv(env, value)
        async with d.connect() as c:
            bid = await c.request_buffer(4096)
            await c.store_tensor(bid, np.ones(4096, np.uint8))
            assert (await c.read_buffer(bid) == 1).all()
            assert c.in_place_counts()["stores"] == 0
            if env == "RPCBUF_SAME_HOST":
                with pytest.raises(rpcbuf.BadRequest, match="same-host"):
                    async with c.map(bid):
                        pass
        monkeypatch.delenv(env)


async def test_only_the_owning_tenant_maps_and_only_its_own_buffers(d: DaemonProc) -> None:
    async with d.connect("alice") as a, d.connect("bob") as b:
        mine = await a.request_buffer(4096)
        await a.store_tensor(mine, np.full(4096, 3, np.uint8))
        with pytest.raises(rpcbuf.NotFound):
            async with b.map(mine):
                pass
        with pytest.raises(rpcbuf.NotFound):
            await b._caller.call(P.MapBuffer(buffer_id=mine))
        with pytest.raises(rpcbuf.NotFound):  # nor through the verbs
            await b.store_tensor(mine, np.zeros(16, np.uint8))
        assert b.in_place_counts()["stores"] == 0
        assert (await a.read_buffer(mine) == 3).all()


async def test_a_mapped_array_writes_the_buffer_and_other_sessions_wait(d: DaemonProc) -> None:
    async with d.connect() as c, d.connect() as other:
        bid = await c.request_buffer(2 * MiB)
        async with c.map(bid) as m:
            assert m.array.nbytes == 2 * MiB and m.array.flags.writeable
            m.array[:] = 7
            assert _gauge(d, "rpcbuf_buffers_mapped_writable") == 1
            for op in (other.read_buffer(bid, 0, 16),
                       other.store_tensor(bid, np.ones(16, np.uint8)),
                       other.attach(bid).__aenter__()):
                with pytest.raises(rpcbuf.Busy) as info:
                    await op
                assert info.value.details["reason"] == "mapped"
            with pytest.raises(rpcbuf.Busy):  # its own attach too: the array would go stale
                await c.attach(bid)
            assert (await c.read_buffer(bid, 0, 16) == 7).all()  # its own reads go on
        assert _gauge(d, "rpcbuf_buffers_mapped_writable") == 0
        assert (await other.read_buffer(bid) == 7).all()
        async with other.attach(bid) as view:  # a sealed copy: read-only for good
            assert (view.array() == 7).all()
            await asyncio.sleep(0)
        log = d.log()
        assert "op=map" in log and "writable explicit" in log and "op=unmap" in log


async def test_an_implicit_grant_is_taken_back_for_other_readers(d: DaemonProc) -> None:
    async with d.connect() as c, d.connect() as other:
        bid = await c.request_buffer(MiB)
        await c.store_tensor(bid, np.full(MiB, 1, np.uint8))
        assert (await other.read_buffer(bid) == 1).all()  # revoked, then read
        await c.store_tensor(bid, np.full(MiB, 2, np.uint8))  # granted again
        assert c.in_place_counts()["grants"] == 2
        async with other.attach(bid) as view:  # revoked and sealed
            assert (view.array() == 2).all()
            with pytest.raises(rpcbuf.Busy):  # attached: no writer, in place or not
                await c.store_tensor(bid, np.full(MiB, 3, np.uint8))
            assert (view.array() == 2).all()
        await c.store_tensor(bid, np.full(MiB, 4, np.uint8))  # a fresh writable memfd
        assert (await other.read_buffer(bid) == 4).all()
        assert "op=unmap" in d.log() and "(revoked)" in d.log()


async def test_a_take_back_waits_for_the_copy_in_flight_then_is_busy(d: DaemonProc) -> None:
    async with d.connect() as c, d.connect() as other:
        bid = await c.request_buffer(4096)
        await c.store_tensor(bid, np.full(4096, 5, np.uint8))
        own = c._own
        assert own is not None and own._page is not None
        slot, gen = own._maps[bid].slot, own._maps[bid].gen
        assert own._page.enter(slot, gen)  # a copy of ours "in flight"
        t0 = time.monotonic()
        with pytest.raises(rpcbuf.Busy):
            await other.read_buffer(bid, 0, 16)
        assert time.monotonic() - t0 >= 0.9  # it waited for the copy, bounded
        own._page.give(slot)
        assert (await other.read_buffer(bid, 0, 16) == 5).all()
        assert not own._page.enter(slot, gen)  # taken back: our next copy asks again
        await c.store_tensor(bid, np.full(4096, 6, np.uint8))
        assert (await other.read_buffer(bid, 0, 16) == 6).all()


async def test_writes_after_release_never_reach_a_reused_buffer(d: DaemonProc) -> None:
    async with d.connect() as c, d.connect("bob") as other:
        before = _charged(await c.stats())
        bid = await c.request_buffer(4 * MiB)
        m = await c.map(bid)
        m.array[:] = 9
        await c.release_buffer(bid)
        # Its block goes back to the pool; the next buffer may take the very
        # same block (it does here: an empty arena, the same size).
        new = await other.request_buffer(4 * MiB)
        for _ in range(3):
            m.array[:] = 0xEE  # the old mapping still writes: its own pages only
        assert (await other.read_buffer(new) == 0).all()
        # The pages the mapping keeps stay charged to alice until her session
        # ends, as does the session's grant page.
        assert _charged(await c.stats()) == before + 4 * MiB + PAGE
        with pytest.raises(rpcbuf.NotFound):  # the verbs see it gone
            await c.store_tensor(bid, np.zeros(16, np.uint8))
        await m.close()
    async with d.connect() as c:
        assert _charged(await c.stats()) == before


async def test_a_release_by_another_session_ends_the_grant(d: DaemonProc) -> None:
    async with d.connect() as c, d.connect() as other:
        bid = await c.request_buffer(4096, name="shared-one")
        await c.store_tensor(bid, np.ones(4096, np.uint8))
        await other.release_buffer(bid)
        with pytest.raises(rpcbuf.NotFound):
            await c.store_tensor(bid, np.zeros(4096, np.uint8))
        with pytest.raises(rpcbuf.NotFound):
            await c.read_buffer(bid, 0, 16)


async def test_verification_hashes_what_is_in_the_daemons_memory(d: DaemonProc) -> None:
    async with d.connect() as c:
        bid = await c.request_buffer(MiB)
        a = np.arange(MiB // 4, dtype=np.float32)
        await c.store_tensors(bid, {"w": a})
        async with c.map(bid) as m:
            assert await c.verify_write(bid, 0, a)
            m.array[:4] = 0xFF  # behind the manifest's back
            with pytest.raises(rpcbuf.VerifyFailed):
                await c.verify_write(bid, 0, a)
        with pytest.raises(rpcbuf.VerifyFailed):  # the manifest's checksum no longer holds
            await c.load_tensors(bid, verify=True)
        # A checked store goes the daemon's way and is checked there.
        await c.store_tensor(bid, a, verify="checksum")
        assert np.array_equal((await c.load_tensors(bid, verify=True))["w"], a)


async def test_a_mapped_buffer_drops_out_of_dedup(d: DaemonProc) -> None:
    w = np.random.default_rng(2).standard_normal(256 * 1024).astype(np.float32)
    async with d.connect() as c:
        src = await c.request_buffer(2 * MiB)
        await c.store_tensors_dedup(src, {"w": w})
        dst = await c.request_buffer(2 * MiB)
        got = await c.store_tensors_dedup(dst, {"w": w})
        assert got["placed"] == 1 and got["sent"] == 0  # found in src
        await c.release_buffer(dst)
        async with c.map(src) as m:
            m.array[:8] = 0  # src's bytes are no longer what the index said
            dst = await c.request_buffer(2 * MiB)
            got = await c.store_tensors_dedup(dst, {"w": w})
            assert got["placed"] == 0 and got["sent"] == 1
            np.testing.assert_array_equal((await c.load_tensors(dst))["w"], w)


async def test_a_clone_never_shares_memory_its_owner_writes(d: DaemonProc) -> None:
    async with d.connect() as c:
        src = await c.request_buffer(MiB)
        await c.store_tensor(src, np.full(MiB, 1, np.uint8))  # in place: a writable memfd
        async with c.map(src):
            with pytest.raises(rpcbuf.Busy):
                await c.clone_buffer(src)
        clone = await c.clone_buffer(src)
        await c.store_tensor(src, np.full(MiB, 2, np.uint8))  # in place again
        assert (await c.read_buffer(clone) == 1).all()
        assert (await c.read_buffer(src) == 2).all()


CRASHER = """
import asyncio, os, sys, numpy as np, rpcbuf
async def main():
    c = await rpcbuf.connect(sys.argv[1], token=sys.argv[2])
    bid = await c.request_buffer(8 << 20, name="crash-me")
    m = await c.map(bid)
    m.array[:] = 4
    print("mapped", bid, flush=True)
    while True:
        m.array[:] = 4
        await asyncio.sleep(0.01)
asyncio.run(main())
"""


async def test_a_killed_mapping_process_leaks_nothing(d: DaemonProc) -> None:
    async with d.connect() as c:
        before = _charged(await c.stats())
        free = sum(int(x["free"]) for x in await c.list_devices())
    env = {**os.environ, "PYTHONPATH": "src"}
    p = subprocess.Popen([sys.executable, "-c", CRASHER, d.addr, d.token()],
                         stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None
        line = p.stdout.readline()
        assert line.startswith("mapped"), line
        bid = line.split()[1]
        assert _gauge(d, "rpcbuf_buffers_mapped_writable") == 1
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert await _settles(lambda: _gauge(d, "rpcbuf_buffers_mapped_writable"), 0)
    async with d.connect() as c:
        assert _charged(await c.stats()) == before + 8 * MiB  # only the buffer itself
        assert (await c.read_buffer(bid, 0, 16) == 4).all()  # a named buffer outlives it
        assert c.in_place_counts()["grants"] == 0  # a read asks for no grant
        await c.release_buffer(bid)
        async def charged() -> int:  # the last session's close may still be running
            return _charged(await c.stats())
        assert await _settles(charged, before)
    assert await wait_free(d, free) == free
    assert "(session closed)" in d.log()


async def test_bad_map_requests_are_refused(d: DaemonProc) -> None:
    async with d.connect() as c:
        for bad in (7, None, "x" * 5000):
            with pytest.raises(rpcbuf.BadRequest):
                await c._caller.call(P.MapBuffer(buffer_id=bad))  # type: ignore[arg-type]
        with pytest.raises(rpcbuf.NotFound):
            await c._caller.call(P.UnmapBuffer(buffer_id="b-never"))


def test_a_grant_page_slot_is_a_lock_and_a_state() -> None:
    from rpcbuf.dataplane.grants import ENDED, LIVE, REVOKED, GrantPage

    page = GrantPage.create(8)
    fd = shm.writable_fd(page.fd)
    theirs = GrantPage.open(fd, page.size)
    try:
        gen = page.grant(3)
        assert theirs.state(3) == LIVE and not theirs.enter(3, gen + 1)
        assert theirs.enter(3, gen)
        assert not page.take(3)  # held by "the client"
        theirs.give(3)
        page.set_state(3, REVOKED)
        assert not theirs.enter(3, gen) and page.take(3)
        page.give(3)
        again = page.grant(3)  # granted again (another buffer): the old grant never passes
        assert again == gen + 1 and not theirs.enter(3, gen) and theirs.enter(3, again)
        theirs.give(3)
        page.set_state(3, ENDED)
        assert not theirs.enter(3, again)
        assert page.slots == shm.PAGE // 64  # a page at least
        with pytest.raises(IndexError):
            page.take(page.slots)
    finally:
        theirs.close()
        page.close()


async def test_batches_go_in_place_and_keep_their_refusals(d: DaemonProc) -> None:
    async with d.connect() as c:
        bid = await c.request_buffer(MiB)
        items = [(i * 8192, np.full(4096, i, np.uint8)) for i in range(16)][::-1]
        got = await c.store_batch(bid, items)
        assert got["nbytes"] == 16 * 4096 and got["items"] == 16
        parts = await c.read_batch(bid, [(i * 8192, 4096) for i in range(16)])
        assert [int(p[0]) for p in parts] == list(range(16))
        counts = c.in_place_counts()
        assert counts["stores"] == 1 and counts["reads"] == 1
        with pytest.raises(rpcbuf.BadRequest):  # overlapping: the daemon says no, as ever
            await c.store_batch(bid, [(0, np.ones(8, np.uint8)), (4, np.ones(8, np.uint8))])
        with pytest.raises(rpcbuf.OutOfRange):
            await c.store_batch(bid, [(MiB - 4, np.ones(8, np.uint8))])
        # With a manifest the daemon records it: its way.
        await c.store_batch(bid, [(0, np.ones(8, np.uint8))], manifest=(["t"], ["uint8"], [[8]]))
        assert "t" in (await c.get_buffer_meta(bid))["tensors"]
        assert c.in_place_counts()["stores"] == 1


async def test_reads_never_cost_a_clone_its_shared_memory(d: DaemonProc) -> None:
    async with d.connect() as c:
        src = await c.request_buffer(MiB)
        await c.store_tensors(src, {"w": np.ones(MiB // 2, np.uint8)})  # the daemon's way
        clone = await c.clone_buffer(src)
        assert (await c.read_buffer(clone, 0, MiB // 2) == 1).all()
        parts = await c.read_batch(clone, [(0, 16), (4096, 16)])
        assert all((p == 1).all() for p in parts)
        counts = c.in_place_counts()
        assert counts["grants"] == 0 and counts["reads"] == 0
        assert "op=map" not in d.log()


async def test_a_block_written_in_place_is_never_kept(d: DaemonProc) -> None:
    url = metrics_url(d)
    before = pool_gauge(url, "reused_blocks")
    async with d.connect("alice") as a, d.connect("bob") as b:
        bid = await a.request_buffer(3 * MiB)
        await a.store_tensor(bid, np.full(3 * MiB, 0xA5, np.uint8))
        assert a.in_place_counts()["stores"] == 1
        await a.release_buffer(bid)
        mine = await b.request_buffer(3 * MiB)
        assert not (await b.read_buffer(mine)).any()
        assert pool_gauge(url, "reused_blocks") == before  # fresh memory, not alice's memfd
        assert pool_gauge(url, "kept_bytes") == 0


async def test_a_buffer_with_recorded_tensors_is_stored_through_the_daemon(
        d: DaemonProc) -> None:
    """Its manifest is the content index's: a store drops exactly the bytes
    it changes (``test_dedup.py``), so the verbs never map it by themselves."""
    async with d.connect() as c:
        bid = await c.request_buffer(MiB)
        await c.store_tensors(bid, {"w": np.ones(1024, np.float32)})
        await c.store_tensor(bid, np.zeros(64, np.uint8), offset=MiB - 64)
        await c.store_tensor(bid, np.zeros(64, np.uint8), offset=MiB - 128)
        counts = c.in_place_counts()
        assert counts["stores"] == 0 and counts["grants"] == 0 and counts["fallbacks"] == 1
        async with c.map(bid) as m:  # explicit: allowed, the whole buffer leaves the index
            m.array[-1] = 1


async def test_a_slot_granted_again_never_writes_the_released_buffer(d: DaemonProc) -> None:
    """Another session releases X; our next grant (for Y) reuses X's slot in a
    new generation: our mapping of X never passes for Y's grant."""
    async with d.connect() as c, d.connect() as other:
        x = await c.request_buffer(4096, name="x")
        y = await c.request_buffer(4096)
        await c.store_tensor(x, np.ones(4096, np.uint8))
        slot = c._own._maps[x].slot  # type: ignore[union-attr]
        await other.release_buffer(x)
        await c.store_tensor(y, np.full(4096, 2, np.uint8))
        assert c._own._maps[y].slot == slot  # type: ignore[union-attr]
        with pytest.raises(rpcbuf.NotFound):
            await c.store_tensor(x, np.zeros(4096, np.uint8))
        assert (await other.read_buffer(y) == 2).all()


async def test_a_writer_that_seals_its_memfd_gets_no_attach(d: DaemonProc) -> None:
    """The writable memfd leaves its seals open for the daemon's own
    ``reseal``; a client that closes them (F_SEAL_SEAL) only loses attach."""
    import fcntl

    async with d.connect() as c, d.connect() as other:
        bid = await c.request_buffer(4096)
        await c.store_tensor(bid, np.ones(4096, np.uint8))
        addr = c._own._maps[bid].array.ctypes.data  # type: ignore[union-attr]
        with open("/proc/self/maps") as f:
            span = next(line.split()[0] for line in f if int(line.split("-")[0], 16) == addr)
        fd = os.open(f"/proc/self/map_files/{span}", os.O_RDWR)
        try:
            fcntl.fcntl(fd, shm.F_ADD_SEALS, shm.F_SEAL_SEAL)
        finally:
            os.close(fd)
        with pytest.raises(rpcbuf.BadRequest) as info:
            await other.attach(bid)
        assert info.value.details["reason"] == "sealed"
        assert (await other.read_buffer(bid) == 1).all()  # everything else goes on


async def test_many_tasks_storing_at_once_share_one_grant(d: DaemonProc) -> None:
    """The daemon hands a buffer's fd with its first grant only: tasks that
    ask at once wait for one another's grant rather than race it."""
    async with d.connect() as c:
        bids = [await c.request_buffer(64 * 1024) for _ in range(4)]
        await asyncio.gather(*(c.store_tensor(b, np.full(4096, i % 251, np.uint8),
                                              offset=(i // 4) * 4096)
                               for i in range(64) for b in bids[i % 4:i % 4 + 1]))
        for j, b in enumerate(bids):
            got = await c.read_buffer(b, 0, 16 * 4096)
            assert [int(got[k * 4096]) for k in range(16)] == [(4 * k + j) % 251
                                                               for k in range(16)]
        assert c.in_place_counts()["grants"] == 4
