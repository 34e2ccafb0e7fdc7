"""Pre-faulting host memory (``Prefault``, a ``HostArena``'s ``prefault``).

The first write into a never-touched page faults; ``populate`` backs the
whole pages of a range (a new buffer) with memory first, bytes unchanged
(``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+).  When and how much the
daemon populates (worker threads, a time budget) is its own policy:
``control/daemon/accounting/prefault.py``.
"""

from __future__ import annotations

import ctypes
import mmap
import os

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module gained it only in 3.13
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


class Prefault:
    """Populating ``[address, address + size)``, a host arena's bytes
    (``mapping`` keeps them mapped: held here, so a ``populate`` in a
    worker thread never runs on unmapped memory, whatever became of the
    arena).  ``always`` (the daemon's ``--prefault``): every new buffer is
    populated, not only large ones."""

    def __init__(self, address: int, size: int, mapping: object) -> None:
        self.always = False
        self._address, self._size, self._mapping = address, size, mapping

    def populate(self, offset: int, nbytes: int) -> bool:
        """Back the whole pages inside ``[offset, offset + nbytes)`` (a new
        buffer) with memory now (``MADV_POPULATE_WRITE``), so a first write
        does not fault; bytes unchanged.  False when the kernel lacks
        ``MADV_POPULATE_WRITE``; IndexError outside the arena; OSError for
        another failure."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self._size:
            raise IndexError(f"[{offset}, {offset + nbytes}) is outside the arena of {self._size}")
        start, stop = whole_pages(self._address + offset, nbytes)
        if stop <= start:
            return True
        if populate_pages(start, stop - start) != 0:
            err = ctypes.get_errno()
            if err in (22, 38):  # EINVAL, ENOSYS: not this kernel
                return False
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
        return True


def whole_pages(addr: int, nbytes: int) -> tuple[int, int]:
    """The pages lying wholly inside ``[addr, addr + nbytes)``, as a range."""
    page = mmap.PAGESIZE
    return -(-addr // page) * page, (addr + nbytes) // page * page


def populate_pages(addr: int, length: int) -> int:
    """``madvise(MADV_POPULATE_WRITE)``: back the pages with memory, bytes
    unchanged.  0, or the call's failure (-1; ``ctypes.get_errno()`` says why)."""
    return int(_libc.madvise(addr, length, MADV_POPULATE_WRITE))
