"""How a new buffer gets its memory beyond the allocator's offset: a kept block
(locked until zero), or a clone's shared pages. Whoever gets a kept block zeroes
it on demand, so it never waits behind every block kept before it.
"""

from __future__ import annotations

import asyncio

from rpcbuf.control.daemon.accounting.buffers import Buffer, Pool
from rpcbuf.dataplane.arena import Arena, host_memory
from rpcbuf.dataplane.copypool import CopyPool
from rpcbuf.dataplane.zeroer import Zeroing


def lock_until_zeroed(buf: Buffer, zeroing: Zeroing) -> None:
    """Lock all of a new buffer on a not-yet-zero kept block exclusively, before anyone
    can name it, until it is zero (or freed); ``buf.zeroed`` is done then."""
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
    """Zero the rest of ``buf``'s kept block now, as its tenant's job on ``sweeps``
    (the zeroer would take it last). Nobody awaits it; ``buf.zeroed`` says when."""
    host = host_memory(buf.pool.arena)
    if buf.zeroed is None or buf.zeroed.done() or host is None:
        return
    job = sweeps.submit(buf.tenant, host.kept.zero_now, buf.offset)
    job.future.add_done_callback(_retrieved)


def _retrieved(fut: asyncio.Future[object]) -> None:
    if not fut.cancelled():
        fut.exception()  # nobody awaits it: asyncio must not log it as lost


def share_of(arena: Arena, src: Buffer, offset: int, nbytes: int) -> None:
    """``back`` for a clone of ``src``: map its memory at ``offset`` (host memory only)."""
    if nbytes != src.alloc_size:
        raise RuntimeError(f"a clone of {src.alloc_size} bytes got a block of {nbytes}")
    host = host_memory(arena)
    if host is None:
        raise RuntimeError(f"a clone on {src.pool.key}, which is no host memory")  # a bug
    host.clones.share(src.offset, offset, nbytes)


def kept_block(pool: Pool, size: int) -> int | None:
    """A free block the arena keeps backed, taken from the allocator; else None."""
    host = host_memory(pool.arena)
    if host is None:
        return None
    offset = host.kept.newest(pool.allocator.block_size(size))
    if offset is None or not pool.allocator.allocate_at(offset, size):
        return None
    return offset
