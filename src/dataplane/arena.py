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

from dataplane import shm
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
    """Host (CPU) memory: one reserved address range, and in it one memfd
    per buffer (``back`` when the buffer is allocated, ``unback`` when it is
    freed), so exactly one buffer's bytes can be handed out by handle
    (``export``: a read-only fd) and nothing else of the arena.  The daemon
    maps each memfd read-write and then seals it read-only (``shm``): every
    handle it ever gives away is read-only by construction, while its own
    mapping, made before the seal, keeps writing.  Memory outside any buffer
    is unbacked anonymous memory.  Offsets and block sizes are multiples of
    ``granularity`` (the page size), which the allocator is told."""

    device_type = "CPU"
    granularity = shm.PAGE
    prefault = False  # ``--prefault``: each new buffer's pages are populated (``prefault_range``)

    def __init__(self, size: int, device: int = 0) -> None:
        if size <= 0:
            raise ValueError("arena size must be positive")
        self.size = size
        self.device = device
        span = -(-size // self.granularity) * self.granularity
        self._map = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                              | shm.MAP_NORESERVE)
        self._mem = np.frombuffer(self._map, dtype=np.uint8, count=size)
        self._bytes = self._mem.data  # a memoryview: slicing it is cheaper than numpy views
        self.address = int(self._mem.ctypes.data)
        self._fds: dict[int, tuple[int, int]] = {}  # offset -> (memfd, nbytes)

    def back(self, offset: int, nbytes: int) -> None:
        """Give ``[offset, offset + nbytes)`` (a fresh block) its own memfd,
        mapped here read-write, then sealed read-only for everyone else."""
        g = self.granularity
        if offset % g or nbytes % g or nbytes <= 0 or offset + nbytes > len(self._map):
            raise ValueError(f"[{offset}, +{nbytes}) is not whole pages of this arena")
        if offset in self._fds:
            raise RuntimeError(f"block {offset} is backed already")  # a bug: say so
        fd = shm.memfd(nbytes, "rpcbuf-buffer")
        try:
            shm.map_fixed(self.address + offset, nbytes, fd)
            shm.seal_read_only(fd)
        except BaseException:
            os.close(fd)
            shm.map_anonymous(self.address + offset, nbytes)
            raise
        self._fds[offset] = (fd, nbytes)

    def unback(self, offset: int, nbytes: int) -> None:
        """The block goes back to unbacked anonymous memory; its memfd's pages
        are freed once no reader maps them any more."""
        fd, backed = self._fds[offset]
        if backed != nbytes:
            raise RuntimeError(f"block {offset} was backed with {backed} bytes, not {nbytes}")
        del self._fds[offset]
        shm.map_anonymous(self.address + offset, nbytes)
        os.close(fd)

    def export(self, offset: int, nbytes: int) -> int:
        """A new read-only fd of the buffer at ``offset`` (exactly its block);
        the caller closes it."""
        got = self._fds.get(offset)
        if got is None or got[1] != nbytes:
            raise ValueError(f"[{offset}, +{nbytes}) is not one backed block")
        return shm.read_only_fd(got[0])

    @property
    def backed(self) -> int:
        return len(self._fds)

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

    def prefault_range(self, offset: int, nbytes: int) -> bool:
        """Back the whole pages inside ``[offset, offset + nbytes)`` (a new
        buffer) with memory now (``MADV_POPULATE_WRITE``), so a first write
        does not fault; bytes unchanged.  False when the
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
