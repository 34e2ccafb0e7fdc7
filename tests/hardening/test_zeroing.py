"""Kept blocks (``--keep-freed``) are zeroed in the background in the order
they were released, and a request for the same block size gets the most
recently released one: the last in that order.  Issue 24, item 10: another
tenant's request waited for every block released before its own.  Now the
request zeroes its block itself (``KeptBlocks.zero_now``, on the daemon's
fair ``sweeps`` threads), so it is answered while the other blocks still
wait for the zeroer.  A real daemon, real bytes; the test asserts what was
still to be zeroed when the answer came, never how long anything took."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from conftest import metrics_url, pool_gauge

MIB = 1 << 20
BLOCK = 32 * MIB
BLOCKS = 24  # 768 MiB for the zeroer: far more than one block's worth


async def test_a_request_is_not_served_after_every_kept_block_released_before_its_own(
        daemon_factory: Any) -> None:
    d = daemon_factory("--device", "cpu:1GiB", "--keep-freed", "1GiB",
                       "--metrics", "127.0.0.1:0")
    url = metrics_url(d)
    async with d.connect("alice") as a, d.connect("bob") as b:
        ids = [await a.request_buffer(BLOCK) for _ in range(BLOCKS)]
        await asyncio.gather(*(a.clear_buffer(i, 0xA5) for i in ids))  # alice's bytes
        await asyncio.gather(*(a.release_buffer(i) for i in ids))  # all kept, to be zeroed
        reused = pool_gauge(url, "reused_blocks")
        mine = await b.request_buffer(BLOCK)
        left = pool_gauge(url, "zeroing_bytes")  # what the zeroer had still to do then
        assert pool_gauge(url, "reused_blocks") == reused + 1  # bob got a kept block
        # Before the fix bob's block, last in the zeroer's order, was zero only
        # once every other block was: nothing was left when he was answered.
        assert left > 0, "bob was answered only after every released block was zeroed"
        got = np.frombuffer(await b.read_buffer(mine, 0, BLOCK), np.uint8)
        assert not got.any()  # none of alice's bytes
        await b.release_buffer(mine)
    for _ in range(200):  # bounded: the zeroer gets through the rest
        if pool_gauge(url, "zeroing_bytes") == 0:
            break
        await asyncio.sleep(0.05)
    assert pool_gauge(url, "zeroing_bytes") == 0
