"""Kept blocks: freed host blocks that stay backed, zeroed, for the next
buffer of the same block (``KeptBlocks``, a ``HostArena``'s ``kept``).

Backing a block costs four system calls and, for a large one, the kernel's
page faults (about 1 s per GiB on the development VM), and unbacking it two
calls and the unmapping (0.3 s per GiB).  So a freed block whose memfd never
left the daemon (never ``export``-ed: no reader can hold its fd) stays mapped
where it was, up to ``limit`` bytes of them, and is zeroed: blocks up to
``ZERO_NOW`` at once, larger ones by one background thread (``zeroer``),
``ZERO_CHUNK`` at a time under the block's lock, in the order they were kept.
"""

from __future__ import annotations

import bisect
import ctypes
import os

from rpcbuf.dataplane import shm
from rpcbuf.dataplane.zeroer import Zeroer, Zeroing

ZERO_NOW = 8 << 20  # kept blocks up to this size are zeroed in ``keep`` (about 1 ms)
MAX_KEPT = 4096  # kept blocks at most (each holds an fd)


class KeptBlocks:
    """The kept blocks of one host arena, at ``address`` in this process
    (``mapping`` keeps that range mapped: each zeroer job holds it).

    A ``HostArena.back`` of exactly a kept block (same offset and size: what
    the allocators hand out again for the same request) takes it over
    (``take``): at once when it is all zero, else with its ``Zeroing`` (the
    caller keeps the new buffer locked until it is done).  The zeroer would
    reach a taken block only after every block kept before it (15 released
    64 MiB blocks kept another tenant's request waiting 106-125 ms), so the
    taker zeroes the rest itself (``zero_now``, in a worker thread of its
    tenant's share: ``controlops``); its chunks and the zeroer's are claimed
    under the block's lock, each written once.  Any other ``back`` or
    ``Clones.share`` overlapping a kept block (``drop_overlapping``), and the
    least recently kept ones beyond ``limit``, send it back to unbacked
    memory as before.  Nothing another tenant wrote survives into a kept
    block's next buffer, and no old handle reaches it (the arena keeps only
    blocks it never exported)."""

    def __init__(self, address: int, mapping: object) -> None:
        self.limit = 0  # bytes of freed blocks kept at most (the daemon's ``--keep-freed``)
        self.nbytes = 0  # bytes kept now
        self.reused = 0  # backs served by a kept block
        self._address = address
        self._mapping = mapping
        self._kept: dict[int, Zeroing] = {}  # offset -> kept block, least recently kept first
        self._zeroing: dict[int, Zeroing] = {}  # live blocks taken over before they were zeroed
        self._at: list[int] = []  # their offsets, sorted (kept blocks never overlap)
        self._sized: dict[int, dict[int, None]] = {}  # size -> offsets, oldest first
        self._resident: set[int] = set()  # live blocks taken over from kept ones: all backed
        self._zeroer: Zeroer | None = None

    def keep(self, offset: int, fd: int, nbytes: int) -> bool:
        """Keep the freed block at ``offset`` (its memfd ``fd``, still mapped
        there and never exported), zeroed first, dropping the least recently
        kept ones beyond ``limit``; False, nothing changed, when the block
        alone is larger than ``limit`` (the caller unbacks it)."""
        if nbytes > self.limit:
            return False
        while self._kept and (self.nbytes + nbytes > self.limit
                              or len(self._kept) >= MAX_KEPT):
            old = next(iter(self._kept))  # the least recently kept
            self._drop(old, self._kept[old])
        kept = Zeroing(fd, nbytes)
        self._kept[offset] = kept
        bisect.insort(self._at, offset)
        self._sized.setdefault(nbytes, {})[offset] = None
        self.nbytes += nbytes
        if nbytes <= ZERO_NOW:
            ctypes.memset(self._address + offset, 0, nbytes)
            kept.at, kept.clean = nbytes, True
        else:
            if self._zeroer is None:
                self._zeroer = Zeroer()
            self._zeroer.put(self._address + offset, kept, self._mapping)
        return True

    def take(self, offset: int, nbytes: int) -> tuple[int, Zeroing | None] | None:
        """For a ``back`` of ``[offset, offset + nbytes)``: the kept block of
        exactly that block, a buffer's again, as its memfd and None if it is
        all zero, else its ``Zeroing`` (the zeroer goes on with it).  None:
        there is none, and any kept block overlapping the range is dropped."""
        if not self._kept:
            return None
        kept = self._kept.get(offset)
        if kept is None or kept.nbytes != nbytes:
            self.drop_overlapping(offset, nbytes)
            return None
        self._unkeep(offset, kept)
        self._resident.add(offset)
        self.reused += 1
        with kept.lock:
            if kept.clean:
                return kept.fd, None
            self._zeroing[offset] = kept
            return kept.fd, kept

    def freed(self, offset: int) -> None:
        """The live block at ``offset`` was freed (``HostArena.unback``): if
        it was taken over before it was zeroed for its buffer, that zeroing
        stops (nothing writes it again; a ``then`` waiting for it is called)."""
        self._resident.discard(offset)
        zeroing = self._zeroing.pop(offset, None)
        if zeroing is not None:
            zeroing.stop()

    def zero_now(self, offset: int) -> None:
        """Zero what is left of the live block at ``offset`` (taken over
        from a kept block before the zeroer got to it: ``back`` returned its
        ``Zeroing``) in the calling thread, a worker's, and return when it
        is all zero or was freed meanwhile (then nothing more is written).
        Safe beside the zeroer: each chunk is claimed under the block's
        lock.  Nothing to do for any other block.  The arena's mapping is
        held meanwhile (``self``), so it outlives the writes."""
        zeroing = self._zeroing.get(offset)  # one dict read: atomic beside the loop's changes
        if zeroing is not None:
            addr = self._address + offset
            while zeroing.step(addr):
                pass

    def resident(self, offset: int) -> bool:
        """Whether the live block at ``offset`` is backed already, every page
        (a kept block taken over: its zeroing touched them all), so there is
        nothing to pre-fault (``MADV_POPULATE_WRITE`` still walks every page:
        64-126 ms per GiB here)."""
        return offset in self._resident

    def newest(self, nbytes: int) -> int | None:
        """The most recently kept block of exactly ``nbytes`` (for the
        allocator to hand out first: ``Registry``), or None."""
        sized = self._sized.get(nbytes)
        return next(reversed(sized)) if sized else None

    @property
    def zeroing_bytes(self) -> int:
        """Bytes of kept blocks (taken over or not) not zeroed yet.  Safe
        from another thread (the metrics'): each dict is copied in one step."""
        blocks = [*list(self._kept.values()), *list(self._zeroing.values())]
        return sum(z.nbytes - z.at for z in blocks if not z.clean and not z.stopped)

    def drop_overlapping(self, offset: int, nbytes: int) -> None:
        """Drop every kept block overlapping ``[offset, offset + nbytes)``
        (another block is backed there)."""
        at = self._at
        i = bisect.bisect_left(at, offset + nbytes)  # the kept blocks starting below the end
        while i > 0:
            start = at[i - 1]
            kept = self._kept[start]
            if start + kept.nbytes <= offset:
                break  # sorted and disjoint: the ones further down end below it too
            self._drop(start, kept)
            i -= 1

    def drop_all(self) -> bool:
        """Drop every kept block (backing failed for want of memory or fds:
        what is kept goes first); False when none was kept."""
        if not self._kept:
            return False
        for offset in list(self._kept):
            self._drop(offset, self._kept[offset])
        return True

    def _drop(self, offset: int, kept: Zeroing) -> None:
        """The kept block goes back to unbacked memory (after the zeroer's
        current chunk of it, if any)."""
        kept.stop()
        self._unkeep(offset, kept)
        shm.map_anonymous(self._address + offset, kept.nbytes)
        os.close(kept.fd)

    def _unkeep(self, offset: int, kept: Zeroing) -> None:
        del self._kept[offset]
        del self._at[bisect.bisect_left(self._at, offset)]
        sized = self._sized[kept.nbytes]
        del sized[offset]
        if not sized:
            del self._sized[kept.nbytes]
        self.nbytes -= kept.nbytes
