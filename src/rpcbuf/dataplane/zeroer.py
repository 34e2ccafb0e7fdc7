"""Zeroing kept blocks in the background: ``Zeroing`` is one block's progress and
the hand-over of what is left to whoever takes the block first; ``Zeroer`` is the
one thread that zeroes them, ``ZERO_CHUNK`` at a time, in the order kept.
"""

from __future__ import annotations

import ctypes
import queue
import threading
from collections.abc import Callable

ZERO_CHUNK = 4 << 20  # kept blocks past ZERO_NOW are zeroed this much at a time per lock hold


class Zeroing:
    """A kept block and how far it is zeroed (``at``). ``lock`` is held while a chunk is
    written (by the zeroer or the taker); ``stopped`` (set under it): nobody writes it
    again; ``clean``: all zero."""

    __slots__ = ("_then", "at", "clean", "fd", "lock", "nbytes", "stopped")

    def __init__(self, fd: int, nbytes: int) -> None:
        self.fd, self.nbytes = fd, nbytes
        self.at = 0
        self.clean = self.stopped = False
        self.lock = threading.Lock()
        self._then: Callable[[], None] | None = None

    def then(self, done: Callable[[], None]) -> None:
        """Call ``done`` once, when all zero or stopped: now, or from the thread that wrote
        the last chunk or stopped it."""
        with self.lock:
            if not self.clean and not self.stopped:
                self._then = done
                return
        done()

    def step(self, addr: int) -> bool:
        """Zero the next ``ZERO_CHUNK`` under the lock; False once nothing is left."""
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
        """Nobody writes the block again (after a chunk in progress); a waiting ``then`` runs."""
        with self.lock:
            self.stopped = True
            done, self._then = self._then, None
        if done is not None:
            done()


class Zeroer:
    """One daemon thread zeroing large kept blocks in order (``memset`` releases the GIL).
    Each job holds its arena's mapping (``owner``) until done, so an arena dropped
    meanwhile is unmapped only after the last write into it."""

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
