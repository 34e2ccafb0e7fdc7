"""The staging area of a same-host session: where a local client's bytes meet the
daemon's, both copying, neither touching the other's memory.

A size-sealed memfd (it can never shrink under a mapping), mapped read-write by
both sides: the session's scratch memory, never arena memory. Layout:

- a header page: two 32-bit counters on separate cache lines, ``produced`` and
  ``consumed``, in ring chunks, reset by the client before each ring op;
- ``SMALL_SLOTS`` slots of ``SMALL`` bytes: an op that fits names one (``stage``);
- a ring of ``RING_SLOTS`` chunks of ``RING_CHUNK``: a bigger op (one per session
  at a time) streams through it. Chunk ``k`` goes through slot ``k % RING_SLOTS``;
  the producer fills it once ``consumed > k - RING_SLOTS`` and sets
  ``produced = k + 1``, the consumer empties it once ``produced > k`` and sets
  ``consumed = k + 1``. Each side sleeps on the other's counter (a futex).

The daemon trusts nothing in it beyond which bytes it copies where, within bounds
it computed: a lying client garbles or stalls only its own op.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from rpcbuf.dataplane import shm

HEADER = shm.PAGE
PRODUCED, CONSUMED = 0, 64  # the counters' byte offsets in the header
SMALL = 64 << 10
SMALL_SLOTS = 32
RING_CHUNK = 1 << 20  # 1 MiB: chunks stay in cache between the two copies
RING_SLOTS = 4
RING = 0xFFFF  # a request's ``stage`` for the ring (small slots are 0..SMALL_SLOTS-1)
SMALL_AT = HEADER
RING_AT = SMALL_AT + SMALL * SMALL_SLOTS
SIZE = RING_AT + RING_CHUNK * RING_SLOTS
WAIT_SLICE = 0.05  # seconds a futex wait sleeps before it looks at stop/deadline again


class Stopped(Exception):
    """A ring op stopped before its end: told to (``stop``), or past its deadline."""


class Area:
    """A mapping of the staging area: the slots as uint8 arrays, the counters, the ring loop."""

    def __init__(self, memory: Any, address: int) -> None:
        """``memory``: a writable buffer of ``SIZE`` bytes (an mmap) at ``address``."""
        self.bytes = np.frombuffer(memory, dtype=np.uint8, count=SIZE)
        self._words = np.frombuffer(memory, dtype=np.uint32, count=HEADER // 4)
        self.address = address

    def retire(self) -> None:
        """The memory goes away: the slots are empty and the counters private from now on."""
        self.bytes = np.zeros(0, dtype=np.uint8)
        self._words = np.zeros(HEADER // 4, dtype=np.uint32)

    def small(self, slot: int, nbytes: int) -> np.ndarray:
        if not 0 <= slot < SMALL_SLOTS or not 0 <= nbytes <= SMALL:
            raise IndexError(f"small slot {slot} of {nbytes} bytes is out of range")
        at = SMALL_AT + slot * SMALL
        return self.bytes[at:at + nbytes]

    def chunk(self, k: int) -> np.ndarray:
        at = RING_AT + (k % RING_SLOTS) * RING_CHUNK
        return self.bytes[at:at + RING_CHUNK]

    def get(self, word: int) -> int:
        return int(self._words[word // 4])

    def put(self, word: int, value: int) -> None:
        self._words[word // 4] = value
        shm.futex_wake(self.address + word)  # a system call: also orders the copy before it

    def reset(self) -> None:
        self._words[PRODUCED // 4] = 0
        self._words[CONSUMED // 4] = 0

    def wait(self, word: int, past: int, stop: Callable[[], bool], deadline: float) -> None:
        """Until the counter at ``word`` is above ``past``."""
        while True:
            value = self.get(word)
            if value > past:
                return
            if stop():
                raise Stopped("stopped")
            left = deadline - time.monotonic()
            if left <= 0:
                raise Stopped("the staging ring's other side did not keep up in time")
            shm.futex_wait(self.address + word, value, min(WAIT_SLICE, left))

    def pump(self, pieces: Sequence[np.ndarray], produce: bool, stop: Callable[[], bool],
             deadline: float, landed: Callable[[int], None] | None = None) -> None:
        """Stream ``pieces`` through the ring, into it (``produce``) or out of it.
        ``landed(i)``: pieces ``[0, i)`` are complete (consumer side)."""
        total = sum(p.nbytes for p in pieces)
        chunks = math.ceil(total / RING_CHUNK)
        cursor = _PieceCursor(pieces)
        for k in range(chunks):
            if produce:  # slot k % RING_SLOTS is free once chunk k - RING_SLOTS is out
                self.wait(CONSUMED, k - RING_SLOTS, stop, deadline)
            else:
                self.wait(PRODUCED, k, stop, deadline)
            n = min(RING_CHUNK, total - k * RING_CHUNK)
            cursor.copy(self.chunk(k)[:n], produce)
            self.put(PRODUCED if produce else CONSUMED, k + 1)
            if landed is not None:
                landed(cursor.done)


class Shared:
    """One side's mapping of a staging area, unmapped by its owner (never by the garbage
    collector): ``close`` unmaps at once, or when the last running copy lets go (a
    ring thread stops within a chunk) -- never under a running copy. Event-loop
    thread only. After unmapping the area is retired: a stale use copies nothing."""

    def __init__(self, fd: int) -> None:
        self.address = shm.map_shared(fd, SIZE)
        self.area = Area((ctypes.c_uint8 * SIZE).from_address(self.address), self.address)
        self._holds = 0
        self.closed = False  # no new holds; unmapped once ``_holds`` is 0
        self.mapped = True

    def hold(self) -> None:
        """A copy starts using the area (``let_go`` when it returned)."""
        if self.closed:
            raise Stopped("the staging area is closed")
        self._holds += 1

    def let_go(self) -> None:
        self._holds -= 1
        if self.closed and not self._holds:
            self._unmap()

    def close(self) -> None:
        """Idempotent."""
        if self.closed:
            return
        self.closed = True
        if not self._holds:
            self._unmap()

    def _unmap(self) -> None:
        if self.mapped:
            self.mapped = False
            self.area.retire()
            shm.unmap(self.address, SIZE)


class _PieceCursor:
    """Where the next byte of a sequence of pieces is."""

    __slots__ = ("_ends", "done", "offset", "pieces")

    def __init__(self, pieces: Sequence[np.ndarray]) -> None:
        self.pieces, self.done, self.offset = pieces, 0, 0
        self._ends: np.ndarray | None = None  # cumulative sizes, for runs of whole pieces

    def _whole(self, room: int) -> int:
        """How many whole flat uint8 pieces from ``done`` on fit in ``room`` bytes."""
        if self._ends is None:
            pieces = self.pieces
            if len(pieces) < 8 or not all(p.dtype == np.uint8 and p.ndim == 1 for p in pieces):
                self._ends = np.empty(0, dtype=np.int64)
            else:
                self._ends = np.cumsum([p.nbytes for p in pieces], dtype=np.int64)
        ends = self._ends
        if not len(ends):
            return 0
        base = int(ends[self.done - 1]) if self.done else 0
        return int(np.searchsorted(ends, base + room, side="right")) - self.done

    def copy(self, slot: np.ndarray, into_slot: bool) -> None:
        """Fill ``slot`` from the pieces (``into_slot``) or the pieces from it."""
        at, n = 0, slot.nbytes
        pieces = self.pieces
        while at < n:
            if into_slot and not self.offset:
                # Many small pieces (a batch of small tensors): those that fit
                # whole go in with one C call, not one Python step each.
                k = self._whole(n - at)
                if k > 1:
                    first, ends = self.done, self._ends
                    assert ends is not None
                    total = int(ends[first + k - 1]) - (int(ends[first - 1]) if first else 0)
                    np.concatenate(pieces[first:first + k], out=slot[at:at + total])
                    at += total
                    self.done = first + k
                    while self.done < len(pieces) and not pieces[self.done].nbytes:
                        self.done += 1
                    continue
            piece = pieces[self.done]
            take = min(piece.nbytes - self.offset, n - at)
            if into_slot:
                slot[at:at + take] = piece[self.offset:self.offset + take]
            else:
                piece[self.offset:self.offset + take] = slot[at:at + take]
            at += take
            self.offset += take
            if self.offset == piece.nbytes:
                self.done += 1
                self.offset = 0
                while self.done < len(pieces) and not pieces[self.done].nbytes:
                    self.done += 1


def gather(pieces: Sequence[np.ndarray], slot: np.ndarray) -> None:
    """Pieces, in order, into the start of ``slot`` (a small op)."""
    if len(pieces) == 1:  # a plain read: one copy, no cursor (the 4 KiB path)
        piece = pieces[0]
        slot[:piece.nbytes] = piece
        return
    _PieceCursor(pieces).copy(slot[:sum(p.nbytes for p in pieces)], True)


def scatter(slot: np.ndarray, pieces: Sequence[np.ndarray]) -> None:
    """The start of ``slot`` into the pieces, in order (a small op)."""
    if len(pieces) == 1:  # a plain store
        piece = pieces[0]
        piece[:] = slot[:piece.nbytes]
        return
    _PieceCursor(pieces).copy(slot[:sum(p.nbytes for p in pieces)], False)
