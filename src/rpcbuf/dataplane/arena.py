"""Arenas: one contiguous block of device memory per device, handed out as views.

The control plane sees only this interface (``size``, ``view``, ``checksum``,
``describe``), so a CuPy-backed GPU arena can be added later without touching
it.  ``view`` returns a zero-copy array over ``[offset, offset + nbytes)`` that
UCX receives into or sends from directly; bounds are checked here as the last
line of defence, even though the daemon checks them before any transfer.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import os
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from rpcbuf.dataplane import shm
from rpcbuf.dataplane.checksum import xxh3
from rpcbuf.dataplane.zeroer import Zeroer as _Zeroer, Zeroing

from .checksum import checksum


class Arena(Protocol):
    """What every arena is (``HostArena``, ``cuda_arena.CudaArena``): its
    device, its views and checksums, and the backing of each block the
    registry hands out.  What only host memory does (kept blocks, clones,
    pre-faulting) is ``HostArena``'s own: ``host_memory`` says whether an
    arena has it, and the type checker then checks every use."""

    device_type: str
    device: int
    size: int
    kind: str  # the pool key's kind: "cpu", "cuda"
    granularity: int  # blocks are multiples of this
    address: int | None  # the first byte's address in this process (None: device memory)

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
    is unbacked anonymous memory, or a *kept* block (``keep``).  Offsets and
    block sizes are multiples of ``granularity`` (the page size), which the
    allocator is told.

    Kept blocks: backing a block costs four system calls and, for a large
    one, the kernel's page faults (about 1 s per GiB on the development VM),
    and unbacking it two calls and the unmapping (0.3 s per GiB).  So a
    freed block whose memfd never left the daemon (never ``export``-ed: no
    reader can hold its fd) stays mapped where it was, up to ``keep`` bytes
    of them, and is zeroed: blocks up to ``ZERO_NOW`` at once, larger ones by
    one background thread, ``ZERO_CHUNK`` at a time under the block's lock,
    in the order they were kept.
    A ``back`` of exactly that block (same offset and size: what the
    allocators hand out again for the same request) takes it over: at once
    when it is all zero, else with its ``Zeroing`` (the caller keeps the new
    buffer locked until it is done).  The zeroer would reach a taken block
    only after every block kept before it (15 released 64 MiB blocks kept
    another tenant's request waiting 106-125 ms), so the taker zeroes the
    rest itself (``zero_now``, in a worker thread of its tenant's share:
    ``controlops``); its chunks and the zeroer's are claimed under the
    block's lock, each written once.  Any other
    ``back`` or ``share`` overlapping a kept block, and the least recently
    kept ones beyond ``keep``, send it back to unbacked memory as before.
    Nothing another tenant wrote survives into a kept block's next buffer,
    and no old handle reaches it."""

    device_type = "CPU"
    kind = "cpu"
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
        self._exported: set[int] = set()  # offsets of live blocks whose memfd left the daemon
        self.keep = 0  # bytes of freed, never-exported blocks kept backed (the daemon sets it)
        self._kept: dict[int, Zeroing] = {}  # offset -> kept block, least recently kept first
        self._zeroing: dict[int, Zeroing] = {}  # live blocks taken over before they were zeroed
        self._kept_at: list[int] = []  # their offsets, sorted (kept blocks never overlap)
        self._kept_sized: dict[int, dict[int, None]] = {}  # size -> offsets, oldest first
        self.kept_bytes = 0
        self.reused = 0  # backs served by a kept block
        self._zeroer: _Zeroer | None = None
        self._resident: set[int] = set()  # live blocks taken over from kept ones: all backed
        self._holders: dict[int, int] = {}  # memfd -> blocks mapping it, for shared memfds
        self._borrowed: set[int] = set()  # blocks mapping another block's memfd (``share``)

    def back(self, offset: int, nbytes: int) -> Zeroing | None:
        """Give ``[offset, offset + nbytes)`` (a fresh block) its own memfd,
        mapped here read-write, then sealed read-only for everyone else; or
        the kept memfd of exactly that block.  None: its bytes are all zero
        now.  A ``Zeroing``: a kept block still being zeroed, which nothing
        may read or write before its ``then`` callback (the caller locks the
        buffer until then: ``Registry``)."""
        g = self.granularity
        if offset % g or nbytes % g or nbytes <= 0 or offset + nbytes > len(self._map):
            raise ValueError(f"[{offset}, +{nbytes}) is not whole pages of this arena")
        if offset in self._fds:
            raise RuntimeError(f"block {offset} is backed already")  # a bug: say so
        if self._kept:
            kept = self._kept.get(offset)
            if kept is not None and kept.nbytes == nbytes:
                return self._take(offset, kept)
            self._drop_overlapping(offset, nbytes)
        try:
            fd = self._new_memfd(offset, nbytes)
        except OSError:
            if not self._kept:
                raise
            self._drop_all()  # no memory or no fds left: what is kept goes first
            fd = self._new_memfd(offset, nbytes)
        self._fds[offset] = (fd, nbytes)
        return None

    def _new_memfd(self, offset: int, nbytes: int) -> int:
        fd = shm.memfd(nbytes, "rpcbuf-buffer")
        try:
            shm.map_fixed(self.address + offset, nbytes, fd)
            shm.seal_read_only(fd)
        except BaseException:
            os.close(fd)
            shm.map_anonymous(self.address + offset, nbytes)
            raise
        return fd

    def unback(self, offset: int, nbytes: int) -> None:
        """The block goes back to unbacked anonymous memory, its memfd's pages
        freed once no reader maps them any more; or, never exported and
        within ``keep``, it is kept for the next ``back`` of the same block,
        zeroed first (see the class docstring)."""
        fd, backed = self._fds[offset]
        if backed != nbytes:
            raise RuntimeError(f"block {offset} was backed with {backed} bytes, not {nbytes}")
        del self._fds[offset]
        self._resident.discard(offset)
        exported = offset in self._exported
        self._exported.discard(offset)
        zeroing = self._zeroing.pop(offset, None)
        if zeroing is not None:  # freed before it was zeroed for its buffer: stop that
            zeroing.stop()
        self._borrowed.discard(offset)
        if fd in self._holders:  # a shared memfd is never kept; closed with its last block
            shm.map_anonymous(self.address + offset, nbytes)
            self._let_go(fd)
            return
        if exported or nbytes > self.keep:
            shm.map_anonymous(self.address + offset, nbytes)
            os.close(fd)
            return
        while self._kept and (self.kept_bytes + nbytes > self.keep
                              or len(self._kept) >= MAX_KEPT):
            old = next(iter(self._kept))  # the least recently kept
            self._drop(old, self._kept[old])
        kept = Zeroing(fd, nbytes)
        self._kept[offset] = kept
        bisect.insort(self._kept_at, offset)
        self._kept_sized.setdefault(nbytes, {})[offset] = None
        self.kept_bytes += nbytes
        if nbytes <= ZERO_NOW:
            ctypes.memset(self.address + offset, 0, nbytes)
            kept.at, kept.clean = nbytes, True
        else:
            if self._zeroer is None:
                self._zeroer = _Zeroer()
            self._zeroer.put(self.address + offset, kept, self)

    def _take(self, offset: int, kept: Zeroing) -> Zeroing | None:
        """The kept block at ``offset`` becomes a buffer's again: None if it
        is all zero, else its ``Zeroing`` (the zeroer goes on with it)."""
        self._unkeep(offset, kept)
        self._fds[offset] = (kept.fd, kept.nbytes)
        self._resident.add(offset)
        self.reused += 1
        with kept.lock:
            if kept.clean:
                return None
            self._zeroing[offset] = kept
            return kept

    def _drop(self, offset: int, kept: Zeroing) -> None:
        """The kept block goes back to unbacked memory (after the zeroer's
        current chunk of it, if any)."""
        kept.stop()
        self._unkeep(offset, kept)
        shm.map_anonymous(self.address + offset, kept.nbytes)
        os.close(kept.fd)

    def _unkeep(self, offset: int, kept: Zeroing) -> None:
        del self._kept[offset]
        del self._kept_at[bisect.bisect_left(self._kept_at, offset)]
        sized = self._kept_sized[kept.nbytes]
        del sized[offset]
        if not sized:
            del self._kept_sized[kept.nbytes]
        self.kept_bytes -= kept.nbytes

    def zero_now(self, offset: int) -> None:
        """Zero what is left of the live block at ``offset`` (taken over
        from a kept block before the zeroer got to it: ``back`` returned its
        ``Zeroing``) in the calling thread, a worker's, and return when it
        is all zero or was freed meanwhile (then nothing more is written).
        Safe beside the zeroer: each chunk is claimed under the block's
        lock.  Nothing to do for any other block.  The arena (``self``) is
        held meanwhile, so its mapping outlives the writes."""
        zeroing = self._zeroing.get(offset)  # one dict read: atomic beside the loop's changes
        if zeroing is not None:
            addr = self.address + offset
            while zeroing.step(addr):
                pass

    def resident(self, offset: int) -> bool:
        """Whether the live block at ``offset`` is backed already, every page
        (a kept block taken over: its zeroing touched them all), so there is
        nothing to pre-fault (``MADV_POPULATE_WRITE`` still walks every page:
        64-126 ms per GiB here)."""
        return offset in self._resident

    def kept_block(self, nbytes: int) -> int | None:
        """The most recently kept block of exactly ``nbytes`` (for the
        allocator to hand out first: ``Registry``), or None."""
        sized = self._kept_sized.get(nbytes)
        return next(reversed(sized)) if sized else None

    def _drop_overlapping(self, offset: int, nbytes: int) -> None:
        at = self._kept_at
        i = bisect.bisect_left(at, offset + nbytes)  # the kept blocks starting below the end
        while i > 0:
            start = at[i - 1]
            kept = self._kept[start]
            if start + kept.nbytes <= offset:
                break  # sorted and disjoint: the ones further down end below it too
            self._drop(start, kept)
            i -= 1

    def _drop_all(self) -> None:
        for offset in list(self._kept):
            self._drop(offset, self._kept[offset])

    def share(self, src: int, dst: int, nbytes: int) -> None:
        """Back the free block ``[dst, dst + nbytes)`` with the memfd of the
        backed block at ``src`` (a clone: the same pages, no copy).  The
        memfd is sealed, so the mapping at ``dst`` is private: were it ever
        written before ``own``, the write would stay in this process's
        copy of the page and never reach ``src`` (a safety net; the daemon
        calls ``own`` before any write, see ``needs_own``)."""
        got = self._fds.get(src)
        if got is None or got[1] != nbytes:
            raise ValueError(f"[{src}, +{nbytes}) is not one backed block")
        if dst in self._fds or dst % self.granularity or dst + nbytes > len(self._map):
            raise ValueError(f"[{dst}, +{nbytes}) is not a free block of this arena")
        if self._kept:
            self._drop_overlapping(dst, nbytes)
        fd = got[0]
        shm.map_private(self.address + dst, nbytes, fd)
        self._fds[dst] = (fd, nbytes)
        self._holders[fd] = self._holders.get(fd, 1) + 1
        self._borrowed.add(dst)

    def needs_own(self, offset: int) -> bool:
        """Whether the block at ``offset`` must get memory of its own
        (``own``) before it is written: it maps another block's memfd, or
        another block maps its own."""
        if offset in self._borrowed:
            return True
        got = self._fds.get(offset)
        return got is not None and self._holders.get(got[0], 1) > 1

    def same_memory(self, a: int, b: int) -> bool:
        """Whether the blocks at ``a`` and ``b`` map the same memfd (a clone
        and its source, neither written since: the same bytes at the same
        offsets)."""
        fa, fb = self._fds.get(a), self._fds.get(b)
        return fa is not None and fb is not None and fa[0] == fb[0]

    def copy_out(self, offset: int, nbytes: int) -> int:
        """A new sealed memfd holding the block's bytes, mapped at its place
        (``own``'s first half: safe in a worker thread while the caller keeps
        the block from being written or freed); ``adopt`` it next."""
        got = self._fds.get(offset)
        if got is None or got[1] != nbytes:
            raise ValueError(f"[{offset}, +{nbytes}) is not one backed block")
        fd = shm.memfd(nbytes, "rpcbuf-buffer")
        try:
            src = self._bytes[offset:offset + nbytes]
            at = 0
            while at < nbytes:  # the kernel copies from our mapping into the new file
                at += os.pwrite(fd, src[at:at + COPY_CHUNK], at)
            shm.map_fixed(self.address + offset, nbytes, fd)
            shm.seal_read_only(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def adopt(self, offset: int, fd: int) -> None:
        """The block at ``offset`` now has the memfd ``fd`` (``copy_out``'s)
        of its own; the memfd it shared is closed with its last block."""
        old, nbytes = self._fds[offset]
        self._fds[offset] = (fd, nbytes)
        self._borrowed.discard(offset)
        self._let_go(old)

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

    def export(self, offset: int, nbytes: int) -> int:
        """A new read-only fd of the buffer at ``offset`` (exactly its block);
        the caller closes it.  From then on its memfd is never kept."""
        got = self._fds.get(offset)
        if got is None or got[1] != nbytes:
            raise ValueError(f"[{offset}, +{nbytes}) is not one backed block")
        self._exported.add(offset)
        return shm.read_only_fd(got[0])

    @property
    def zeroing_bytes(self) -> int:
        """Bytes of kept blocks (taken over or not) not zeroed yet.  Safe
        from another thread (the metrics'): each dict is copied in one step."""
        blocks = [*list(self._kept.values()), *list(self._zeroing.values())]
        return sum(z.nbytes - z.at for z in blocks if not z.clean and not z.stopped)

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


COPY_CHUNK = 64 << 20  # ``copy_out`` writes this much per system call
ZERO_NOW = 8 << 20  # kept blocks up to this size are zeroed in ``unback`` (about 1 ms)
MAX_KEPT = 4096  # kept blocks at most (each holds an fd)


MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module gained it only in 3.13
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int


def host_memory(arena: Arena) -> HostArena | None:
    """``arena`` as host memory (kept blocks, clones, pre-faulting), or None."""
    return arena if isinstance(arena, HostArena) else None


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
