"""Kept blocks: freed host blocks that stay backed, zeroed, for the next buffer of
the same block (backing costs ~1 s per GiB of faults, unbacking 0.3 s). Only a
block never exported (no reader can hold its fd) is kept, up to ``limit`` bytes;
blocks up to ``ZERO_NOW`` are zeroed at once, larger ones by one background
thread, ``ZERO_CHUNK`` at a time under the block's lock, in the order kept.
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
    """The kept blocks of one host arena at ``address`` (``mapping`` keeps the range
    mapped while zeroer jobs hold it).

    - A ``back`` of exactly a kept block takes it over: at once when all zero, else
      with its ``Zeroing``; the taker zeroes the rest itself (``zero_now``) rather
      than wait behind every block kept before it. Chunks are claimed under the
      block's lock, each written once.
    - Any other ``back`` or share overlapping a kept block, and the least recently
      kept beyond ``limit``, send it back to unbacked memory.
    - Nothing another tenant wrote survives into a kept block's next buffer."""

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
        """Keep the freed, never-exported block at ``offset`` (zeroed first), dropping the
        oldest beyond ``limit``; False, nothing changed, when it alone passes ``limit``."""
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
        """The kept block of exactly this range: its memfd and None if all zero, else its
        ``Zeroing``. None: there is none (any overlapping kept block is dropped)."""
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
        """A block taken over before it was zeroed is freed: its zeroing stops (a waiting
        ``then`` is called)."""
        self._resident.discard(offset)
        zeroing = self._zeroing.pop(offset, None)
        if zeroing is not None:
            zeroing.stop()

    def zero_now(self, offset: int) -> None:
        """Zero what is left of the taken-over block at ``offset`` in this (worker) thread;
        returns when all zero or freed meanwhile. Safe beside the zeroer (chunks claimed
        under the block's lock); the arena's mapping is held meanwhile."""
        zeroing = self._zeroing.get(offset)  # one dict read: atomic beside the loop's changes
        if zeroing is not None:
            addr = self._address + offset
            while zeroing.step(addr):
                pass

    def resident(self, offset: int) -> bool:
        """Whether the live block at ``offset`` has every page backed (a kept block taken
        over), so there is nothing to pre-fault."""
        return offset in self._resident

    def newest(self, nbytes: int) -> int | None:
        """The most recently kept block of exactly ``nbytes``, or None."""
        sized = self._sized.get(nbytes)
        return next(reversed(sized)) if sized else None

    @property
    def zeroing_bytes(self) -> int:
        """Bytes of kept blocks not zeroed yet; safe from another thread."""
        blocks = [*list(self._kept.values()), *list(self._zeroing.values())]
        return sum(z.nbytes - z.at for z in blocks if not z.clean and not z.stopped)

    def drop_overlapping(self, offset: int, nbytes: int) -> None:
        """Drop every kept block overlapping the range (another block is backed there)."""
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
        """Drop every kept block (backing failed for want of memory or fds); False: none."""
        if not self._kept:
            return False
        for offset in list(self._kept):
            self._drop(offset, self._kept[offset])
        return True

    def _drop(self, offset: int, kept: Zeroing) -> None:
        """Back to unbacked memory (after the zeroer's current chunk of it)."""
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
