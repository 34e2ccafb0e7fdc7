"""Backing a new host buffer with memory before it is handed out.

The first write into a page of never-touched host memory faults: the kernel
finds a page, zeroes it and maps it, and on a virtual machine the host may
have to back it first.  Measured on the 2-core development VM that costs
0.3-1.8 s per GiB, paid inside the first store into the buffer, which then
ran at a fraction of a warm store's speed (docs/performance.md, "Cold
memory").  Pre-faulting in a thread alongside the transfer gained nothing
there (both cores are busy moving bytes, and the faults cost the same CPU
wherever they are taken), so the pages are populated when the buffer is
granted instead: ``populate`` runs ``HostArena.prefault.populate``
(``MADV_POPULATE_WRITE``: no byte changes) in worker threads, one per CPU
(``workers``), ``CHUNK`` at a time, as jobs of the requester's tenant on
the daemon's ``sweeps`` threads (``copypool``: fair between tenants), and
``request_buffer`` answers when it is done; the first store then runs at
warm speed.  The request pays what the store would have, no more.  A block
kept from an earlier buffer (``HostArena.kept.resident``: zeroed, so every page
backed) is not populated again: that walk alone is 64-126 ms per GiB here.

Bounded: buffers under ``MIN_BYTES`` are answered at once (their faults
are cheap), unless the daemon runs with ``--prefault``; at most ``BUDGET``
seconds are spent per request (the client's call timeout is longer), after
which the rest faults in as it is written.  Arenas
that are not host memory (GPU: ``host_memory`` is None) and kernels without
``MADV_POPULATE_WRITE`` skip it.  The buffer is pinned meanwhile by the caller, and a request
cancelled meanwhile waits for its workers' current chunks before it returns,
so nothing touches the memory after its request ended.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable

from rpcbuf.control.daemon.accounting.copypool import CopyPool
from rpcbuf.dataplane.arena import Arena, host_memory

log = logging.getLogger("rpcbuf.daemon")
MIN_BYTES = 8 << 20
CHUNK = 64 << 20
BUDGET = 5.0  # seconds per request
THREADS = 4  # the most workers one request uses


def wanted(arena: Arena, nbytes: int, offset: int | None = None) -> bool:
    """Whether a new buffer of ``nbytes`` in ``arena`` (at ``offset``, when
    known) is worth populating: host memory only, and a big buffer or
    every one (``--prefault``: ``prefault.always``), but never a block kept
    backed (``kept.resident``)."""
    host = host_memory(arena)
    if host is None:
        return False
    if offset is not None and host.kept.resident(offset):
        return False
    return nbytes >= MIN_BYTES or host.prefault.always


class _Chunks:
    """The chunks of one request, handed out in order to its workers."""

    def __init__(self, nbytes: int) -> None:
        self._nbytes, self._next = nbytes, 0
        self._lock = threading.Lock()

    def take(self) -> tuple[int, int] | None:
        with self._lock:
            at = self._next
            if at >= self._nbytes:
                return None
            n = min(CHUNK, self._nbytes - at)
            self._next = at + n
            return at, n


def _run(fault: Callable[[int, int], bool], offset: int, chunks: _Chunks, stop: threading.Event,
         deadline: float) -> int:
    """Populate chunks of ``offset + [0, nbytes)`` until none is left,
    ``stop`` or the deadline; the bytes this worker populated."""
    done = 0
    while not stop.is_set() and time.monotonic() < deadline:
        got = chunks.take()
        if got is None:
            break
        at, n = got
        if not fault(offset + at, n):
            stop.set()  # this kernel lacks MADV_POPULATE_WRITE: the others stop too
            break
        done += n
    return done


def workers(nbytes: int) -> int:
    """How many threads populate a buffer of ``nbytes``: one per CPU this
    process may use (the faults of one buffer run in parallel: 1 GiB took
    0.87-1.1 s in one thread and 0.58-0.77 s in two on the 2-core VM), at
    most ``THREADS``, never more than its chunks."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(THREADS, cpus, -(-nbytes // CHUNK)))


async def populate(arena: Arena, offset: int, nbytes: int, sweeps: CopyPool, tenant: str,
                   budget: float = BUDGET) -> int:
    """Back ``[offset, offset + nbytes)`` of ``arena`` with memory, in
    worker threads (``workers`` jobs of ``tenant`` on ``sweeps``; see the
    module docstring); returns the bytes populated.  A failure of the
    kernel call is logged, never raised: it only costs speed later."""
    host = host_memory(arena)
    if host is None or not wanted(arena, nbytes, offset):
        return 0
    stop = threading.Event()
    chunks, deadline = _Chunks(nbytes), time.monotonic() + budget
    jobs = [asyncio.ensure_future(sweeps.run(tenant, _run, host.prefault.populate, offset,
                                             chunks, stop, deadline))
            for _ in range(workers(nbytes))]
    try:
        done = sum(await asyncio.shield(asyncio.gather(*jobs)))
    except OSError as exc:
        stop.set()
        await asyncio.wait(jobs)  # the others' current chunks, then they stop
        log.warning("pre-faulting a new buffer failed: %s", exc)
        return 0
    except BaseException:
        stop.set()
        await asyncio.wait(jobs)  # their current chunks, then they stop
        raise
    if done < nbytes:
        log.info("pre-faulted %d of a new buffer's %d bytes within %.1f s", done, nbytes,
                 budget)
    return int(done)
