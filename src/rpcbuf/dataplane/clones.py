"""Copy-on-write clones of host blocks: two buffers, one memfd (``Clones``,
a ``HostArena``'s ``clones``).

A free block may map the memfd of a backed one (``share``: a clone, the
same pages, no copy).  The memfd is sealed, so that mapping is private: were
it ever written before it has memory of its own, the write would stay in
this process's copy of the page and never reach the source (a safety net;
the daemon gives it memory of its own before any write: ``needs_own``, then
``copy_out`` and ``adopt``).  The blocks mapping each shared memfd are
counted and the memfd is closed with the last of them (``release``, from
``HostArena.unback``); a shared memfd is never kept for reuse.
"""

from __future__ import annotations

import os

from rpcbuf.dataplane import shm
from rpcbuf.dataplane.backed import BackedBlocks
from rpcbuf.dataplane.kept import KeptBlocks


class Clones:
    """The shared memfds among ``blocks`` (the arena's live blocks, whose
    bytes ``memory`` is); a clone's block drops any ``kept`` block under it."""

    def __init__(self, blocks: BackedBlocks, kept: KeptBlocks, memory: memoryview) -> None:
        self._blocks, self._kept, self._bytes = blocks, kept, memory
        self._holders: dict[int, int] = {}  # memfd -> blocks mapping it, for shared memfds
        self._borrowed: set[int] = set()  # blocks mapping another block's memfd (``share``)

    def share(self, src: int, dst: int, nbytes: int) -> None:
        """Back the free block ``[dst, dst + nbytes)`` with the memfd of the
        backed block at ``src`` (a clone: the same pages, no copy), mapped
        private (see the module docstring).  ValueError: ``src`` is not one
        backed block of ``nbytes``, or ``dst`` not a free block."""
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
        """Whether the block at ``offset`` must get memory of its own
        (``copy_out``, ``adopt``) before it is written: it maps another
        block's memfd, or another block maps its own."""
        if offset in self._borrowed:
            return True
        got = self._blocks.get(offset)
        return got is not None and self._holders.get(got[0], 1) > 1

    def same_memory(self, a: int, b: int) -> bool:
        """Whether the blocks at ``a`` and ``b`` map the same memfd (a clone
        and its source, neither written since: the same bytes at the same
        offsets)."""
        fa, fb = self._blocks.get(a), self._blocks.get(b)
        return fa is not None and fb is not None and fa[0] == fb[0]

    def copy_out(self, offset: int, nbytes: int) -> int:
        """A new sealed memfd holding the block's bytes, mapped at its place
        (the first half of giving it memory of its own: safe in a worker
        thread while the caller keeps the block from being written or
        freed); ``adopt`` it next.  ValueError: not one backed block of
        ``nbytes``; OSError: no memory or fds."""
        self._blocks.fd_of(offset, nbytes)
        return shm.memfd_at(self._blocks.address + offset, nbytes, "rpcbuf-buffer",
                            self._bytes[offset:offset + nbytes])

    def adopt(self, offset: int, fd: int) -> None:
        """The block at ``offset`` now has the memfd ``fd`` (``copy_out``'s)
        of its own; the memfd it shared is closed with its last block."""
        old = self._blocks.swap(offset, fd)
        self._borrowed.discard(offset)
        self._let_go(old)

    def release(self, offset: int, fd: int, nbytes: int) -> bool:
        """For ``HostArena.unback`` of the block at ``offset`` (mapping
        ``fd``, forgotten by the arena already): True when ``fd`` is shared,
        and the block is unbacked now (back to anonymous memory, the memfd
        closed with its last block); False: nothing to do here."""
        self._borrowed.discard(offset)
        if fd not in self._holders:
            return False
        shm.map_anonymous(self._blocks.address + offset, nbytes)
        self._let_go(fd)
        return True

    def _let_go(self, fd: int) -> None:
        """One block no longer maps the shared memfd ``fd``: closed with the
        last (a last one left keeps its count of 1, so that its ``unback``
        closes it too and never keeps it)."""
        holders = self._holders.get(fd, 1)
        if holders > 1:
            self._holders[fd] = holders - 1
        else:
            self._holders.pop(fd, None)
            os.close(fd)
