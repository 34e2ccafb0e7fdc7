"""Where a host arena lies and which of its blocks are backed.

``BackedBlocks`` is the one table of a ``HostArena``'s live blocks: each
block a buffer holds, by offset, with the memfd mapped there and its size.
The arena adds and removes blocks (``back``, ``unback``) and reads them
(``export``); its clones (``clones.Clones``) add a block that maps another
block's memfd and swap a block's memfd for one of its own.  Both are handed
this table, so each asks the same one and checks a block the same way
(``fd_of``).  Plain bookkeeping: no system call here.
"""

from __future__ import annotations


class BackedBlocks:
    """The live blocks of the range ``[address, address + span)`` reserved
    for one host arena, each a multiple of ``granularity`` (the page size):
    offset -> (memfd, nbytes)."""

    __slots__ = ("_fds", "address", "granularity", "span")

    def __init__(self, address: int, span: int, granularity: int) -> None:
        self.address, self.span, self.granularity = address, span, granularity
        self._fds: dict[int, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._fds)

    def __contains__(self, offset: int) -> bool:
        return offset in self._fds

    def get(self, offset: int) -> tuple[int, int] | None:
        """The block at ``offset`` as (memfd, nbytes), or None."""
        return self._fds.get(offset)

    def fd_of(self, offset: int, nbytes: int) -> int:
        """The memfd of the block at ``offset``, which must be backed and of
        exactly ``nbytes``; ValueError otherwise."""
        got = self._fds.get(offset)
        if got is None or got[1] != nbytes:
            raise ValueError(f"[{offset}, +{nbytes}) is not one backed block")
        return got[0]

    def put(self, offset: int, fd: int, nbytes: int) -> None:
        """The block at ``offset`` is (now) ``nbytes`` mapping ``fd``."""
        self._fds[offset] = (fd, nbytes)

    def swap(self, offset: int, fd: int) -> int:
        """The block at ``offset`` maps ``fd`` now (KeyError: none there);
        the memfd it mapped before."""
        old, nbytes = self._fds[offset]
        self._fds[offset] = (fd, nbytes)
        return old

    def remove(self, offset: int, nbytes: int) -> int:
        """Forget the block at ``offset`` (KeyError: none there; RuntimeError,
        nothing changed: it is not of ``nbytes``); its memfd."""
        fd, backed = self._fds[offset]
        if backed != nbytes:
            raise RuntimeError(f"block {offset} was backed with {backed} bytes, not {nbytes}")
        del self._fds[offset]
        return fd
