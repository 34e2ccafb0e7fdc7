"""Backing a new host buffer with memory before it is handed out.

The first write into an untouched page faults (0.3-1.8 s per GiB on the dev VM),
inside the first store. Pre-faulting beside the transfer gained nothing, so pages
are populated when the buffer is granted (``MADV_POPULATE_WRITE``: no byte
changes), ``CHUNK`` at a time, in one job per CPU of the requester's tenant on the
``sweeps`` threads; the request pays what the store would have.

- Not for buffers under ``MIN_BYTES`` (unless ``--prefault``), not for a kept
  block (resident already), not for GPU arenas or kernels without the madvise.
- At most ``BUDGET`` seconds per request; the rest faults in as written.
- The caller pins the buffer; a cancelled request waits for its workers' current
  chunks, so nothing touches the memory after its request ended.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable

from rpcbuf.dataplane.arena import Arena, host_memory
from rpcbuf.dataplane.copypool import CopyPool

log = logging.getLogger("rpcbuf.daemon")
MIN_BYTES = 8 << 20
CHUNK = 64 << 20
BUDGET = 5.0  # seconds per request
THREADS = 4  # the most workers one request uses


def wanted(arena: Arena, nbytes: int, offset: int | None = None) -> bool:
    """Whether a new buffer is worth populating: host memory, big (or ``--prefault``),
    never a kept block."""
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
    """Populate chunks until none is left, ``stop`` or the deadline; the bytes done."""
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
    """One thread per usable CPU, at most ``THREADS``, never more than its chunks."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(THREADS, cpus, -(-nbytes // CHUNK)))


async def populate(arena: Arena, offset: int, nbytes: int, sweeps: CopyPool, tenant: str,
                   budget: float = BUDGET) -> int:
    """Back ``[offset, offset + nbytes)`` with memory (see the module); the bytes
    populated. A kernel failure is logged, never raised: it only costs speed later."""
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
