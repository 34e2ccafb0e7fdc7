"""Arenas: one address range of memory per device, its blocks backed one
buffer at a time, handed out as views.

The daemon sees every arena through one protocol, ``Arena`` (``HostArena``
here, ``cuda_arena.CudaArena`` for a GPU): its device and ``size``,
``view``, ``checksum``/``checksums``, ``describe``, and the backing of each
block the registry hands out (``back``, ``unback``, ``export``).  What only
host memory does is ``HostArena``'s own components, reached through
``host_memory``.  ``view`` returns a zero-copy array over ``[offset, offset
+ nbytes)`` that UCX receives into or sends from directly; bounds are
checked here as the last line of defence, even though the daemon checks
them before any transfer.
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
    """What every arena is (``HostArena``, ``cuda_arena.CudaArena``): its
    device, its views and checksums, and the backing of each block the
    registry hands out.  What only host memory does (kept blocks, clones,
    pre-faulting) is ``HostArena``'s own components (``kept``, ``clones``,
    ``prefault``): ``host_memory`` says whether an arena has them, and the
    type checker then checks every use."""

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
    """Host (CPU) memory: one reserved address range, and in it one memfd
    per buffer (``back`` when the buffer is allocated, ``unback`` when it is
    freed), so exactly one buffer's bytes can be handed out by handle
    (``export``: a read-only fd) and nothing else of the arena.  The daemon
    maps each memfd read-write and then seals it read-only (``shm``): every
    handle it ever gives away is read-only by construction, while its own
    mapping, made before the seal, keeps writing.  Memory outside any buffer
    is unbacked anonymous memory, or a *kept* block.  Offsets and block
    sizes are multiples of ``granularity`` (the page size), which the
    allocator is told.

    What only host memory does is three components of its own, each typed
    (callers reach them through ``host_memory``):

    * ``kept`` (``kept.KeptBlocks``): a freed block whose memfd never left
      the daemon stays backed, zeroed, for the next ``back`` of the same
      block (up to ``kept.limit`` bytes: the daemon's ``--keep-freed``);
    * ``clones`` (``clones.Clones``): a block mapping another block's memfd
      (``share``), and memory of its own before it is written;
    * ``prefault`` (``prefault.Prefault``): a new buffer's pages backed
      before its first write.

    The live blocks are one table (``backed.BackedBlocks``) that the arena
    and its clones share."""

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
        """Give ``[offset, offset + nbytes)`` (a fresh block) its own memfd,
        mapped here read-write, then sealed read-only for everyone else; or
        the kept memfd of exactly that block (``kept.take``).  None: its
        bytes are all zero now.  A ``Zeroing``: a kept block still being
        zeroed, which nothing may read or write before its ``then`` callback
        (the caller locks the buffer until then: ``Registry``).  ValueError:
        not whole pages of this arena; OSError: no memory or fds left."""
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
        """``back`` for memory its owning tenant writes in place (a block
        segment, ``export_writable``): always a fresh memfd, sealed only
        against resizing, never a kept one (those are sealed read-only), and
        never kept once freed (a writable mapping of it may outlive it)."""
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
        """The block goes back to unbacked anonymous memory, its memfd's pages
        freed once no reader maps them any more (a shared one: with its last
        block, ``clones.release``); or, never exported, it is kept for the
        next ``back`` of the same block, zeroed first (``kept.keep``)."""
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
        """A new read-only fd of the buffer at ``offset`` (exactly its block);
        the caller closes it.  From then on its memfd is never kept."""
        fd = self._blocks.fd_of(offset, nbytes)
        self._exported.add(offset)
        return shm.read_only_fd(fd)

    def export_writable(self, offset: int, nbytes: int) -> int:
        """A new read-write fd of the block at ``offset``, which must have
        been backed by ``back_owned`` (anything else is sealed read-only:
        RuntimeError, a bug); the caller closes it."""
        if offset not in self._owned:
            raise RuntimeError(f"block {offset} is not writable by its owner")  # a bug
        fd = self._blocks.fd_of(offset, nbytes)
        self._exported.add(offset)
        return shm.writable_fd(fd)

    def make_writable(self, offset: int, nbytes: int, zero: bool = False) -> bool:
        """Give the live block at ``offset`` a memfd its owner may map
        writable (a buffer written in place): a fresh one holding its bytes,
        sealed only against resizing, mapped here in place of the read-only
        one (which readers that still map it keep, unchanged).  From then
        on it is never kept once freed (a writable mapping may outlive it).
        ``zero``: its bytes are all zero (never written since it was
        backed), so the fresh memfd needs no copy.  False: it was writable
        already.  The caller holds the buffer's whole-range lock, and the
        block shares no memfd (``clones.needs_own``)."""
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
        """The reverse, for a block about to be handed out read-only: its
        memfd sealed read-only now (``F_SEAL_FUTURE_WRITE``; no copy): no
        new writable mapping or ``write`` from here on.  A writable mapping
        made before keeps writing, which only a client that broke the grant
        protocol does (docs/dataplane.md).  False: it was read-only already."""
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
        """How many blocks are backed now (buffers' and clones')."""
        return len(self._blocks)

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
    """This machine's memory (MemTotal), or None where it cannot be read:
    host arenas reserve address space, so nothing stops their sum passing it
    (``rpcbufd`` warns at start, ``rpcbuf doctor`` from ``stats``).  Read
    once: it does not change, and every ``stats`` answer carries it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None
