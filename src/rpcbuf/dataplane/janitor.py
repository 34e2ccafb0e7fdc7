"""The janitor: tagged UCX messages that no request asked for do not stay.

A peer may send tagged messages nobody posts a receive for (a store whose
request was refused before it was drained, or a peer that never said
hello); UCX keeps them in the worker's unexpected queue, in our memory,
for ever.  ``Janitor`` sweeps that queue: see its docstring.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

import numpy as np

from rpcbuf.dataplane.progress import busy
from rpcbuf.dataplane.ucx import ucxx

_log = logging.getLogger("rpcbuf.ucx")


class Janitor:
    """Drops tagged messages that nobody asked for, once they are old.

    UCP keeps every tagged message that arrives before a matching receive is
    posted (worker-wide, its payload included for eager messages) until one
    is: a peer that never authenticated, or a tenant sending with tags no
    request expects, grew a daemon by hundreds of MiB that were never freed.
    Tags cannot be traced to their sender (they are 64-bit values the peer
    chooses), so age is the test.  Every ``period`` seconds the janitor sends
    itself a *sentinel* (a tagged message on an endpoint to its own worker,
    with a fresh random tag); a round later every unexpected message ahead
    of that sentinel has waited at least ``period``, and is received into a
    one-byte scratch buffer and so dropped (an eager message's payload is
    freed; a rendezvous one's never moves), up to the sentinel.

    A legitimate payload waits unexpected only between its arrival and the
    daemon posting its receive: a store's payload travels beside its
    request, and the request may wait for its buffer's lock (another
    request of the same tenant holds it, as long as the transfer deadline).
    So a round is skipped while ``claimable(since)`` says a request
    dispatched before ``since`` is still in flight (its payload might be in
    the queue), but at most ``patience`` seconds in a row (the daemon gives
    one round: no tenant's waiting store holds the sweep off longer): then
    the round drops all the same.  A store whose payload was dropped so
    learns it when it posts its receive: the tags of the last ``RECORD``
    dropped messages are kept (``was_dropped``, asked by ``DataEndpoint``
    in the same loop step as the post), and the store fails with TIMEOUT
    ``payload_dropped`` instead of waiting for the transfer deadline.
    """

    RECORD = 1 << 16  # dropped tags remembered (~6 MiB at most; oldest forgotten first)

    def __init__(self, period: float, patience: float,
                 claimable: Any = None, on_drop: Any = None) -> None:
        self.period, self.patience = period, patience
        self._claimable = claimable or (lambda since: False)
        self._on_drop = on_drop or (lambda count, nbytes: None)
        self._ep: Any = None
        self._scratch: Any = None
        self._task: asyncio.Task[None] | None = None
        self.dropped = 0  # messages dropped so far (``stats``)
        self._recent: dict[int, None] = {}  # the last RECORD tags dropped, oldest first

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

    async def _run(self) -> None:
        while True:
            sentinel = int.from_bytes(os.urandom(8), "little") | 1  # never tag 0 (BIND_TAG)
            marked = time.monotonic()
            try:
                with busy():
                    await self._ep.send(np.zeros(1, dtype=np.uint8), tag=sentinel,
                                        force_tag=True)
            except Exception as exc:  # our own endpoint broke: nothing more to do
                _log.warning("UCX janitor stopped: %s", exc)
                return
            while True:
                await asyncio.sleep(self.period)
                if time.monotonic() - marked >= self.period + self.patience or \
                        not self._claimable(marked):
                    break
            try:
                count, nbytes = await self.sweep(sentinel)
            except Exception:  # a bug: say so, keep the daemon serving, try next round
                _log.exception("UCX janitor: a sweep failed")
                continue
            if count:
                self.dropped += count
                self._on_drop(count, nbytes)

    async def sweep(self, sentinel: int) -> tuple[int, int]:
        """Drop every unexpected message ahead of ``sentinel`` (oldest
        first), then the sentinel; (messages, bytes) dropped."""
        from ucxx._lib.arr import Array
        from ucxx.types import Tag, TagMask

        worker = ucxx().core._get_ctx().worker
        if self._scratch is None:  # one for good: a receive that outlives its wait may write it
            self._scratch = Array(np.zeros(1, dtype=np.uint8))
        scratch = self._scratch
        count = nbytes = 0
        while True:
            for _ in range(256):  # then let the loop breathe
                got = worker.tag_probe(Tag(0), TagMask(0), remove=True)  # the oldest
                if not got.matched:
                    return count, nbytes  # nothing at all, not even the sentinel: a race
                tag = int(got.sender_tag.value)
                req = worker.tag_recv_with_handle(scratch, got)
                with contextlib.suppress(Exception), busy():
                    # Truncated, as meant: what matters is that it left the queue.  An
                    # eager message ends at once; a rendezvous one once its sender hears.
                    await asyncio.wait_for(req.wait(), 5.0)
                if tag == sentinel:
                    return count, nbytes
                self._note(tag)
                count += 1
                nbytes += int(got.length)
            await asyncio.sleep(0)
