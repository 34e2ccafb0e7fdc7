"""Run a request's coroutine at once, and make it a task only if it waits.

Most requests never wait: a 4 KiB same-host store locks a free range,
copies one slot and answers, all in its first step.  ``start`` runs that
first step right away, in the caller's loop turn (in a copy of the current
context, as a task would), and returns ``None`` when the coroutine finished
there; a coroutine that has to wait (a lock held by another request, a UCX
message, a copy thread) goes on as an ``asyncio.Task`` from where it
stopped.  So an op is written once, as an ``async def``, and the cheap case
costs no task, no event-loop round and no second dispatch table.  Requests
also ask for their locks in the order they arrive: each one's first step,
which takes its locks, runs when it is dispatched.

This is Python 3.12's eager task start (``Task(..., eager_start=True)``),
used where it exists; on 3.11 the first step is taken here and the rest
driven by a task through ``_Rest``.  Either way a handler's first step
runs with no current task: nothing in it may need one (``asyncio.timeout``
does; 3.11's ``asyncio.wait_for`` does not, and on 3.12 the task is real).
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Coroutine
from typing import Any

EAGER = sys.version_info >= (3, 12)


def start(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run ``coro`` up to its first wait: ``None`` if it finished there
    (an exception it raised is raised here), else the task that runs the
    rest."""
    if EAGER:
        task: asyncio.Task[None] = asyncio.Task(  # type: ignore[call-arg]
            coro, loop=asyncio.get_running_loop(), eager_start=True)
        if task.done():
            task.result()  # retrieved (and raised, if it failed)
            return None
        return task
    ctx = contextvars.copy_context()
    try:
        waits_on = ctx.run(coro.send, None)
    except StopIteration:
        return None
    # (The loop only now: on 3.11 each get_running_loop() is a getpid() call.)
    rest: Any = _Rest(coro, waits_on)  # a coroutine by protocol (send, throw, close)
    return asyncio.get_running_loop().create_task(rest, context=ctx)


class _Rest:
    """The rest of a coroutine whose first step was taken, as a coroutine a
    task drives: the task's first step waits on what the coroutine waits
    on (``waits_on``, what it yielded); every later send and every throw
    goes into the coroutine (a cancel before the task's first step too: the
    coroutine is suspended in its await, as it would be in a task)."""

    __slots__ = ("_coro", "_waits_on")

    def __init__(self, coro: Coroutine[Any, Any, None], waits_on: Any) -> None:
        self._coro, self._waits_on = coro, waits_on

    def __await__(self) -> _Rest:
        return self

    def __iter__(self) -> _Rest:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        waits_on, self._waits_on = self._waits_on, _TAKEN
        if waits_on is not _TAKEN:
            return waits_on
        return self._coro.send(value)

    def throw(self, exc: BaseException) -> Any:
        waits_on, self._waits_on = self._waits_on, _TAKEN
        if isinstance(waits_on, asyncio.Future):  # cancelled before the task's first step:
            waits_on.cancel()  # what it waits on goes too, as Task.cancel does
        return self._coro.throw(exc)

    def close(self) -> None:
        self._coro.close()


_TAKEN = object()
