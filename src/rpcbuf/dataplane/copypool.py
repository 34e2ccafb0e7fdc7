"""Threads that run long copies and bounded memory work on a tenant's behalf,
shared fairly between tenants (never the event loop, never the default executor,
which a few stalled or flooding tenants fill for everyone).

- Each tenant runs at most ``per_tenant`` jobs at once (half the threads by default).
- Waiting jobs start round-robin by tenant: another tenant's queue delays a job by
  at most the jobs running, then one turn.
- A job past its deadline is ``written_off``: a replacement thread starts (at most
  ``threads`` of them); the stuck one counts against its tenant until it returns.
- A job not yet started is dropped when its caller gives up (``cancel``); one
  running is never abandoned, since its range lock and pin must outlive it.
- ``wait`` lets the loop block briefly, GIL released, on a small copy that started
  at once (a loop round trip costs ~150 us against ~18 us for a 4 KiB copy); a
  tenant with a job already queued or running gets no such wait.

The daemon keeps two pools: ``copies`` (ring copies that may stall on a client)
and ``sweeps`` (fills, local copies, hashing, pre-faulting, zeroing, disk-cache
writes), apart so stalled copies never hold up that work.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any


class CopyJob:
    """One copy: ``fn(*args)`` for ``tenant``, its result in ``future``."""

    __slots__ = ("alone", "args", "done", "error", "finished", "fn", "future", "loop",
                 "result", "started", "tenant", "waited", "worker")

    def __init__(self, tenant: str, fn: Callable[..., Any], args: tuple[Any, ...],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.tenant = tenant
        self.fn = fn
        self.args = args
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()
        self.started = False
        self.worker: _Worker | None = None
        self.alone = False  # nothing else of its tenant ran or waited at submit
        self.waited = False  # the loop blocks on ``done`` (see CopyPool.wait)
        self.done = threading.Event()
        self.finished = False
        self.result: Any = None
        self.error: BaseException | None = None


class _Worker:
    __slots__ = ("lost", "thread")

    def __init__(self) -> None:
        self.lost = False  # written off: exit once the current copy returns
        self.thread: threading.Thread | None = None


class CopyPool:
    """``threads`` copy threads; at most ``per_tenant`` busy for one tenant."""

    def __init__(self, threads: int = 4, per_tenant: int | None = None,
                 name: str = "rpcbuf-copy") -> None:
        if threads < 1:
            raise ValueError("a copy pool needs at least one thread")
        self.threads = threads
        self.name = name  # its threads' names: NAME-0, NAME-1, ...
        self.per_tenant = max(1, threads // 2) if per_tenant is None else per_tenant
        self._cond = threading.Condition()
        self._waiting: OrderedDict[str, deque[CopyJob]] = OrderedDict()  # round-robin order
        self._running: dict[str, int] = {}  # per tenant, stuck copies included
        self._live = 0  # threads taking work (not written off)
        self._spares = threads  # replacements still allowed
        self._closed = False
        self._workers: list[_Worker] = []

    # -- the loop's side ----------------------------------------------------------------

    def submit(self, tenant: str, fn: Callable[..., Any], *args: Any) -> CopyJob:
        """Queue ``fn(*args)``; await ``job.future``. Call from the event loop."""
        job = CopyJob(tenant, fn, args, asyncio.get_running_loop())
        with self._cond:
            if self._closed:
                raise RuntimeError("the copy pool is closed")
            # Alone: nothing of this tenant's runs or waits (see ``wait``).
            job.alone = tenant not in self._running and tenant not in self._waiting
            self._waiting.setdefault(tenant, deque()).append(job)
            if len(self._workers) < self.threads:  # made as needed; replacements: written_off
                self._start_worker()
            self._cond.notify()
        return job

    async def run(self, tenant: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a thread as ``tenant``'s job. Cancelled before it started:
        dropped; after: waits for it to end before re-raising (it touches pinned memory)."""
        job = self.submit(tenant, fn, *args)
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            if not self.cancel(job):
                # Retrieved whenever it ends: the caller is gone, and a second
                # cancellation may cut the wait below short.
                job.future.add_done_callback(_retrieve)
                await asyncio.wait([job.future])
            raise

    def wait(self, job: CopyJob, timeout: float, alone: bool = True) -> bool:
        """Block (GIL released) up to ``timeout`` for ``job`` (``alone``: only if it was its
        tenant's only one); True: ``job.future`` is settled. Call right after ``submit``."""
        with self._cond:
            if alone and not job.alone:
                return False
            finished = job.finished
            job.waited = not finished
        if not finished:
            job.done.wait(timeout)
            with self._cond:
                job.waited = False  # from now on the thread settles the future itself
                finished = job.finished
        if finished:
            _settle(job.future, job.result, job.error)
        return finished

    def cancel(self, job: CopyJob) -> bool:
        """Drop ``job`` if not started; False: it runs or ran, await its future."""
        with self._cond:
            if job.started:
                return False
            queue = self._waiting.get(job.tenant)
            if queue is not None:
                with contextlib.suppress(ValueError):
                    queue.remove(job)
                if not queue:
                    del self._waiting[job.tenant]
        job.future.cancel()
        return True

    def written_off(self, job: CopyJob) -> None:
        """``job`` passed its deadline: let another thread take its place (while spares last)."""
        with self._cond:
            worker = job.worker
            if worker is None or worker.lost or job.future.done():
                return
            worker.lost = True
            self._live -= 1
            if self._spares > 0:
                self._spares -= 1
                self._start_worker()
            self._cond.notify_all()

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"copy_threads": self._live,
                    "copies_running": sum(self._running.values()),
                    "copies_waiting": sum(len(q) for q in self._waiting.values())}

    def close(self) -> None:
        """Start nothing more: waiting jobs fail (RuntimeError); idle threads exit."""
        with self._cond:
            self._closed = True
            left = [job for queue in self._waiting.values() for job in queue]
            self._waiting.clear()
            self._cond.notify_all()
        for job in left:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody waits
                job.loop.call_soon_threadsafe(_settle, job.future, None,
                                              RuntimeError("the copy pool is closed"))

    # -- the threads' side ------------------------------------------------------------

    def _start_worker(self) -> None:  # under the lock
        worker = _Worker()
        worker.thread = threading.Thread(target=self._work, args=(worker,), daemon=True,
                                         name=f"{self.name}-{len(self._workers)}")
        self._workers.append(worker)
        self._live += 1
        worker.thread.start()

    def _next(self) -> CopyJob | None:  # under the lock: the first tenant below its share
        for tenant, queue in self._waiting.items():
            if self._running.get(tenant, 0) < self.per_tenant:
                job = queue.popleft()
                if queue:
                    self._waiting.move_to_end(tenant)  # its next copy waits a turn
                else:
                    del self._waiting[tenant]
                return job
        return None

    def _work(self, worker: _Worker) -> None:
        while True:
            with self._cond:
                job = None
                while not worker.lost and not self._closed:
                    job = self._next()
                    if job is not None:
                        break
                    self._cond.wait()
                if job is None:
                    if not worker.lost:
                        self._live -= 1
                    return
                job.started = True
                job.worker = worker
                self._running[job.tenant] = self._running.get(job.tenant, 0) + 1
            try:
                result, error = job.fn(*job.args), None
            except BaseException as exc:  # handed to the awaiting task
                result, error = None, exc
            with self._cond:
                left = self._running[job.tenant] - 1
                if left:
                    self._running[job.tenant] = left
                else:
                    del self._running[job.tenant]
                job.result, job.error, job.finished = result, error, True
                waited = job.waited
                self._cond.notify_all()  # that tenant may be below its share again
            if waited:  # the loop is blocked in ``wait``: it settles the future
                job.done.set()
                continue
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                job.loop.call_soon_threadsafe(_settle, job.future, result, error)


def _settle(fut: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if fut.done():
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()
