"""The one table of a host arena's live blocks (offset -> memfd, size), shared by the
arena and its clones so both check a block the same way (``fd_of``). No system calls.
"""

from __future__ import annotations


class BackedBlocks:
    """The live blocks of ``[address, address + span)``, each a multiple of ``granularity``."""

    __slots__ = ("_fds", "address", "granularity", "span")

    def __init__(self, address: int, span: int, granularity: int) -> None:
        self.address, self.span, self.granularity = address, span, granularity
        self._fds: dict[int, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self._fds)

    def __contains__(self, offset: int) -> bool:
        return offset in self._fds

    def get(self, offset: int) -> tuple[int, int] | None:
        return self._fds.get(offset)

    def fd_of(self, offset: int, nbytes: int) -> int:
        """The memfd of the block at ``offset``, of exactly ``nbytes``; else ValueError."""
        got = self._fds.get(offset)
        if got is None or got[1] != nbytes:
            raise ValueError(f"[{offset}, +{nbytes}) is not one backed block")
        return got[0]

    def put(self, offset: int, fd: int, nbytes: int) -> None:
        self._fds[offset] = (fd, nbytes)

    def swap(self, offset: int, fd: int) -> int:
        """The block maps ``fd`` now (KeyError: none); the memfd it mapped before."""
        old, nbytes = self._fds[offset]
        self._fds[offset] = (fd, nbytes)
        return old

    def remove(self, offset: int, nbytes: int) -> int:
        """Forget the block; its memfd. KeyError: none; RuntimeError (unchanged): wrong size."""
        fd, backed = self._fds[offset]
        if backed != nbytes:
            raise RuntimeError(f"block {offset} was backed with {backed} bytes, not {nbytes}")
        del self._fds[offset]
        return fd
