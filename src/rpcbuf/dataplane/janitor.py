"""The janitor: tagged UCX messages that no request asked for do not stay.

UCP keeps every tagged message that arrives before a matching receive is
posted, payload included, worker-wide, for ever: a peer that never said
hello, or a tenant sending tags no request expects, grew a daemon by
hundreds of MiB.  Tags are the peer's choice, so age is the test.

* By age: every ``period`` the janitor sends itself a *sentinel* (a fresh
  random tag to its own worker); a round later every unexpected message
  ahead of it has waited at least ``period`` and is received into a 1-byte
  scratch buffer, so dropped.  A round is skipped while ``claimable(since)``
  says a request dispatched before ``since`` is still in flight (a store's
  payload may wait for its buffer's lock), but at most ``patience`` seconds.
* By bytes: a peer with no token sent 1.5 GB in seconds over loopback.  So
  every ``TICK`` while UCX is at work, once the process's RssAnon has grown
  more than ``budget`` over its start (plus ``allowance``: what tenants
  hold, each bounded by its quota), it drops everything a tick old,
  deferring for no one.  The reference never moves (UCP's pools keep what
  they grew to).
* A store whose payload was dropped learns it when it posts its receive
  (``was_dropped``, the last ``RECORD`` tags): TIMEOUT ``payload_dropped``,
  not the transfer deadline.  Freed heap goes back to the kernel
  (``malloc_trim``) after a sweep under pressure or of ``TRIM_AFTER`` bytes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import ctypes.util
import logging
import os
import time
from typing import Any

import numpy as np

from rpcbuf.dataplane import progress
from rpcbuf.dataplane.progress import Activity, busy
from rpcbuf.dataplane.ucx import ucxx

_log = logging.getLogger("rpcbuf.ucx")


class Janitor:
    """Drops tagged messages nobody asked for (see the module)."""

    RECORD = 1 << 16  # dropped tags remembered (~6 MiB at most; oldest forgotten first)
    # Seconds between two looks at the memory: at 20 ms a quiet loopback flood
    # grew the daemon by 170 MiB before a sweep caught up; at 10 ms, 105.
    TICK = 0.01
    # Seconds without UCX work after which the looks stop until it works again
    # (``progress.Activity``): UCX takes in bytes only while it progresses.
    QUIET = 0.1
    PRESSED_BATCH = 16384  # messages dropped per loop step under pressure
    TRIM_AFTER = 1 << 20  # bytes dropped in one sweep after which freed heap goes back

    def __init__(self, period: float, patience: float,
                 claimable: Any = None, on_drop: Any = None, budget: int = 32 << 20,
                 allowance: Any = None) -> None:
        self.period, self.patience, self.budget = period, patience, budget
        # Heap the daemon itself grew by for what tenants hold (their buffers,
        # blocks, sessions and half-received frames, each bounded by its own
        # quota): not the unexpected queue's, so it moves the bar up.
        self._allowance = allowance or (lambda: 0)
        self._claimable = claimable or (lambda since: False)
        self._on_drop = on_drop or (lambda count, nbytes: None)
        self._ep: Any = None
        self._scratch: Any = None
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0  # messages dropped so far (``stats``)
        self.pressed = 0  # sweeps the byte budget brought forward
        self._unreported = [0, 0]  # (messages, bytes) dropped, not yet told on_drop
        self._told = 0.0  # when on_drop was last told (under pressure: once a period)
        self._sentinels: set[int] = set()  # sent, not yet swept
        self._sent: collections.deque[tuple[int, float]] = collections.deque()  # (tag, when)
        self._recent: dict[int, None] = {}  # the last RECORD tags dropped, oldest first

    def over_budget(self, anon: int, ref: int) -> bool:
        """Whether anonymous memory ``anon`` is past the bar: what it was at
        the start (``ref``), the daemon's own growth and the budget."""
        grown = anon - ref
        # The allowance is asked only past the budget: not every tick's work.
        return grown > self.budget and grown - self._allowance() > self.budget

    def was_dropped(self, tag: int) -> bool:
        """Whether a message of UCX tag ``tag`` was dropped (forgotten once asked)."""
        if tag in self._recent:
            del self._recent[tag]
            return True
        return False

    def _note(self, tag: int) -> None:
        recent = self._recent
        recent[tag] = None
        if len(recent) > self.RECORD:
            del recent[next(iter(recent))]

    async def start(self) -> bool:
        """Connect to our own worker and start; False (logged) if UCX
        cannot make that endpoint: unexpected messages are then unbounded."""
        mod = ucxx()
        try:
            async with asyncio.timeout(10):
                with busy():
                    self._ep = await mod.create_endpoint_from_worker_address(
                        mod.get_worker_address())
        except Exception as exc:
            _log.warning("UCX janitor off (no endpoint to our own worker: %s): tagged messages "
                         "nobody asked for are kept until a receive matches them", exc)
            return False
        self._task = asyncio.get_running_loop().create_task(self._run())
        return True

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # Bounded: a shutdown never waits on the janitor (it holds nothing).
            await asyncio.wait([task], timeout=2.0)
            if not task.done():
                _log.warning("UCX janitor did not stop within 2 s: left behind")
        ep, self._ep = self._ep, None
        if ep is not None:
            with contextlib.suppress(Exception):
                ep.abort()

    async def _mark(self) -> None:
        """Send ourselves a sentinel (``_sent``, oldest first, with its time)."""
        sentinel = int.from_bytes(os.urandom(8), "little")
        self._sentinels.add(sentinel)
        self._sent.append((sentinel, time.monotonic()))
        with busy():
            await self._ep.send(np.zeros(1, dtype=np.uint8), tag=sentinel, force_tag=True)

    async def _idle(self, activity: Activity) -> None:
        """The wait between two looks: a tick while UCX is at work; once it has
        been quiet ``QUIET`` seconds, until it works again or a round is due (an
        idle daemon wakes once a period)."""
        now = time.monotonic()
        due = self._sent[0][1] + self.period - now if self._sent else 0.0
        if now - activity.last < self.QUIET or due <= self.TICK:
            await asyncio.sleep(self.TICK)
            return
        activity.woken.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(activity.woken.wait(), due)

    async def _run(self) -> None:
        ref = _anon()  # what the daemon held before any peer sent anything
        activity = progress.activity()
        try:
            await self._mark()
            while True:
                await self._idle(activity)
                anon = _anon()
                if ref is not None and anon is not None and self.over_budget(anon, ref):
                    # Bytes first: everything a tick old goes, deferring for no one.
                    await self._mark()
                    self.pressed += 1
                    await self._sweep_to(self._sent[-2][0], trim=True)
                    continue
                oldest, since = self._sent[0]
                waited = time.monotonic() - since
                if waited >= self.period and (waited >= self.period + self.patience or
                                              not self._claimable(since)):
                    await self._mark()  # the next round's
                    await self._sweep_to(oldest, trim=False)
        except Exception as exc:  # our own endpoint broke: nothing more to do
            _log.warning("UCX janitor stopped: %s", exc)

    async def _sweep_to(self, sentinel: int, trim: bool) -> None:
        while self._sent and self._sent[0][0] != sentinel:
            self._sent.popleft()
        if self._sent:
            self._sent.popleft()
        try:
            # Under pressure, bigger steps: between them UCX reads more off its sockets.
            count, nbytes = await self.sweep(sentinel, self.PRESSED_BATCH if trim else 256)
        except Exception:  # a bug: say so, keep the daemon serving, try next round
            _log.exception("UCX janitor: a sweep failed")
            return
        self.dropped += count
        told = self._unreported
        told[0] += count
        told[1] += nbytes
        now = time.monotonic()
        if told[0] and (not trim or now - self._told >= self.period):
            self._on_drop(*told)  # (one log line a period under pressure, not one a tick)
            self._unreported, self._told = [0, 0], now
        if nbytes >= self.TRIM_AFTER or (trim and nbytes):
            await asyncio.to_thread(_trim)

    async def sweep(self, sentinel: int, batch: int = 256) -> tuple[int, int]:
        """Drop every unexpected message ahead of ``sentinel`` (oldest
        first), then the sentinel; (messages, bytes) dropped, our own
        earlier sentinels not counted."""
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMask

        worker = ucxx().core._get_ctx().worker
        if self._scratch is None:  # one for good: a receive that outlives its wait may write it
            self._scratch = Array(np.zeros(1, dtype=np.uint8))
        scratch, anything, sentinels = self._scratch, (Tag(0), TagMask(0)), self._sentinels
        probe, take, note = worker.tag_probe, worker.tag_recv_with_handle, self._note
        count = nbytes = 0
        while True:
            for _ in range(batch):  # then let the loop breathe (and UCX take in more)
                got = probe(*anything, remove=True)  # the oldest
                if not got.matched:
                    return count, nbytes  # nothing at all, not even the sentinel: a race
                tag = int(got.sender_tag.value)
                req = take(scratch, got)
                if not req.completed:
                    with contextlib.suppress(Exception), busy():
                        # Truncated, as meant: what matters is that it left the queue.  An
                        # eager message ends at once; a rendezvous one once its sender hears.
                        await asyncio.wait_for(req.wait(), 5.0)
                if tag in sentinels:
                    sentinels.discard(tag)
                    if tag == sentinel:
                        return count, nbytes
                    continue
                note(tag)
                count += 1
                nbytes += int(got.length)
            await asyncio.sleep(0)


def _anon() -> int | None:
    """This process's anonymous resident bytes (RssAnon; None off Linux)."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) << 10
    except OSError:
        pass
    return None


_libc: Any = None


def _trim() -> None:
    """Give the heap's free pages back to the kernel (glibc's ``malloc_trim``):
    UCP's copies of unexpected messages are malloc'ed."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        _libc = ctypes.CDLL(name) if name else False
    if _libc and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)
