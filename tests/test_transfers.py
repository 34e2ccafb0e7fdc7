"""Real bytes over UCX (tcp) between the test process and a real rpcbufd."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import rpcbuf

pytestmark = pytest.mark.both_paths  # the same-host and the UCX data path

DTYPES = ["uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64",
          "complex64", "bool"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("shape", "offset"), [((1,), 0), ((3, 5, 7), 1), ((1000, 33), 4093),
                                                ((0,), 17), ((257,), 65535)])
async def test_round_trip(ctx: rpcbuf.RpcContext, dtype: str, shape: tuple[int, ...],
                          offset: int) -> None:
    rng = np.random.default_rng(abs(hash((dtype, shape, offset))) % 2**32)
    arr = (rng.random(shape) * 200).astype(dtype)
    buf = await ctx.request_buffer(offset + arr.nbytes + 100)
    res = await ctx.store_tensor(buf, arr, offset=offset, verify="checksum")
    assert res["nbytes"] == arr.nbytes and res["checksum"] == rpcbuf.checksum(arr)
    back = await ctx.read_buffer(buf, offset, arr.nbytes)
    assert back.dtype == np.uint8 and back.nbytes == arr.nbytes
    np.testing.assert_array_equal(back.view(dtype).reshape(shape), arr)
    out = np.empty_like(arr)
    assert await ctx.read_buffer(buf, offset, out=out) is out
    np.testing.assert_array_equal(out, arr)
    assert await ctx.verify_write(buf, offset, arr)
    await ctx.release_buffer(buf)


async def test_neighbours_untouched_and_non_contiguous(ctx: rpcbuf.RpcContext) -> None:
    buf = await ctx.request_buffer(3000)
    await ctx.store_tensor(buf, np.full(3000, 7, np.uint8))
    strided = np.arange(2000, dtype=np.int16)[::2]  # not contiguous: copied once
    await ctx.store_tensor(buf, strided, offset=1000)
    back = await ctx.read_buffer(buf)
    assert back.nbytes == 3000  # default: to the buffer's end
    assert (back[:1000] == 7).all() and (back[3000 - 1000 + 1000:] == 7).all()
    np.testing.assert_array_equal(back[1000:3000].view(np.int16), strided)
    await ctx.store_tensor(buf, b"hello", offset=2995)  # anything with the buffer protocol
    assert bytes(await ctx.read_buffer(buf, 2995, 5)) == b"hello"
    await ctx.release_buffer(buf)


async def test_64_concurrent_transfers_on_one_client(ctx: rpcbuf.RpcContext) -> None:
    size = 256 * 1024
    buf = await ctx.request_buffer(64 * size)
    arrays = [np.full(size, i, dtype=np.uint8) for i in range(64)]
    await asyncio.gather(*(ctx.store_tensor(buf, a, offset=i * size, verify="checksum")
                           for i, a in enumerate(arrays)))
    outs = await asyncio.gather(*(ctx.read_buffer(buf, i * size, size) for i in range(64)))
    for i, out in enumerate(outs):
        assert (out == i).all()
    await ctx.release_buffer(buf)


async def test_large_store_and_read(ctx: rpcbuf.RpcContext) -> None:
    arr = np.random.default_rng(3).integers(0, 255, 64 << 20, dtype=np.uint8)
    buf = await ctx.request_buffer(arr.nbytes)
    await ctx.store_tensor(buf, arr, verify="checksum")
    out = np.zeros_like(arr)
    await ctx.read_buffer(buf, 0, out=out)
    assert np.array_equal(out, arr)
    await ctx.release_buffer(buf)


async def test_async_store_returns_a_task(ctx: rpcbuf.RpcContext) -> None:
    buf = await ctx.request_buffer(4096)
    task = await ctx.store_tensor(buf, np.ones(4096, np.uint8), sync=False)
    assert isinstance(task, asyncio.Task)
    assert (await task)["nbytes"] == 4096
    await ctx.release_buffer(buf)


async def test_verify_failed_is_reported(ctx: rpcbuf.RpcContext,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import rpcbuf.control.client.rangeops

    buf = await ctx.request_buffer(1024)
    # the client lies
    monkeypatch.setattr(rpcbuf.control.client.rangeops, "checksum", lambda data: 12345)
    with pytest.raises(rpcbuf.VerifyFailed) as info:
        await ctx.store_tensor(buf, np.ones(1024, np.uint8), verify="checksum")
    assert info.value.details["expected"] == 12345
    monkeypatch.undo()
    await ctx.store_tensor(buf, np.zeros(1024, np.uint8))
    with pytest.raises(rpcbuf.VerifyFailed, match="read-back"):
        await ctx.verify_write(buf, 0, np.ones(1024, np.uint8))
    stats = await ctx.stats()
    assert stats["verify_failures"] >= 1
    await ctx.release_buffer(buf)


async def test_meta_and_devices(ctx: rpcbuf.RpcContext) -> None:
    devs = await ctx.list_devices()
    assert devs[0]["device_type"] == "CPU" and devs[0]["total"] == 768 << 20
    buf = await ctx.request_buffer(1000, device_type="cpu", ttl=60)
    meta = await ctx.get_buffer_meta(buf)
    assert meta["buffer_id"] == buf and meta["size"] == 1000 and meta["alloc_size"] == 4096
    assert meta["tenant"] == "alice" and meta["device_type"] == "CPU" and meta["device"] == 0
    assert meta["expires_at"] > meta["created_at"] and meta["tensors"] == {}
    assert isinstance(meta["base_addr"], int) and meta["base_addr"] % 256 == 0
    assert buf in {b["buffer_id"] for b in await ctx.list_buffers()}
    assert await ctx.ping() > 0
    await ctx.release_buffer(buf)


async def test_create_rpc_context_and_await_form(clean_pool) -> None:  # type: ignore[no-untyped-def]
    c = await rpcbuf.create_rpc_context(clean_pool.addr, clean_pool.token("alice"))
    assert c.tenant == "alice"
    await c.close()
    await c.close()  # idempotent
    with pytest.raises(rpcbuf.ConnectionLost):
        await c.ping()


async def test_ucx_progress_drains_each_loop_turn(clean_pool,  # type: ignore[no-untyped-def]
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The client's progress engine makes more than one progress call per
    turn of the loop while UCX has work (``progress.drain``), within its bounds,
    and the bytes still arrive whole (16 MiB each way over UCX)."""
    from rpcbuf.dataplane import progress

    turns: list[tuple[int, float, int]] = []  # (most, seconds, progress calls made)
    real = progress.drain

    class Counting:
        def __init__(self, worker: object) -> None:
            self.worker, self.calls = worker, 0

        def progress_once(self) -> bool:
            self.calls += 1
            return bool(self.worker.progress_once())  # type: ignore[attr-defined]

    def counted(worker: object, most: int = progress.DRAIN_CALLS,
                seconds: float = progress.DRAIN_BUDGET) -> bool:
        w = Counting(worker)
        try:
            return real(w, most, seconds)
        finally:
            turns.append((most, seconds, w.calls))

    monkeypatch.setattr(progress, "drain", counted)
    data = np.random.default_rng(5).integers(0, 256, 16 << 20, dtype=np.uint8)
    async with clean_pool.connect("alice", same_host=False) as c:
        assert not c.same_host
        buf = await c.request_buffer(data.nbytes)
        await c.store_tensor(buf, data)
        out = np.zeros_like(data)
        await c.read_buffer(buf, out=out)
        await c.release_buffer(buf)
    np.testing.assert_array_equal(out, data)
    assert turns, "the progress engine never ran drain"
    assert {(m, s) for m, s, _ in turns} == {(progress.DRAIN_CALLS, progress.DRAIN_BUDGET)}
    assert max(n for _, _, n in turns) >= 2  # a productive turn goes on until nothing is left
    assert max(n for _, _, n in turns) <= progress.DRAIN_CALLS
