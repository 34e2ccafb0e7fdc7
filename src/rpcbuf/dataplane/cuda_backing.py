"""Per-buffer physical GPU memory on one reserved virtual range.

- Each buffer gets its own ``cuMemCreate`` allocation (POSIX-fd handle) mapped at
  ``base + offset``, so an importer gets exactly that buffer's bytes, never a
  neighbour's. ``unback`` unmaps and releases it (CUDA frees it once importers
  release it too).
- ``Ledger`` is the bookkeeping both backings share (ranges granularity-aligned,
  inside, overlapping nothing). Misuse is a ``BackingError``, raised before any
  driver call; a driver failure inside ``back`` undoes everything and raises.
- ``probe`` runs once at creation (one granule created, mapped, exported,
  released), so a node where ``cuMemCreate`` or export fails falls back to a CuPy
  arena at start. It tries a FABRIC handle first (what cuda_ipc needs).
"""

from __future__ import annotations

import os
import threading
from bisect import bisect_right, insort
from collections.abc import Callable

from .cuda_vmm import CudaError, Driver, round_up


class BackingError(ValueError):
    """A back/unback/export that does not match the backed buffers (a caller's bug)."""


class Ledger:
    """Backed ranges of an arena of ``size`` bytes: offset -> nbytes, sorted."""

    def __init__(self, size: int, granularity: int) -> None:
        self.size, self.granularity = size, granularity
        self._sizes: dict[int, int] = {}
        self._starts: list[int] = []
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._sizes)

    def items(self) -> list[tuple[int, int]]:
        return [(o, self._sizes[o]) for o in self._starts]

    def check_new(self, offset: int, nbytes: int) -> None:
        """Raise ``BackingError`` unless ``[offset, offset+nbytes)`` may be backed."""
        g = self.granularity
        if type(offset) is not int or type(nbytes) is not int:
            raise BackingError(f"offset and nbytes must be ints, got {offset!r}, {nbytes!r}")
        if nbytes <= 0 or offset < 0 or offset + nbytes > self.size:
            raise BackingError(f"[{offset}, {offset + nbytes}) is not a range inside the "
                               f"arena of {self.size} bytes")
        if offset % g or nbytes % g:
            raise BackingError(f"[{offset}, {offset + nbytes}) is not aligned to the "
                               f"granularity {g}")
        i = bisect_right(self._starts, offset)
        if i and self._starts[i - 1] + self._sizes[self._starts[i - 1]] > offset:
            raise BackingError(f"[{offset}, {offset + nbytes}) overlaps the backed buffer at "
                               f"{self._starts[i - 1]}")
        if i < len(self._starts) and self._starts[i] < offset + nbytes:
            raise BackingError(f"[{offset}, {offset + nbytes}) overlaps the backed buffer at "
                               f"{self._starts[i]}")

    def add(self, offset: int, nbytes: int) -> None:
        self.check_new(offset, nbytes)
        self._sizes[offset] = nbytes
        insort(self._starts, offset)
        self.bytes += nbytes

    def check_exact(self, offset: int, nbytes: int, what: str) -> None:
        """Raise ``BackingError`` unless the range is exactly one backed buffer."""
        if self._sizes.get(offset) != nbytes:
            raise BackingError(f"{what} [{offset}, {offset + nbytes}): not exactly one "
                               f"backed buffer")

    def remove(self, offset: int, nbytes: int) -> None:
        self.check_exact(offset, nbytes, "unback of")
        del self._sizes[offset]
        self._starts.pop(bisect_right(self._starts, offset) - 1)
        self.bytes -= nbytes

    def covers(self, offset: int, nbytes: int) -> bool:
        """Whether ``[offset, offset+nbytes)`` lies inside one backed buffer."""
        i = bisect_right(self._starts, offset)
        if not i:
            return False
        start = self._starts[i - 1]
        return offset + nbytes <= start + self._sizes[start]


def map_with_access(driver: Driver, ptr: int, nbytes: int, handle: int, *,
                    writable: bool) -> None:
    """``cuMemMap`` then ``cuMemSetAccess``; a failed access leaves nothing mapped."""
    driver.map(ptr, nbytes, handle)
    try:
        driver.set_access(ptr, nbytes, writable=writable)
    except BaseException as exc:
        undo(exc, driver.unmap, ptr, nbytes)
        raise


def undo(exc: BaseException, fn: Callable[..., object], *args: int) -> None:
    """Run a clean-up step; its own failure is noted on ``exc``, which propagates."""
    try:
        fn(*args)
    except Exception as again:
        exc.add_note(f"while undoing: {again}")


class VmmBacking:
    """A reserved virtual range whose buffers each get their own physical allocation.
    Every public method takes one lock: any thread may call it."""

    def __init__(self, driver: Driver, size: int) -> None:
        self.driver = driver
        self.granularity = driver.granularity()
        self.recommended_granularity = driver.granularity(recommended=True)
        self.reserved = round_up(size, self.granularity)
        self.base = driver.reserve(self.reserved, self.granularity)
        self.ledger = Ledger(size, self.granularity)
        self._handles: dict[int, int] = {}  # offset -> allocation handle
        self._lock = threading.Lock()
        self.closed = False
        self.fabric = False  # allocations also get a FABRIC handle (``probe``)
        self.fabric_why = "not probed"

    def probe(self) -> None:
        """Create, map, set access on, export and release one granule, with a FABRIC handle
        where offered (``fabric_why`` says why not). ``CudaError``; nothing stays behind."""
        with self._lock:
            self._open()
            if len(self.ledger):
                raise BackingError("probe of an arena that has buffers")
            if self.driver.support.fabric:
                try:
                    self._probe_once(fabric=True)
                    self.fabric, self.fabric_why = True, ""
                    return
                except CudaError as exc:
                    self.fabric_why = f"FABRIC handles refused ({exc})"
            else:
                self.fabric_why = "the device offers no FABRIC handles"
            self._probe_once(fabric=False)

    def _probe_once(self, *, fabric: bool) -> None:
        d, g = self.driver, self.granularity
        handle = d.create(g, fabric=fabric)
        try:
            map_with_access(d, self.base, g, handle, writable=True)
        except BaseException as exc:
            undo(exc, d.release, handle)
            raise
        try:
            os.close(d.export(handle))
            if fabric:
                d.export_fabric(handle)
        except BaseException as exc:
            undo(exc, d.unmap, self.base, g)
            undo(exc, d.release, handle)
            raise
        d.unmap(self.base, g)  # a failure here leaks one granule, and says so
        d.release(handle)

    def back(self, offset: int, nbytes: int) -> None:
        """Give the range its own read-write physical memory. ``BackingError`` or
        ``CudaError``, leaving nothing behind."""
        with self._lock:
            self._open()
            self.ledger.check_new(offset, nbytes)
            handle = self.driver.create(nbytes, fabric=self.fabric)
            try:
                map_with_access(self.driver, self.base + offset, nbytes, handle, writable=True)
            except BaseException as exc:
                undo(exc, self.driver.release, handle)
                raise
            self.ledger.add(offset, nbytes)
            self._handles[offset] = handle

    def unback(self, offset: int, nbytes: int) -> None:
        """Unmap and release it. ``BackingError``: not exactly one backed buffer."""
        with self._lock:
            self.ledger.check_exact(offset, nbytes, "unback of")
            self._unback(offset, nbytes)

    def _unback(self, offset: int, nbytes: int) -> None:
        self.driver.unmap(self.base + offset, nbytes)  # a failure here keeps it backed
        self.ledger.remove(offset, nbytes)
        handle = self._handles.pop(offset)
        self.driver.release(handle)  # a failure here leaks the allocation, and says so

    def export(self, offset: int, nbytes: int) -> int:
        """A new POSIX fd of the buffer's allocation (the caller owns it). ``BackingError``,
        ``CudaError``."""
        with self._lock:
            self._open()
            self.ledger.check_exact(offset, nbytes, "export of")
            return self.driver.export(self._handles[offset])

    def covers(self, offset: int, nbytes: int) -> bool:
        with self._lock:
            return self.ledger.covers(offset, nbytes)

    def close(self) -> None:
        """Unback every buffer and free the range (idempotent); the first failure is raised."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            errors: list[CudaError] = []
            for offset, nbytes in self.ledger.items():
                try:
                    self._unback(offset, nbytes)
                except CudaError as exc:
                    errors.append(exc)
            if not self._handles:  # a range with something still mapped cannot be freed
                try:
                    self.driver.free_address(self.base, self.reserved)
                except CudaError as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]

    def _open(self) -> None:
        if self.closed:
            raise BackingError("the arena's GPU memory is closed")
