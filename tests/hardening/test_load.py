"""N clients doing mixed ops (request / store / read / verify / release,
batches) for a fixed time.  Afterwards every acknowledged store reads back
byte-exact and the pool's free bytes are back at their start.  Prints ops/s
and the p99 latency (RPCBUF_SOAK=1: 32 clients for 30 s)."""

from __future__ import annotations

import asyncio
import random
import time

import numpy as np
import pytest
from rawwire import scaled

from conftest import DaemonProc, pool_free, wait_free

CLIENTS = scaled(8, 32)
DURATION = scaled(3.0, 30.0)
MAX_HELD = 6  # buffers one client keeps at once


async def worker(d: DaemonProc, seed: int, deadline: float, lat: list[float],
                 acked: dict[str, np.ndarray], done: list[int]) -> None:
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    async with d.connect(f"load{seed % 4}") as ctx:
        held: dict[str, np.ndarray] = {}  # buffer id -> what was acknowledged there
        while time.monotonic() < deadline:
            t0 = time.perf_counter()
            roll = rng.random()
            if not held or (roll < 0.25 and len(held) < MAX_HELD):
                size = rng.choice([64, 4096, 65536, 300_000, 1 << 20])
                bid = await ctx.request_buffer(size, timeout=5.0)
                held[bid] = np.zeros(0, np.uint8)
            else:
                bid = rng.choice(list(held))
                size = (await ctx.get_buffer_meta(bid, tensors=False))["size"] \
                    if roll < 0.3 else None
                if roll < 0.4:
                    data = held.pop(bid)
                    if data.nbytes:
                        back = await ctx.read_buffer(bid, 0, data.nbytes)
                        assert np.array_equal(back, data), "read-back differs before release"
                    await ctx.release_buffer(bid)
                    acked.pop(bid, None)
                elif roll < 0.7:
                    meta_size = size or (await ctx.get_buffer_meta(bid, tensors=False))["size"]
                    data = nrng.integers(0, 256, meta_size, dtype=np.uint8)
                    if rng.random() < 0.5:
                        await ctx.store_tensor(bid, data, verify="checksum")
                    else:
                        half = meta_size // 2
                        await ctx.store_batch(bid, [(0, data[:half]), (half, data[half:])])
                    held[bid] = data
                    acked[bid] = data
                else:
                    data = held[bid]
                    if data.nbytes:
                        if rng.random() < 0.5:
                            assert await ctx.verify_write(bid, 0, data)
                        else:
                            q = data.nbytes // 4
                            a, b = await ctx.read_batch(bid, [(0, q), (q, data.nbytes - q)])
                            assert np.array_equal(np.concatenate([a, b]), data)
            lat.append(time.perf_counter() - t0)
            done[0] += 1
        # Every acknowledged store reads back exactly, then everything goes back.
        for bid, data in held.items():
            if data.nbytes:
                assert np.array_equal(await ctx.read_buffer(bid, 0, data.nbytes), data)
            await ctx.release_buffer(bid)


@pytest.fixture(scope="module")
def load_daemon(daemon_factory) -> DaemonProc:  # type: ignore[no-untyped-def]
    return daemon_factory("--device", "cpu:256MiB")  # type: ignore[no-any-return]


async def test_mixed_load_reads_back_exact_and_frees_everything(load_daemon: DaemonProc) -> None:
    start = await pool_free(load_daemon)
    lat: list[float] = []
    acked: dict[str, np.ndarray] = {}
    done = [0]
    t0 = time.monotonic()
    async with asyncio.timeout(DURATION + 60):
        await asyncio.gather(*(worker(load_daemon, i, t0 + DURATION, lat, acked, done)
                               for i in range(CLIENTS)))
    elapsed = time.monotonic() - t0
    p50, p99 = (float(np.percentile(lat, q)) * 1e3 for q in (50, 99))
    print(f"\nload: {CLIENTS} clients, {done[0]} ops in {elapsed:.1f}s = "
          f"{done[0] / elapsed:.0f} ops/s, p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    assert done[0] >= CLIENTS  # everyone got work done
    assert load_daemon.proc.poll() is None
    assert await wait_free(load_daemon, start) == start, "pool memory leaked"
