"""UCX progress for ucxx on asyncio: poll while busy, sleep on the worker's
fd when idle (``install_adaptive_progress``), a bounded drain per loop turn
(``drain``), and the markers and stop that go with them (``busy``,
``stop_progress``).  ``rpcbuf.dataplane.ucx.ucxx()`` installs it when it imports
ucxx; nothing here imports ucxx at module level.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from typing import Any

_log = logging.getLogger("rpcbuf.ucx")

_PROGRESS: dict[asyncio.AbstractEventLoop, Any] = {}


class Activity:
    """When UCX last had work here (``last``, monotonic) and ``woken``, set on
    the next sign of it: what the janitor waits on instead of a timer."""

    def __init__(self) -> None:
        self.last = 0.0
        self.woken = asyncio.Event()

    def note(self) -> None:
        self.last = time.monotonic()
        self.woken.set()


_ACTIVITY: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Activity] = \
    weakref.WeakKeyDictionary()


def activity() -> Activity:
    """The running loop's ``Activity`` (noted by the progress mode below)."""
    loop = asyncio.get_running_loop()
    found = _ACTIVITY.get(loop)
    if found is None:
        found = _ACTIVITY[loop] = Activity()
    return found


def install_adaptive_progress() -> None:
    """Replace ucxx's blocking progress mode with an adaptive one.

    ucxx 0.52's ``BlockingMode`` never re-arms the worker, so after one event
    an idle daemon spins a core; purely event-driven progress fixes that but
    makes each tcp rendezvous step wait for a UCX timer (1 MiB: 16 ms instead
    of 0.3).  So this mode polls only while a transfer is in flight (``busy()``,
    every ``DataEndpoint`` send/recv), and as soon as nothing is in flight and
    a drain found nothing it arms the worker and sleeps on its epoll fd.  No
    grace period of polling after the last activity: a request/answer exchange
    is all gaps, and two processes spinning on a loaded 2-core machine took
    8-14 ms per 4 KiB block (``test_an_idle_client_does_not_poll_ucx``).  A 1 s
    guard wakes it in case an event is ever missed."""
    from ucxx._lib_async import application_context, continuous_ucx_progress

    class AdaptiveProgress(continuous_ucx_progress.ProgressTask):
        GRACE = 0.0  # seconds of polling after the last sign of activity (see above)
        DRAIN = DRAIN_CALLS  # progress calls per loop turn, at most
        DRAIN_SECONDS = DRAIN_BUDGET  # and about this long

        def __init__(self, worker: Any, event_loop: asyncio.AbstractEventLoop) -> None:
            super().__init__(worker, event_loop)
            worker.init_blocking_progress_mode()
            self.busy = 0
            self.stopped = False
            self._until = 0.0
            self._activity = _ACTIVITY.get(event_loop) or _ACTIVITY.setdefault(
                event_loop, Activity())
            self.poll_task: asyncio.Task[None] | None = None
            fd = worker.epoll_file_descriptor
            event_loop.add_reader(fd, self._on_fd)
            weakref.finalize(self, event_loop.remove_reader, fd)
            self.guard_task: asyncio.Task[None] | None = event_loop.create_task(self._guard())
            _PROGRESS[event_loop] = self
            self._wake()

        @property
        def _tasks(self) -> tuple[asyncio.Task[None], ...]:
            return tuple(t for t in (self.poll_task, self.guard_task) if t is not None)

        def _clear_tasks(self) -> None:
            self.stopped = True
            self.poll_task = self.guard_task = None
            _PROGRESS.pop(self.event_loop, None)

        def stop(self) -> None:
            """Cancel the progress tasks (the loop is about to end)."""
            self.stopped = True
            for task in self._tasks:
                task.cancel()
            _PROGRESS.pop(self.event_loop, None)

        def begin(self) -> None:
            self.busy += 1
            self._activity.note()
            self._wake()

        def end(self) -> None:
            self.busy -= 1
            self._wake()

        def _on_fd(self) -> None:
            # While polling, the fd (not armed) stays readable and this fires
            # on every loop turn: it must not extend the grace, or we never sleep.
            if self.poll_task is None or self.poll_task.done():
                self._activity.note()
                self._wake()

        def _wake(self, grace: float | None = None) -> None:
            self._until = time.monotonic() + (self.GRACE if grace is None else grace)
            if self.stopped or self.event_loop.is_closed():
                return
            if self.poll_task is None or self.poll_task.done():
                self.poll_task = self.event_loop.create_task(self._poll())

        async def _poll(self) -> None:
            try:
                await self._poll_until_armed()
            except asyncio.CancelledError:
                # Only the loop's shutdown cancels us: start nothing new after it,
                # or a task created while the loop winds down is left pending.
                self.stopped = True
                raise

        async def _poll_until_armed(self) -> None:
            worker, activity = self.worker, self._activity
            while worker is not None and not self.stopped:
                try:
                    if drain(worker, self.DRAIN, self.DRAIN_SECONDS):
                        self._until = time.monotonic() + self.GRACE
                        activity.note()
                    elif not self.busy and time.monotonic() >= self._until:
                        if worker.arm():
                            return  # armed: the epoll fd calls _on_fd on the next event
                        continue  # events arrived meanwhile: progress them first
                except Exception:  # an endpoint's error surfaced here: its requests see it
                    _log.debug("UCX progress raised", exc_info=True)
                await asyncio.sleep(0)  # let completed requests' tasks run (and post more)
                worker = self.worker

        async def _guard(self) -> None:
            while self.worker is not None and not self.stopped:
                try:
                    await asyncio.sleep(1.0)
                except asyncio.CancelledError:
                    self.stopped = True
                    raise
                if self.poll_task is None or self.poll_task.done():
                    self._wake(grace=0.0)  # one progress-and-arm, no polling

    application_context.BlockingMode = AdaptiveProgress


DRAIN_CALLS = 64
DRAIN_BUDGET = 0.001  # seconds


def drain(worker: Any, most: int = DRAIN_CALLS, seconds: float = DRAIN_BUDGET) -> bool:
    """Progress ``worker`` until it has nothing more to do, ``most`` calls at
    most, no new call after ``seconds``; whether anything progressed.  The
    bounds keep one busy endpoint from holding the daemon's loop (one loop
    turn per ``progress_once`` cost 11-13 % of a 64 MiB transfer)."""
    if not worker.progress_once():
        return False
    until = time.monotonic() + seconds
    for _ in range(most - 1):
        if time.monotonic() >= until or not worker.progress_once():
            break
    return True


async def stop_progress() -> None:
    """Stop driving UCX progress on the running loop (call last, before the
    loop ends, so no progress task is left pending when it closes)."""
    progress = _PROGRESS.get(asyncio.get_running_loop())
    if progress is not None:
        tasks = progress._tasks
        progress.stop()
        await asyncio.gather(*tasks, return_exceptions=True)


class busy:
    """Marks a transfer in flight so the progress mode polls meanwhile; code
    that drives a ucxx endpoint directly (benchmarks) wraps its calls in it."""

    __slots__ = ("_p",)

    def __enter__(self) -> None:
        self._p = _PROGRESS.get(asyncio.get_running_loop())
        if self._p is not None:
            self._p.begin()

    def __exit__(self, *exc: object) -> None:
        if self._p is not None:
            self._p.end()
