"""Arenas: one address range of memory per device, its blocks backed one buffer at
a time, handed out as views. ``view`` is a zero-copy array UCX receives into or
sends from; bounds are checked here as the last line of defence.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from rpcbuf.dataplane import shm
from rpcbuf.dataplane.backed import BackedBlocks
from rpcbuf.dataplane.checksum import xxh3
from rpcbuf.dataplane.clones import Clones
from rpcbuf.dataplane.cuda_arena import copy_device, is_device_arena
from rpcbuf.dataplane.kept import KeptBlocks
from rpcbuf.dataplane.prefault import Prefault
from rpcbuf.dataplane.zeroer import Zeroing

from .checksum import checksum


class Arena(Protocol):
    """What every arena is: its device, views, checksums, and the backing of each block.
    Host-only parts (kept blocks, clones, pre-faulting) are reached through
    ``host_memory``, so the type checker checks every use."""

    device_type: str
    device: int
    size: int
    kind: str  # the pool key's kind: "cpu", "cuda"
    granularity: int  # blocks are multiples of this

    @property
    def address(self) -> int | None: ...  # the first byte's address here (None: device memory)

    def back(self, offset: int, nbytes: int) -> Any: ...
    def unback(self, offset: int, nbytes: int) -> None: ...
    def export(self, offset: int, nbytes: int) -> int: ...

    def view(self, offset: int, nbytes: int) -> Any: ...

    def checksum(self, offset: int, nbytes: int) -> int: ...

    def checksums(self, offsets: Sequence[int] | np.ndarray,
                  sizes: Sequence[int] | np.ndarray) -> list[int]: ...

    def describe(self) -> dict[str, Any]: ...


class HostArena:
    """Host memory: one reserved address range, and in it one memfd per buffer (backed
    on allocation, unbacked on free), so exactly one buffer's bytes can be handed out
    by handle. Each memfd is mapped read-write here, then sealed read-only: every
    handle given away is read-only by construction, while our earlier mapping keeps
    writing. Offsets and sizes are multiples of ``granularity`` (the page size).

    Host-only components: ``kept`` (a freed, never-exported block stays backed and
    zeroed for the next ``back`` of the same block, up to ``--keep-freed``),
    ``clones`` (a block mapping another's memfd until it is written), ``prefault``
    (a new buffer's pages backed before its first write). The live blocks are one
    table the arena and its clones share."""

    device_type = "CPU"
    kind = "cpu"
    granularity = shm.PAGE

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
        self._blocks = BackedBlocks(self.address, span, self.granularity)
        self._exported: set[int] = set()  # offsets of live blocks whose memfd left the daemon
        self._owned: set[int] = set()  # offsets of live blocks their owner may write (segments)
        self.kept = KeptBlocks(self.address, self._map)
        self.clones = Clones(self._blocks, self.kept, self._bytes)
        self.prefault = Prefault(self.address, size, self._map)

    def back(self, offset: int, nbytes: int) -> Zeroing | None:
        """Give a fresh block its own memfd (mapped here, sealed read-only for everyone
        else), or the kept memfd of exactly that block. None: all zero now; a ``Zeroing``:
        nothing may touch it before its ``then`` callback. ValueError: not whole pages;
        OSError: no memory or fds left."""
        g = self.granularity
        if offset % g or nbytes % g or nbytes <= 0 or offset + nbytes > self._blocks.span:
            raise ValueError(f"[{offset}, +{nbytes}) is not whole pages of this arena")
        if offset in self._blocks:
            raise RuntimeError(f"block {offset} is backed already")  # a bug: say so
        taken = self.kept.take(offset, nbytes)
        if taken is not None:
            fd, zeroing = taken
            self._blocks.put(offset, fd, nbytes)
            return zeroing
        try:
            fd = self._new_memfd(offset, nbytes)
        except OSError:
            if not self.kept.drop_all():  # no memory or no fds left: what is kept goes first
                raise
            fd = self._new_memfd(offset, nbytes)
        self._blocks.put(offset, fd, nbytes)
        return None

    def back_owned(self, offset: int, nbytes: int) -> None:
        """``back`` for memory its tenant writes in place: always a fresh memfd sealed only
        against resizing, never kept (a writable mapping may outlive it)."""
        g = self.granularity
        if offset % g or nbytes % g or nbytes <= 0 or offset + nbytes > self._blocks.span:
            raise ValueError(f"[{offset}, +{nbytes}) is not whole pages of this arena")
        if offset in self._blocks:
            raise RuntimeError(f"block {offset} is backed already")  # a bug: say so
        self.kept.drop_overlapping(offset, nbytes)
        try:
            fd = self._new_memfd(offset, nbytes, read_only=False)
        except OSError:
            if not self.kept.drop_all():
                raise
            fd = self._new_memfd(offset, nbytes, read_only=False)
        self._blocks.put(offset, fd, nbytes)
        self._owned.add(offset)

    def _new_memfd(self, offset: int, nbytes: int, read_only: bool = True) -> int:
        try:
            return shm.memfd_at(self.address + offset, nbytes, "rpcbuf-buffer",
                                read_only=read_only)
        except BaseException:
            shm.map_anonymous(self.address + offset, nbytes)  # the block as it was: unbacked
            raise

    def unback(self, offset: int, nbytes: int) -> None:
        """The block goes back to unbacked memory (pages freed once no reader maps them),
        or, never exported, is kept for the next ``back`` of it, zeroed first."""
        fd = self._blocks.remove(offset, nbytes)
        self.kept.freed(offset)
        exported = offset in self._exported or offset in self._owned
        self._exported.discard(offset)
        self._owned.discard(offset)
        if self.clones.release(offset, fd, nbytes):  # a shared memfd is never kept
            return
        if exported or not self.kept.keep(offset, fd, nbytes):
            shm.map_anonymous(self.address + offset, nbytes)
            os.close(fd)

    def export(self, offset: int, nbytes: int) -> int:
        """A new read-only fd of exactly the block at ``offset``; the caller closes it.
        From then on its memfd is never kept."""
        fd = self._blocks.fd_of(offset, nbytes)
        self._exported.add(offset)
        return shm.read_only_fd(fd)

    def export_writable(self, offset: int, nbytes: int) -> int:
        """A new read-write fd of a ``back_owned`` block (else RuntimeError, a bug); the
        caller closes it."""
        if offset not in self._owned:
            raise RuntimeError(f"block {offset} is not writable by its owner")  # a bug
        fd = self._blocks.fd_of(offset, nbytes)
        self._exported.add(offset)
        return shm.writable_fd(fd)

    def make_writable(self, offset: int, nbytes: int, zero: bool = False) -> bool:
        """Give the live block a memfd its owner may map writable: a fresh one holding its
        bytes (no copy when ``zero``), mapped here in place of the read-only one (whose
        readers keep it), never kept once freed. False: writable already. The caller
        holds the whole-range lock, and the block shares no memfd."""
        if offset in self._owned:
            return False
        self._blocks.fd_of(offset, nbytes)  # ValueError: not one live block
        fill = None if zero else self._bytes[offset:offset + nbytes]
        fd = shm.memfd_at(self.address + offset, nbytes, "rpcbuf-buffer", fill=fill,
                          read_only=False, resealable=True)
        os.close(self._blocks.swap(offset, fd))
        self._owned.add(offset)
        self._exported.add(offset)
        return True

    def reseal(self, offset: int, nbytes: int) -> bool:
        """Seal the block's memfd read-only now (``F_SEAL_FUTURE_WRITE``; no copy); a
        mapping made before keeps writing (only a client breaking the grant protocol).
        False: read-only already."""
        if offset not in self._owned:
            return False
        shm.seal_read_only(self._blocks.fd_of(offset, nbytes))
        self._owned.discard(offset)
        return True

    def writable(self, offset: int) -> bool:
        """Whether the block at ``offset`` may be handed out writable."""
        return offset in self._owned

    @property
    def backed(self) -> int:
        return len(self._blocks)

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise IndexError(f"[{offset}, {offset + nbytes}) is outside the arena of {self.size}")
        return self._mem[offset : offset + nbytes]

    def checksum(self, offset: int, nbytes: int) -> int:
        return checksum(self.view(offset, nbytes))

    def checksums(self, offsets: Sequence[int] | np.ndarray,
                  sizes: Sequence[int] | np.ndarray) -> list[int]:
        """xxh3-64 of many ranges, bounds checked at once, the loop in C."""
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


def host_memory(arena: Arena) -> HostArena | None:
    """``arena`` as host memory (kept blocks, clones, pre-faulting), or None."""
    return arena if isinstance(arena, HostArena) else None


def copy_between(src: Arena, src_offset: int, dst: Arena, dst_offset: int, nbytes: int) -> None:
    """Copy bytes between (or within) arenas on this node; overlap-safe."""
    if is_device_arena(src) or is_device_arena(dst):  # a GPU arena on either side
        copy_device(src, src_offset, dst, dst_offset, nbytes)
        return
    np.copyto(dst.view(dst_offset, nbytes), src.view(src_offset, nbytes))


@functools.cache
def host_ram() -> int | None:
    """This machine's MemTotal, or None; read once. Host arenas reserve address space,
    so nothing stops their sum passing it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None
