"""How a new buffer gets its memory, beyond the allocator's offset: a block
the host arena keeps backed (``kept_block``: ``HostArena.kept``), locked
until it is zero (``lock_until_zeroed``), or a clone's shared pages
(``share_of``: ``HostArena.clones``).  Used by ``Registry._allocate``.
Whoever gets such a buffer zeroes it on demand (``zero_on_demand``), so it
never waits behind every block kept before it: ``request_buffer`` and block
puts alike.
"""

from __future__ import annotations

import asyncio

from rpcbuf.control.daemon.accounting.buffers import Buffer, Pool
from rpcbuf.control.daemon.accounting.copypool import CopyPool
from rpcbuf.dataplane.arena import Arena, host_memory
from rpcbuf.dataplane.zeroer import Zeroing


def lock_until_zeroed(buf: Buffer, zeroing: Zeroing) -> None:
    """A new buffer on a kept block that is not all zero yet
    (``HostArena.back``): all of it locked exclusively, before anyone can
    name it, until the block is zero (the arena's zeroer, or its requester:
    ``controlops``), or freed meanwhile; ``buf.zeroed`` is done then.
    Whatever reads or writes it meanwhile (``Pipeline.lock``) waits."""
    grant = buf.locks.acquire([(0, buf.alloc_size)], True)  # a new buffer: granted at once
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    buf.zeroed = done

    def release() -> None:
        buf.locks.release(grant)
        if not done.done():
            done.set_result(None)

    def from_zeroer() -> None:
        try:
            loop.call_soon_threadsafe(release)
        except RuntimeError:  # the loop is closed: the daemon is going away
            pass

    zeroing.then(from_zeroer)


def zero_on_demand(buf: Buffer, sweeps: CopyPool) -> None:
    """A new buffer on a kept block still being zeroed (``buf.zeroed``): the
    rest of its block is zeroed now (``KeptBlocks.zero_now``) as a job of
    its tenant on ``sweeps``, beside the arena's zeroer (each chunk is
    written once).  The zeroer takes kept blocks in the order they were
    kept, and this one, the most recently kept, would come last: behind
    every block other tenants freed before.  Nobody awaits the job (one that
    starts late finds nothing to do); ``buf.zeroed`` says when it is done.
    Nothing to do for any other buffer."""
    host = host_memory(buf.pool.arena)
    if buf.zeroed is None or buf.zeroed.done() or host is None:
        return
    job = sweeps.submit(buf.tenant, host.kept.zero_now, buf.offset)
    job.future.add_done_callback(_retrieved)


def _retrieved(fut: asyncio.Future[object]) -> None:
    if not fut.cancelled():
        fut.exception()  # nobody awaits it: asyncio must not log it as lost


def share_of(arena: Arena, src: Buffer, offset: int, nbytes: int) -> None:
    """``back`` for a clone of ``src``: map its memory at ``offset``
    (``Clones.share``; only host memory shares, which the caller checked)."""
    if nbytes != src.alloc_size:
        raise RuntimeError(f"a clone of {src.alloc_size} bytes got a block of {nbytes}")
    host = host_memory(arena)
    if host is None:
        raise RuntimeError(f"a clone on {src.pool.key}, which is no host memory")  # a bug
    host.clones.share(src.offset, offset, nbytes)


def kept_block(pool: Pool, size: int) -> int | None:
    """A free block whose memory the arena keeps backed (``KeptBlocks``),
    taken from the allocator, when it can take a given block
    (``Allocator.allocate_at``); else None."""
    host = host_memory(pool.arena)
    if host is None:
        return None
    offset = host.kept.newest(pool.allocator.block_size(size))
    if offset is None or not pool.allocator.allocate_at(offset, size):
        return None
    return offset
