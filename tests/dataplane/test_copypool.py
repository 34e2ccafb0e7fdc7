"""``copypool.CopyPool``: bounded copy threads, a share per tenant, round-robin
start, stuck threads written off and replaced, unstarted jobs cancelled."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rpcbuf.dataplane.copypool import CopyPool


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


async def test_one_tenants_queued_sweeps_delay_anothers_by_one_turn_at_most() -> None:
    """Issue 24, item 11: memory work done for a tenant (``Pipeline.in_thread``:
    fills, copies, checksums...) ran on asyncio's default executor, first
    come first served, so another tenant's job waited behind the whole
    queue.  On the daemon's ``sweeps`` pool it waits for the job running and
    at most one more turn of the flooding tenant, however deep its queue."""
    from types import SimpleNamespace

    from rpcbuf.control.daemon.data.pipeline import Pipeline
    from rpcbuf.control.wire.units import THREAD_BYTES

    pool = CopyPool(1, per_tenant=1)
    mallory = Pipeline(SimpleNamespace(sweeps=pool, owner="mallory"))  # type: ignore[arg-type]
    alice = Pipeline(SimpleNamespace(sweeps=pool, owner="alice"))  # type: ignore[arg-type]
    gate, order = threading.Event(), []

    def sweep(name: str) -> None:
        if name == "m0":
            gate.wait(10)  # the one thread is busy with mallory's first job
        order.append(name)

    try:
        flood = [asyncio.ensure_future(mallory.in_thread(THREAD_BYTES, sweep, f"m{i}"))
                 for i in range(6)]
        await asyncio.sleep(0.05)  # all of mallory's submitted, m0 running
        mine = asyncio.ensure_future(alice.in_thread(THREAD_BYTES, sweep, "a"))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(asyncio.gather(*flood, mine), 10)
        assert order.index("a") <= 2, order  # m0, then at most one more of mallory's
        assert sorted(order) == ["a", "m0", "m1", "m2", "m3", "m4", "m5"]
        assert await alice.in_thread(THREAD_BYTES - 1, lambda: 5) == 5  # small: inline
    finally:
        gate.set()
        pool.close()


async def test_run_waits_for_a_started_job_and_drops_an_unstarted_one() -> None:
    pool = CopyPool(1, per_tenant=1)
    gate, ran = threading.Event(), []
    try:
        first = asyncio.ensure_future(pool.run("a", lambda: (gate.wait(10), ran.append(1))))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(pool.run("a", ran.append, 2))
        await asyncio.sleep(0)
        second.cancel()  # not started: dropped, never runs
        first.cancel()  # started: the caller waits for it to end
        await asyncio.sleep(0.05)
        assert not first.done()
        gate.set()
        for t in (first, second):
            with pytest.raises(asyncio.CancelledError):
                await asyncio.wait_for(t, 10)
        assert ran == [1]
    finally:
        gate.set()
        pool.close()


async def test_a_job_still_waiting_when_the_pool_closes_fails_instead_of_hanging() -> None:
    pool = CopyPool(1, per_tenant=1)
    gate = threading.Event()
    try:
        busy = pool.submit("a", gate.wait, 10)
        await asyncio.sleep(0.05)
        waiting = pool.submit("b", lambda: 1)
        pool.close()
        with pytest.raises(RuntimeError, match="closed"):
            await asyncio.wait_for(waiting.future, 10)
        gate.set()
        assert await asyncio.wait_for(busy.future, 10)
    finally:
        gate.set()
