"""Arenas: one contiguous block of device memory per device, handed out as views.

The control plane sees only this interface (``size``, ``view``, ``checksum``,
``describe``), so a CuPy-backed GPU arena can be added later without touching
it.  ``view`` returns a zero-copy array over ``[offset, offset + nbytes)`` that
UCX receives into or sends from directly; bounds are checked here as the last
line of defence, even though the daemon checks them before any transfer.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from dataplane.checksum import xxh3

from .checksum import checksum


class Arena(Protocol):
    device_type: str
    device: int
    size: int

    def view(self, offset: int, nbytes: int) -> Any: ...

    def checksum(self, offset: int, nbytes: int) -> int: ...

    def checksums(self, offsets: Sequence[int] | np.ndarray,
                  sizes: Sequence[int] | np.ndarray) -> list[int]: ...

    def describe(self) -> dict[str, Any]: ...


class HostArena:
    """Host (CPU) memory: one NumPy uint8 array, pages touched on first use."""

    device_type = "CPU"

    def __init__(self, size: int, device: int = 0) -> None:
        if size <= 0:
            raise ValueError("arena size must be positive")
        self.size = size
        self.device = device
        self._mem = np.empty(size, dtype=np.uint8)
        self._bytes = self._mem.data  # a memoryview: slicing it is cheaper than numpy views
        self.address = int(self._mem.ctypes.data)  # same-host copies (dataplane/cma.py)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise IndexError(f"[{offset}, {offset + nbytes}) is outside the arena of {self.size}")
        return self._mem[offset : offset + nbytes]

    def checksum(self, offset: int, nbytes: int) -> int:
        return checksum(self.view(offset, nbytes))

    def checksums(self, offsets: Sequence[int] | np.ndarray,
                  sizes: Sequence[int] | np.ndarray) -> list[int]:
        """xxh3-64 of many ranges (a batch's tensors) with little per-item
        overhead: the bounds are checked at once, the loop runs in C (``map``)."""
        offs = np.asarray(offsets, dtype=np.int64)
        lens = np.asarray(sizes, dtype=np.int64)
        if offs.shape != lens.shape or offs.ndim != 1:
            raise ValueError("offsets and sizes must be equally long 1-D sequences")
        if not len(offs):
            return []
        ends = offs + lens
        if offs.min() < 0 or lens.min() < 0 or int(ends.max()) > self.size:
            raise IndexError("a range is outside the arena")
        return list(map(xxh3,
                        map(self._bytes.__getitem__, map(slice, offs.tolist(), ends.tolist()))))

    def describe(self) -> dict[str, Any]:
        return {"device_type": self.device_type, "device": self.device, "name": "host memory"}

    def prefault(self, chunk: int = 64 << 20) -> bool:
        """Back every page with memory now, so a first write does not fault
        (``madvise(MADV_POPULATE_WRITE)``, a chunk at a time).  It changes no
        byte, so it may run in a thread while the arena is in use.  False when
        the kernel lacks it (before Linux 5.14)."""
        start, stop = whole_pages(self._mem.ctypes.data, self.size)
        for at in range(start, stop, chunk):
            if populate_pages(at, min(chunk, stop - at)) != 0:
                err = ctypes.get_errno()
                if err in (22, 38) and at == start:  # EINVAL, ENOSYS: not this kernel
                    return False
                raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
        return True

    def prefault_range(self, offset: int, nbytes: int) -> bool:
        """``prefault`` for the whole pages inside ``[offset, offset + nbytes)``
        (what a buffer is about to receive); bytes unchanged.  False when the
        kernel lacks ``MADV_POPULATE_WRITE``; OSError for another failure."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise IndexError(f"[{offset}, {offset + nbytes}) is outside the arena of {self.size}")
        start, stop = whole_pages(self._mem.ctypes.data + offset, nbytes)
        if stop <= start:
            return True
        if populate_pages(start, stop - start) != 0:
            err = ctypes.get_errno()
            if err in (22, 38):  # EINVAL, ENOSYS: not this kernel
                return False
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE): {os.strerror(err)}")
        return True


MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module gained it only in 3.13
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def whole_pages(addr: int, nbytes: int) -> tuple[int, int]:
    """The pages lying wholly inside ``[addr, addr + nbytes)``, as a range."""
    page = mmap.PAGESIZE
    return -(-addr // page) * page, (addr + nbytes) // page * page


def populate_pages(addr: int, length: int) -> int:
    """``madvise(MADV_POPULATE_WRITE)``: back the pages with memory, bytes
    unchanged.  0, or the call's failure (-1; ``ctypes.get_errno()`` says why)."""
    return int(_libc.madvise(addr, length, MADV_POPULATE_WRITE))


def copy_between(src: Arena, src_offset: int, dst: Arena, dst_offset: int, nbytes: int) -> None:
    """Copy bytes between (or within) arenas on this node; overlap-safe."""
    if hasattr(src, "xp") or hasattr(dst, "xp"):  # a GPU arena on either side
        from .cuda_arena import copy_device

        copy_device(src, src_offset, dst, dst_offset, nbytes)
        return
    np.copyto(dst.view(dst_offset, nbytes), src.view(src_offset, nbytes))
