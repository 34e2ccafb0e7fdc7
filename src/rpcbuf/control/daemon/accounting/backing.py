"""How a new buffer gets its memory, beyond the allocator's offset: a block
the host arena keeps backed (``kept_block``), locked until it is zero
(``lock_until_zeroed``), or a clone's shared pages (``share_of``).  Used
by ``Registry._allocate``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rpcbuf.control.daemon.accounting.buffers import Buffer, Pool
from rpcbuf.dataplane.arena import host_memory


def lock_until_zeroed(buf: Buffer, zeroing: Any) -> None:
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


def share_of(arena: Any, src: Buffer, offset: int, nbytes: int) -> None:
    """``back`` for a clone of ``src``: map its memory at ``offset``."""
    if nbytes != src.alloc_size:
        raise RuntimeError(f"a clone of {src.alloc_size} bytes got a block of {nbytes}")
    arena.share(src.offset, offset, nbytes)


def kept_block(pool: Pool, size: int) -> int | None:
    """A free block whose memory the arena keeps backed (``HostArena.keep``),
    taken from the allocator, when it can take a given block; else None."""
    at = getattr(pool.allocator, "allocate_at", None)
    host = host_memory(pool.arena)
    if at is None or host is None:
        return None
    offset = host.kept_block(pool.allocator.block_size(size))
    if offset is None or not at(offset, size):
        return None
    return int(offset)
