"""Pre-faulting host memory: ``populate`` backs a range's whole pages with memory
first, bytes unchanged (``MADV_POPULATE_WRITE``, Linux 5.14+). When and how much
is the daemon's policy.
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
    """Populating a host arena's bytes; ``mapping`` is held so a worker never runs on
    unmapped memory. ``always`` (``--prefault``): every new buffer, not only large ones."""

    def __init__(self, address: int, size: int, mapping: object) -> None:
        self.always = False
        self._address, self._size, self._mapping = address, size, mapping

    def populate(self, offset: int, nbytes: int) -> bool:
        """Back the whole pages of the range now. False: the kernel lacks the madvise;
        IndexError outside the arena; OSError otherwise."""
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
    """``madvise(MADV_POPULATE_WRITE)``: 0, or -1 (``ctypes.get_errno()`` says why)."""
    return int(_libc.madvise(addr, length, MADV_POPULATE_WRITE))
