"""Several clients of one tenant sharing a named buffer: no interleaving, no
torn reads, and back-pressure instead of unbounded queues."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import rpcbuf
from rpcbuf.control.wire import protocol as P

pytestmark = pytest.mark.both_paths  # the same-host and the UCX data path

SIZE = 8 << 20


async def test_overlapping_stores_never_interleave(clean_pool) -> None:  # type: ignore[no-untyped-def]
    async with clean_pool.connect("alice") as a, clean_pool.connect("alice") as b:
        bid = await a.request_buffer(SIZE, name="shared/overlap")
        assert await b.open_buffer("shared/overlap") == bid
        ones, twos = np.full(SIZE, 1, np.uint8), np.full(SIZE, 2, np.uint8)
        for _ in range(6):
            await asyncio.gather(a.store_tensor(bid, ones), b.store_tensor(bid, twos),
                                 b.store_batch(bid, [(SIZE // 2, twos[: SIZE // 4])]))
            back = await a.read_buffer(bid)
            halves = [back[: SIZE // 2], back[SIZE // 2: 3 * SIZE // 4], back[3 * SIZE // 4:]]
            for part in halves:  # each store's range holds one store's bytes
                assert (part == part[0]).all(), "bytes of two stores interleaved"
        await a.release_buffer(bid)


async def test_reads_never_see_a_torn_store(clean_pool) -> None:  # type: ignore[no-untyped-def]
    async with clean_pool.connect("alice") as w, clean_pool.connect("alice") as r:
        bid = await w.request_buffer(SIZE, name="shared/torn")
        patterns = [np.full(SIZE, v, np.uint8) for v in (10, 20, 30)]
        await w.store_tensor(bid, patterns[0])
        stop = asyncio.Event()

        async def writer() -> None:
            i = 0
            while not stop.is_set():
                i += 1
                await w.store_tensor(bid, patterns[i % 3])

        task = asyncio.create_task(writer())
        try:
            for _ in range(15):
                out = await r.read_buffer(bid)
                assert (out == out[0]).all(), "a read saw half of a store"
                parts = await r.read_batch(bid, [(0, SIZE // 2), (SIZE // 2, SIZE // 2)])
                assert parts[0][0] == parts[1][-1] and (parts[0] == parts[0][0]).all()
        finally:
            stop.set()
            await task
        await w.release_buffer(bid)


async def test_disjoint_transfers_share_the_buffer(clean_pool) -> None:  # type: ignore[no-untyped-def]
    n = 16
    chunk = SIZE // n
    clients = [clean_pool.connect("alice") for _ in range(4)]
    ctxs = [await c.__aenter__() for c in clients]
    try:
        bid = await ctxs[0].request_buffer(SIZE, name="shared/disjoint")
        await asyncio.gather(*(ctxs[i % 4].store_tensor(bid, np.full(chunk, i, np.uint8),
                                                         offset=i * chunk) for i in range(n)))
        back = await ctxs[1].read_buffer(bid)
        for i in range(n):
            assert (back[i * chunk:(i + 1) * chunk] == i).all()
        await ctxs[0].release_buffer(bid)
    finally:
        for c in clients:
            await c.__aexit__(None, None, None)


async def test_client_in_flight_limit(clean_pool, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("RPCBUF_IN_PLACE", "0")  # requests on the wire: in-place stores send none
    async with rpcbuf.connect(clean_pool.addr, clean_pool.token("alice"), max_inflight=3) as c:
        assert c.max_inflight == 3
        conn = c._conn
        outstanding = {"now": 0, "max": 0}
        submit = conn.submit

        def counting_submit(req_id: int, req: P.Request) -> asyncio.Future:  # type: ignore[type-arg]
            fut = submit(req_id, req)
            outstanding["now"] += 1
            outstanding["max"] = max(outstanding["max"], outstanding["now"])

            def done(_: object) -> None:
                outstanding["now"] -= 1

            fut.add_done_callback(done)
            return fut

        conn.submit = counting_submit  # type: ignore[method-assign]
        bid = await c.request_buffer(1 << 20)
        await asyncio.gather(*(c.store_tensor(bid, np.full(4096, i, np.uint8), offset=i * 4096)
                               for i in range(40)))
        assert outstanding["max"] == 3  # callers waited their turn
        await c.release_buffer(bid)


async def test_daemon_in_flight_limit_is_back_pressure(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:16MiB", "--max-inflight", "2")
    async with d.connect("alice") as hog, d.connect("bob") as other:
        assert hog.max_inflight == 2
        full = await hog.request_buffer(16 << 20)
        # many waiters on one connection: the daemon stops reading it, but answers in the end
        waits = [asyncio.create_task(hog.request_buffer(1 << 20, timeout=0.5)) for _ in range(6)]
        assert await other.ping() > 0  # other clients are not held up
        results = await asyncio.gather(*waits, return_exceptions=True)
        assert all(isinstance(r, rpcbuf.OutOfMemory) for r in results)
        await hog.release_buffer(full)
