"""Attach a GPU buffer another process exported (the client's side of CUDA VMM):
import the fd (closed right after, whatever happens), reserve a range of its own,
map it, and set access read-only (or read-write when asked). ``close`` undoes it
in reverse; the memory lives on while another holder has it.

Read-only is a promise, not a protection: whoever holds the fd can import it
writable (CUDA has no sealed handle; docs/dataplane.md).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .cuda_backing import map_with_access, undo
from .cuda_vmm import Driver, NoHandleSharing, open_driver


class Mapping:
    """An imported allocation mapped at ``ptr`` (``nbytes``) in this process."""

    def __init__(self, driver: Driver, ptr: int, nbytes: int, handle: int,
                 writable: bool) -> None:
        self.driver, self.ptr, self.nbytes, self.writable = driver, ptr, nbytes, writable
        self._handle = handle
        self._lock = threading.Lock()
        self.closed = False

    def close(self) -> None:
        """Unmap and release (idempotent); arrays over it must not be used after. The first
        failure is raised; a failed unmap keeps handle and range (a leak, never a range
        freed under a mapping)."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            d = self.driver
            errors: list[Exception] = []
            try:
                d.synchronize()  # no kernel of ours may still touch the range
            except Exception as exc:
                errors.append(exc)
            try:
                d.unmap(self.ptr, self.nbytes)
            except Exception as exc:  # still mapped: keep the handle and the range
                raise (errors or [exc])[0] from None
            for step in (lambda: d.release(self._handle),
                         lambda: d.free_address(self.ptr, self.nbytes)):
                try:
                    step()
                except Exception as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]


def import_mapping(fd: int, nbytes: int, driver: Driver, *, writable: bool = False) -> Mapping:
    """Map the allocation behind ``fd`` (``nbytes``: a multiple of the granularity).
    Takes ownership of ``fd``. ValueError, ``NoHandleSharing``, ``CudaError``; nothing
    is left mapped or held then."""
    try:
        why = driver.support.why_not
        if why:
            raise NoHandleSharing(f"cuda:{driver.device}: {why}")
        g = driver.granularity()
        if type(nbytes) is not int or nbytes <= 0 or nbytes % g:
            raise ValueError(f"nbytes must be a positive multiple of {g}, got {nbytes!r}")
        handle = driver.import_fd(fd)
    finally:
        os.close(fd)
    try:
        ptr = driver.reserve(nbytes, g)
    except BaseException as exc:
        undo(exc, driver.release, handle)
        raise
    try:
        map_with_access(driver, ptr, nbytes, handle, writable=writable)
    except BaseException as exc:
        undo(exc, driver.release, handle)
        undo(exc, driver.free_address, ptr, nbytes)
        raise
    return Mapping(driver, ptr, nbytes, handle, writable)


class Imported:
    """An attached GPU buffer: ``array`` (CuPy uint8) and ``close()``; a context manager."""

    def __init__(self, mapping: Mapping, array: Any) -> None:
        self.mapping, self.array = mapping, array

    def close(self) -> None:
        self.mapping.close()

    def __enter__(self) -> Imported:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def import_buffer(fd: int, nbytes: int, device: int = 0, *, writable: bool = False,
                  driver: Driver | None = None) -> Imported:
    """``import_mapping`` on ``device`` plus a CuPy array over it; owns ``fd``."""
    try:
        drv = driver if driver is not None else open_driver(device)
    except BaseException:
        os.close(fd)
        raise
    mapping = import_mapping(fd, nbytes, drv, writable=writable)
    try:
        import cupy

        from .cuda_arena import device_array

        with cupy.cuda.Device(device):
            array = device_array(cupy, mapping.ptr, nbytes, device, mapping)
    except BaseException as exc:
        undo(exc, mapping.close)
        raise
    return Imported(mapping, array)
