"""Cross-tenant isolation under races: a buffer released while a request
that looked it up still waits must never let that request touch the memory
another tenant is given next (see ``dataops.Held`` and ``Registry._free``)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import rpcbuf
from conftest import pool_free, wait_free
from rpcbuf.control.client.dedup import content_hashes
from rpcbuf.control.daemon.content.index import WRITE_LOG
from rpcbuf.control.wire import protocol as P


async def test_release_during_dedup_wait_cannot_reach_another_tenant(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """dedup_store looks its target up, then waits for another buffer's range
    lock (the deferred index, hashing again what it cannot prove unwritten).
    Releasing the target meanwhile and letting bob allocate must not let the
    dedup copy write into bob's buffer, nor free bob's block a second time
    (then carol would share it)."""
    d = daemon_factory("--device", "cpu:8MiB", "--transfer-timeout", "2s")
    start = await pool_free(d)
    mib = 1 << 20
    weights = {"w": np.full(mib, 0xA1, np.uint8)}
    async with d.connect("alice") as a, d.connect("alice", same_host=False) as stall, \
            d.connect("bob") as b, d.connect("carol") as c:
        src = await a.request_buffer(2 * mib)
        await a.store_tensors(src, weights)  # indexed lazily, at the next dedup query
        # A UCX store that never sends its payload holds src's range for ~2 s
        # (then the deadline aborts that session).
        stalled = stall._conn.submit(stall._conn.next_id(),
                                     P.Store(buffer_id=src, offset=0, nbytes=mib))
        await asyncio.sleep(0.3)
        # More writes into src (elsewhere) than its write log keeps: the index
        # cannot tell whether the stalled store's range was written since the
        # weights were hashed, so the next dedup query hashes them again, under
        # a shared lock that waits for the stalled store.
        for k in range(WRITE_LOG + 1):
            await a.store_tensor(src, np.zeros(16, np.uint8), offset=mib + 64 * k)
        dst = await a.request_buffer(mib)
        dedup = asyncio.ensure_future(a._dedup._dedup_chunk(dst, ["w"], weights, {"w": 0},
                                                     content_hashes(weights)))
        await asyncio.sleep(0.3)  # dedup now waits for src's lock, holding dst
        await a.release_buffer(dst)
        theirs = await b.request_buffer(mib)  # very likely dst's block
        await b.clear_buffer(theirs, 0x0B)
        with pytest.raises(rpcbuf.ConnectionLost):
            await asyncio.wait_for(stalled, 15)
        (placed,) = await asyncio.gather(asyncio.wait_for(dedup, 15), return_exceptions=True)
        got = await b.read_buffer(theirs, 0, mib)
        assert (got == 0x0B).all(), "alice's dedup wrote into bob's buffer"
        # bob's block was freed once (never by alice's request): carol gets other memory
        hers = await c.request_buffer(mib)
        await c.clear_buffer(hers, 0x0C)
        got = await b.read_buffer(theirs, 0, mib)
        assert (got == 0x0B).all(), "bob and carol share a block"
        assert isinstance(placed, rpcbuf.NotFound), placed  # its buffer is gone: nothing placed
        for ctx, bid in ((b, theirs), (c, hers), (a, src)):
            await ctx.release_buffer(bid)
    assert await wait_free(d, start) == start


async def test_another_tenants_aged_waiter_never_costs_a_tenant_its_blocks(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Issue 34, H2: bob holds 8 MiB of a 64 MiB device and waits for all 64
    (which only his own release could make fit).  Once his waiter has aged
    (``AGING``, 5 s), alice's next put evicted all 32 of her blocks and then
    failed OUT_OF_MEMORY with 48 MiB free, and her request_buffer(1 MiB) was
    refused.  Now his waiter holds nobody back: her put evicts nothing and
    her request is served at once."""
    from rpcbuf.control.daemon.accounting.waiters import AGING

    d = daemon_factory("--device", "cpu:64MiB", "--transfer-timeout", "30s")
    kib = 1 << 10
    rng = np.random.default_rng(34)
    mine = {f"kv/{i}": rng.integers(0, 255, 256 * kib, dtype=np.uint8) for i in range(32)}
    async with d.connect("alice") as a, d.connect("bob") as b:
        await a.put_blocks(mine)
        held = await b.request_buffer(8 << 20)
        waiting = asyncio.ensure_future(b.request_buffer(64 << 20, timeout=30))
        await asyncio.sleep(AGING + 0.5)
        assert not waiting.done()
        await a.put_block("kv/one more", mine["kv/0"])
        st = (await a.stats())["blocks"]
        assert st["evictions"] == 0 and st["blocks"] == 33
        got = await a.request_buffer(1 << 20)  # no timeout: at once, or OUT_OF_MEMORY
        await a.release_buffer(got)
        assert await a.blocks_exist(list(mine)) == [True] * 32
        waiting.cancel()
        await b.release_buffer(held)
        await a.remove_blocks([*mine, "kv/one more"])
