"""Copy-on-write clones of host blocks: two buffers, one memfd.

A free block may map a backed block's memfd (``share``: the same pages, no copy).
The memfd is sealed, so that mapping is private: a write before the clone has
memory of its own would never reach the source (a safety net: the daemon gives
it its own first, ``copy_out`` then ``adopt``). A shared memfd closes with the
last block mapping it and is never kept for reuse.
"""

from __future__ import annotations

import os

from rpcbuf.dataplane import shm
from rpcbuf.dataplane.backed import BackedBlocks
from rpcbuf.dataplane.kept import KeptBlocks


class Clones:
    """The shared memfds among the arena's live ``blocks``; a clone drops any kept block
    under it."""

    def __init__(self, blocks: BackedBlocks, kept: KeptBlocks, memory: memoryview) -> None:
        self._blocks, self._kept, self._bytes = blocks, kept, memory
        self._holders: dict[int, int] = {}  # memfd -> blocks mapping it, for shared memfds
        self._borrowed: set[int] = set()  # blocks mapping another block's memfd (``share``)

    def share(self, src: int, dst: int, nbytes: int) -> None:
        """Back the free block at ``dst`` with the memfd of the block at ``src``, mapped
        private. ValueError: ``src`` not one backed block of ``nbytes``, or ``dst`` not free."""
        blocks = self._blocks
        fd = blocks.fd_of(src, nbytes)
        if dst in blocks or dst % blocks.granularity or dst + nbytes > blocks.span:
            raise ValueError(f"[{dst}, +{nbytes}) is not a free block of this arena")
        self._kept.drop_overlapping(dst, nbytes)
        shm.map_private(blocks.address + dst, nbytes, fd)
        blocks.put(dst, fd, nbytes)
        self._holders[fd] = self._holders.get(fd, 1) + 1
        self._borrowed.add(dst)

    def needs_own(self, offset: int) -> bool:
        """Whether the block must get memory of its own before it is written."""
        if offset in self._borrowed:
            return True
        got = self._blocks.get(offset)
        return got is not None and self._holders.get(got[0], 1) > 1

    def same_memory(self, a: int, b: int) -> bool:
        """Whether blocks ``a`` and ``b`` map the same memfd (the same bytes, neither written)."""
        fa, fb = self._blocks.get(a), self._blocks.get(b)
        return fa is not None and fb is not None and fa[0] == fb[0]

    def copy_out(self, offset: int, nbytes: int) -> int:
        """A new sealed memfd holding the block's bytes, mapped at its place (safe in a
        worker while the caller keeps the block unwritten and unfreed); ``adopt`` it next.
        ValueError: not one backed block; OSError: no memory or fds."""
        self._blocks.fd_of(offset, nbytes)
        return shm.memfd_at(self._blocks.address + offset, nbytes, "rpcbuf-buffer",
                            self._bytes[offset:offset + nbytes])

    def adopt(self, offset: int, fd: int) -> None:
        """The block now has ``copy_out``'s memfd; the shared one closes with its last block."""
        old = self._blocks.swap(offset, fd)
        self._borrowed.discard(offset)
        self._let_go(old)

    def release(self, offset: int, fd: int, nbytes: int) -> bool:
        """For ``unback``: True when ``fd`` is shared and the block is unbacked now; False:
        nothing to do here."""
        self._borrowed.discard(offset)
        if fd not in self._holders:
            return False
        shm.map_anonymous(self._blocks.address + offset, nbytes)
        self._let_go(fd)
        return True

    def _let_go(self, fd: int) -> None:
        """One block no longer maps the shared ``fd``: closed with the last (a lone one keeps
        its count of 1, so its own ``unback`` closes it and never keeps it)."""
        holders = self._holders.get(fd, 1)
        if holders > 1:
            self._holders[fd] = holders - 1
        else:
            self._holders.pop(fd, None)
            os.close(fd)
