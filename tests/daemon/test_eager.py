"""``control/daemon/sessions/inflight.py``, ``start``: an op's coroutine runs at once, and only
one that waits becomes a task -- on this Python's path (3.12's eager start, or
the first step taken by hand on 3.11) and, where both exist, on the other."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from rpcbuf.control.daemon.sessions import inflight as eager

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


MODES = [True, False] if eager.EAGER else [False]  # 3.12's path exists on 3.12 only


@pytest.fixture(params=MODES, ids=["eager_start" if m else "by-hand" for m in MODES])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(eager, "EAGER", request.param)
    return bool(request.param)


async def test_a_coroutine_that_never_waits_ends_at_once_with_no_task(mode: bool) -> None:
    steps: list[str] = []

    async def op() -> None:
        steps.append("ran")

    assert eager.start(op()) is None
    assert steps == ["ran"]  # in this call, not a later loop turn


async def test_a_waiting_coroutine_goes_on_as_a_task_from_where_it_stopped(mode: bool) -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    steps: list[object] = []

    async def op() -> None:
        steps.append("first")
        steps.append(await gate)
        await asyncio.sleep(0)  # a bare yield to the loop passes through too
        steps.append("end")

    task = eager.start(op())
    assert task is not None and steps == ["first"]
    gate.set_result(7)
    await task
    assert steps == ["first", 7, "end"]


async def test_what_the_awaited_future_raises_reaches_the_coroutine(mode: bool) -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    caught: list[BaseException] = []

    async def op() -> None:
        try:
            await gate
        except ValueError as exc:
            caught.append(exc)

    task = eager.start(op())
    assert task is not None
    gate.set_exception(ValueError("no"))
    await task
    assert [str(e) for e in caught] == ["no"]


async def test_cancelling_the_task_cancels_the_coroutine_where_it_waits(mode: bool) -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    async def op() -> None:
        try:
            await gate
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise
        finally:
            seen.append("finally")

    task = eager.start(op())
    assert task is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["cancelled", "finally"] and gate.cancelled()


async def test_an_error_in_the_first_step_is_raised_by_start(mode: bool) -> None:
    async def op() -> None:
        raise KeyError("first step")

    with pytest.raises(KeyError):
        eager.start(op())


async def test_the_first_step_runs_in_a_copy_of_the_context_as_a_task_would(mode: bool) -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    async def op() -> None:
        VAR.set("mine")
        await gate
        seen.append(VAR.get())  # the rest runs in the same (copied) context

    task = eager.start(op())
    assert VAR.get() == "unset"  # nothing leaked into the caller's context
    assert task is not None
    gate.set_result(None)
    await task
    assert seen == ["mine"]


async def test_ops_take_a_lock_in_the_order_they_started(mode: bool) -> None:
    """Each op asks for its lock in its first step, when it is started: one
    that would not wait never overtakes one started before it."""
    lock = asyncio.Lock()
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    order: list[int] = []

    async def op(n: int) -> None:
        async with lock:
            order.append(n)
            if n == 0:
                await gate

    tasks = [eager.start(op(n)) for n in range(3)]
    assert order == [0] and all(t is not None for t in tasks)  # 1 and 2 queued, in order
    gate.set_result(None)
    await asyncio.gather(*[t for t in tasks if t is not None])
    assert order == [0, 1, 2]
    assert eager.start(op(3)) is None and order[-1] == 3  # a free lock: done at once
