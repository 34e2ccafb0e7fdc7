"""``copypool.CopyPool``: bounded copy threads, a share per tenant, round-robin
start, stuck threads written off and replaced, unstarted jobs cancelled."""

from __future__ import annotations

import asyncio
import threading

import pytest

from control.daemon.copypool import CopyPool


async def test_one_tenant_gets_its_share_and_no_more() -> None:
    pool = CopyPool(4)  # at most 2 for one tenant
    gate = threading.Event()
    try:
        hogs = [pool.submit("mallory", gate.wait) for _ in range(5)]
        await asyncio.sleep(0.1)
        assert pool.stats()["copies_running"] == 2 and pool.stats()["copies_waiting"] == 3
        assert await asyncio.wait_for(pool.submit("alice", lambda: 7).future, 5) == 7
        gate.set()
        assert await asyncio.wait_for(asyncio.gather(*(h.future for h in hogs)), 5)
    finally:
        gate.set()
        pool.close()


async def test_stuck_copies_are_written_off_and_replaced() -> None:
    pool = CopyPool(2, per_tenant=1)
    gates = [threading.Event() for _ in range(3)]
    try:
        stuck = [pool.submit(t, g.wait) for t, g in zip(("a", "b"), gates, strict=False)]
        await asyncio.sleep(0.1)
        late = pool.submit("c", lambda: "ok")
        await asyncio.sleep(0.1)
        assert not late.future.done()  # both threads are stuck
        pool.written_off(stuck[0])  # past its deadline: another thread takes its place
        assert await asyncio.wait_for(late.future, 5) == "ok"
        queued = pool.submit("a", lambda: None)  # a still holds its one share
        assert pool.cancel(queued) and queued.future.cancelled()
        assert not pool.cancel(stuck[1])  # running: cannot be taken back
        for g in gates:
            g.set()
        await asyncio.wait_for(asyncio.gather(*(s.future for s in stuck)), 5)
    finally:
        for g in gates:
            g.set()
        pool.close()


async def test_a_small_copy_is_waited_for_without_a_loop_round_trip() -> None:
    pool = CopyPool(2)
    try:
        job = pool.submit("alice", lambda: 3)
        assert pool.wait(job, 5.0) and job.future.result() == 3
        gate = threading.Event()
        busy = pool.submit("alice", gate.wait)
        second = pool.submit("alice", lambda: 4)
        assert not pool.wait(second, 5.0)  # not alone: no blocking wait at all
        gate.set()
        assert await asyncio.wait_for(second.future, 5) == 4
        await busy.future
        with pytest.raises(ZeroDivisionError):
            await pool.submit("bob", lambda: 1 // 0).future
    finally:
        pool.close()
