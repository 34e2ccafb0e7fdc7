"""Zeroing kept blocks (``kept.KeptBlocks``) in the background: ``Zeroing``
is one block's progress and the hand-over of what is left to whoever takes
the block first (``KeptBlocks.zero_now``); ``Zeroer`` is the one thread that
zeroes them, ``ZERO_CHUNK`` at a time, in the order they were kept.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable

ZERO_CHUNK = 4 << 20  # kept blocks past ZERO_NOW are zeroed this much at a time per lock hold


class Zeroing:
    """A kept block (a freed block's memfd, still mapped) and how far it is
    zeroed (``at``: the bytes below are zero).  ``lock`` is held while a
    chunk of it is written (``step``), by the zeroer or by the buffer's
    requester (``KeptBlocks.zero_now``); ``stopped`` (set under it) means
    nobody may write it again; ``clean``: all of it is zero."""

    __slots__ = ("_then", "at", "clean", "fd", "lock", "nbytes", "stopped")

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd, self.nbytes = fd, nbytes
        self.at = 0
        self.clean = self.stopped = False
        self.lock = threading.Lock()
        self._then: Callable[[], None] | None = None

    def then(self, done: Callable[[], None]) -> None:
        """Call ``done`` once, when the block is all zero or when it was
        freed before (``stop``: no buffer waits for it any more, and its
        waiter must not wait forever): now, or from the thread that wrote
        its last chunk or stopped it."""
        with self.lock:
            if not self.clean and not self.stopped:
                self._then = done
                return
        done()

    def step(self, addr: int) -> bool:
        """Zero the block's next ``ZERO_CHUNK`` (the block lies at ``addr``)
        under the lock; False once nothing is left (all zero, or stopped)."""
        with self.lock:
            if self.stopped or self.clean:
                return False
            n = min(ZERO_CHUNK, self.nbytes - self.at)
            ctypes.memset(addr + self.at, 0, n)
            self.at += n
            if self.at < self.nbytes:
                return True
            self.clean = True
            done, self._then = self._then, None
        if done is not None:
            done()
        return False

    def stop(self) -> None:
        """Nobody writes the block again (after a chunk being written now);
        a ``then`` waiting for it is called."""
        with self.lock:
            self.stopped = True
            done, self._then = self._then, None
        if done is not None:
            done()


class Zeroer:
    """One daemon thread zeroing large kept blocks in the order they were
    kept (``ctypes.memset`` releases the GIL); a block whose requester
    zeroed it meanwhile (``zero_now``) costs it one look.  Each job holds
    its arena's mapping (``owner``: the arena's ``mmap``, which
    ``KeptBlocks`` passes) until it is done: an arena dropped meanwhile (the
    daemon's, when ``serve`` returns) is unmapped only after the zeroer's
    last write into it, never under it."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[int, Zeroing, object]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="rpcbuf-zeroer", daemon=True).start()

    def put(self, addr: int, kept: Zeroing, owner: object = None) -> None:
        self._queue.put((addr, kept, owner))

    def _run(self) -> None:
        while True:
            addr, kept, owner = self._queue.get()
            while kept.step(addr):
                pass
            del owner  # the arena may go now (not held while the queue is empty)
