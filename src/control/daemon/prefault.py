"""Backing a new host buffer with memory before it is handed out.

The first write into a page of never-touched host memory faults: the kernel
finds a page, zeroes it and maps it, and on a virtual machine the host may
have to back it first.  Measured on the 2-core development VM that costs
0.3-1.8 s per GiB, paid inside the first store into the buffer, which then
ran at a fraction of a warm store's speed (docs/performance.md, "Cold
memory").  Pre-faulting in a thread alongside the transfer gained nothing
there (both cores are busy moving bytes, and the faults cost the same CPU
wherever they are taken), so the pages are populated when the buffer is
granted instead: ``populate`` runs ``HostArena.prefault_range``
(``MADV_POPULATE_WRITE``: no byte changes) in a worker thread, ``CHUNK`` at
a time, and ``request_buffer`` answers when it is done; the first store
then runs at warm speed.  The request pays what the store would have, no
more (pages already resident cost a page-table walk, about 0.3 ms per GiB
here).

Bounded: buffers under ``MIN_BYTES`` are answered at once (their faults
are cheap), unless the daemon runs with ``--prefault``; at most ``BUDGET``
seconds are spent per request (the client's call timeout is longer), after
which the rest faults in as it is written.  Arenas
without ``prefault_range`` (GPU) and kernels without ``MADV_POPULATE_WRITE``
skip it.  The buffer is pinned meanwhile by the caller, and a request
cancelled meanwhile waits for the worker's current chunk before it returns,
so nothing touches the memory after its request ended.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

log = logging.getLogger("rpcbuf.daemon")
MIN_BYTES = 8 << 20
CHUNK = 64 << 20
BUDGET = 5.0  # seconds per request


def wanted(arena: Any, nbytes: int) -> bool:
    """Whether a new buffer of ``nbytes`` in ``arena`` is worth populating
    (``--prefault``, ``arena.prefault``: every one)."""
    return hasattr(arena, "prefault_range") and (
        nbytes >= MIN_BYTES or bool(getattr(arena, "prefault", False)))


def _run(fault: Any, offset: int, nbytes: int, stop: threading.Event, budget: float) -> int:
    """Populate ``[offset, offset + nbytes)`` a chunk at a time until done,
    ``stop`` or the budget; the bytes populated."""
    deadline = time.monotonic() + budget
    done = 0
    while done < nbytes and not stop.is_set() and time.monotonic() < deadline:
        n = min(CHUNK, nbytes - done)
        if not fault(offset + done, n):
            break  # this kernel lacks MADV_POPULATE_WRITE
        done += n
    return done


async def populate(arena: Any, offset: int, nbytes: int, budget: float = BUDGET) -> int:
    """Back ``[offset, offset + nbytes)`` of ``arena`` with memory, in a
    worker thread (see the module docstring); returns the bytes populated.
    A failure of the kernel call is logged, never raised: it only costs
    speed later."""
    if not wanted(arena, nbytes):
        return 0
    stop = threading.Event()
    job = asyncio.ensure_future(asyncio.to_thread(_run, arena.prefault_range, offset, nbytes,
                                                  stop, budget))
    try:
        done = await asyncio.shield(job)
    except OSError as exc:
        log.warning("pre-faulting a new buffer failed: %s", exc)
        return 0
    except BaseException:
        stop.set()
        await asyncio.wait([job])  # its current chunk, then it stops
        raise
    if done < nbytes:
        log.info("pre-faulted %d of a new buffer's %d bytes within %.1f s", done, nbytes,
                 budget)
    return int(done)
