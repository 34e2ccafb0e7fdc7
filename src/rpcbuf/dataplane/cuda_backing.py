"""Per-buffer physical GPU memory on one reserved virtual range.

A VMM GPU arena (``cuda_arena.CudaArena``) reserves its whole virtual range
once, at creation, and gives each buffer its own physical allocation when
the allocator hands the buffer out: ``back(offset, nbytes)`` creates it
(``cuMemCreate`` with a POSIX-fd handle type), maps it at ``base + offset``
and makes it read-write for the arena's device; ``unback`` unmaps and
releases it (CUDA returns the memory once every importer has released it
too); ``export`` hands out a new fd for one buffer's allocation.  One
allocation per buffer is what makes a buffer shareable on its own: an
importer gets exactly that buffer's bytes, never a neighbour's.

``Ledger`` is the bookkeeping both backings share (which ranges are backed;
a range must be granularity-aligned, inside the arena and overlap nothing);
``VmmBacking`` adds the driver calls.  Misuse (backing twice, unbacking or
exporting a range that is not exactly one backed buffer) is a
``BackingError``: a bug in the caller, raised before any driver call.  A
driver failure in the middle of ``back`` undoes what was done (nothing
stays mapped or allocated) and raises the ``CudaError``.

``probe`` runs once, when the arena is made: it creates one granule, maps
it, sets its access, exports it and gives it back, so that a node where
reading the device's attributes works but ``cuMemCreate`` or the export does
not (a sandbox, a driver that refuses) falls back to a plain CuPy arena at
start instead of failing every GPU ``request_buffer`` later.  It tries a
FABRIC handle first (what UCX's cuda_ipc needs to share VMM memory) and
keeps POSIX-fd-only allocations where that is refused.
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
    """Run a clean-up step of a failed operation; its own failure is noted on
    ``exc`` (the original error is the one that propagates)."""
    try:
        fn(*args)
    except Exception as again:
        exc.add_note(f"while undoing: {again}")


class VmmBacking:
    """A reserved virtual range of ``size`` bytes (rounded up to the
    granularity) whose buffers each get their own physical allocation.
    Every public method takes one lock, so any thread may call it."""

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
        """Create, map, set access on, export and release one granule (at the
        start of the range, before any buffer): with a FABRIC handle where the
        device offers it (``fabric``; ``fabric_why`` says why not), else with
        a POSIX fd only.  Raises ``CudaError`` when even that fails; nothing
        stays allocated or mapped either way."""
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
        """Give ``[offset, offset+nbytes)`` its own read-write physical memory.
        Raises ``BackingError`` (bad range) or ``CudaError`` (the driver
        refused: out of memory, ...), leaving nothing behind."""
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
        """Unmap and release the buffer's memory.  Raises ``BackingError`` when
        the range is not exactly one backed buffer (nothing is touched)."""
        with self._lock:
            self.ledger.check_exact(offset, nbytes, "unback of")
            self._unback(offset, nbytes)

    def _unback(self, offset: int, nbytes: int) -> None:
        self.driver.unmap(self.base + offset, nbytes)  # a failure here keeps it backed
        self.ledger.remove(offset, nbytes)
        handle = self._handles.pop(offset)
        self.driver.release(handle)  # a failure here leaks the allocation, and says so

    def export(self, offset: int, nbytes: int) -> int:
        """A new POSIX fd for the buffer's physical allocation (the caller owns
        it).  Raises ``BackingError`` unless the range is exactly one backed
        buffer, ``CudaError`` when the driver refuses."""
        with self._lock:
            self._open()
            self.ledger.check_exact(offset, nbytes, "export of")
            return self.driver.export(self._handles[offset])

    def covers(self, offset: int, nbytes: int) -> bool:
        with self._lock:
            return self.ledger.covers(offset, nbytes)

    def close(self) -> None:
        """Unback every buffer still backed and free the virtual range
        (idempotent).  Every step is tried; the first failure is raised."""
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
