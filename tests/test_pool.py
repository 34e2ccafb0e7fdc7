"""BufferPool: reuse held remote buffers (best fit) before asking the daemon."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import rpcbuf
from conftest import pool_free


async def test_reuse_best_fit_and_close(ctx: rpcbuf.RpcContext, clean_pool) -> None:  # type: ignore[no-untyped-def]
    start = await pool_free(clean_pool)
    async with rpcbuf.BufferPool(ctx) as pool:
        small = await pool.acquire(4096)
        mid = await pool.acquire(64 << 10)
        big = await pool.acquire(1 << 20)
        assert pool.statistics().misses == 3
        for b in (small, mid, big):
            pool.release(b)
        assert await pool.acquire(50_000) == mid  # smallest idle one that fits
        assert await pool.acquire(3000) == small
        assert await pool.acquire(600_000) == big
        s = pool.statistics()
        assert (s.hits, s.misses, s.idle, s.in_use) == (3, 3, 0, 3)
        other = await pool.acquire(4096)  # nothing idle fits: the daemon is asked
        assert other not in (small, mid, big)
        pool.release(small)
        huge_slack = await pool.acquire(100)  # 4096 > 2 x 100: not worth the waste
        assert huge_slack != small
        await ctx.store_tensor(big, np.ones(1000, np.uint8))  # the ids are real buffers
        with pytest.raises(rpcbuf.BadRequest):
            pool.release("b-not-from-this-pool")
        pool.release(other)
        with pytest.raises(rpcbuf.BadRequest):
            pool.release(other)  # twice
        with pytest.raises(rpcbuf.BadRequest):
            await pool.acquire(0)
        assert await pool.trim() == 2  # idle: small and other
    assert await pool_free(clean_pool) == start  # close released everything


async def test_pool_waits_like_request_buffer(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:4MiB")
    async with d.connect("alice") as a, d.connect("alice") as b:
        pa, pb = rpcbuf.BufferPool(a), rpcbuf.BufferPool(b)
        held = await pa.acquire(4 << 20)
        waiter = asyncio.create_task(pb.acquire(1 << 20, timeout=10))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        pa.release(held)  # back to pool a, not the daemon: b still waits
        await asyncio.sleep(0.2)
        assert not waiter.done()
        await pa.close()  # now the daemon has memory again
        got = await waiter
        assert isinstance(got, str)
        with pytest.raises(rpcbuf.OutOfMemory):
            await pb.acquire(8 << 20, timeout=0.1)
        await pb.close()


async def test_a_failed_release_leaves_the_rest_in_the_pool(ctx: rpcbuf.RpcContext) -> None:
    """trim takes buffers off its books one at a time: when one release fails
    (here the buffer was released behind the pool's back: NOT_FOUND), the
    others are still the pool's, counted and released by the next trim (they
    were neither idle nor released, and held_bytes counted them forever)."""
    pool = rpcbuf.BufferPool(ctx)
    ids = [await pool.acquire(n) for n in (4096, 8192, 16384)]
    for bid in ids:
        pool.release(bid)
    await ctx.release_buffer(ids[1])  # the middle one: not the first nor the last to go
    with pytest.raises(rpcbuf.NotFound):
        await pool.trim()
    left = pool.statistics()
    assert left.idle == 1 and left.held_bytes in (4096, 16384)
    assert await pool.trim() == 1
    assert pool.statistics().held_bytes == 0 and pool.statistics().idle == 0
    with pytest.raises(rpcbuf.NotFound):
        await ctx.get_buffer_meta(ids[0])
    with pytest.raises(rpcbuf.NotFound):
        await ctx.get_buffer_meta(ids[2])


async def test_trim_after_every_idle_buffer_was_handed_out_again(ctx: rpcbuf.RpcContext) -> None:
    """A device whose idle buffers were all acquired again has nothing to
    trim: trim releases none of them and close releases the one in use."""
    pool = rpcbuf.BufferPool(ctx)
    bid = await pool.acquire(4096)
    pool.release(bid)
    assert await pool.acquire(4096) == bid  # idle again: none
    assert await pool.trim() == 0
    await ctx.get_buffer_meta(bid)  # still held
    await pool.close()
    assert pool.statistics().held_bytes == 0
    with pytest.raises(rpcbuf.NotFound):
        await ctx.get_buffer_meta(bid)
