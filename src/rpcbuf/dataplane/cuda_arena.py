"""A GPU arena on one CUDA device: ``view`` is a zero-copy CuPy ``uint8`` slice UCX
moves directly, ``checksum`` runs on the device (no copy to the host).

- **vmm**: the virtual range is reserved once; each buffer gets its own physical
  allocation on ``back`` and loses it on ``unback``; ``export`` gives a POSIX fd
  of one buffer's memory. Sizes are multiples of the granularity (2 MiB). Views
  outside backed buffers are refused: touching unmapped device memory would
  poison the daemon's CUDA context for every tenant.
- **cupy**: one ``cupy.empty`` allocation; ``back``/``unback`` keep the books,
  ``export`` raises ``NoHandleSharing``. Chosen when asked, or (``vmm=None``) when
  VMM, POSIX-fd handles or the creation probe fail (``backing_why``). UCX's
  cuda_ipc shares VMM memory only with a FABRIC handle (``fabric_why``).

CuPy is imported only when an arena is made; every failure to make one is a
``DeviceUnavailable`` naming the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, TypeGuard

from rpcbuf.dataplane.checksum import xxh3

from .cuda_backing import Ledger, VmmBacking, undo
from .cuda_vmm import CudaError, Driver, NoHandleSharing, open_driver
from .devsum import devsum

CUPY_GRANULARITY = 256  # the cupy backing: the allocator's own alignment


class DeviceUnavailable(ValueError):
    """The device cannot serve an arena on this node (message names it)."""


def _import_cupy(spec: str) -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise DeviceUnavailable(
            f"{spec}: GPU arenas need CuPy, which is not installed "
            f"(pip install 'rpcbuf[gpu]' or cupy-cuda12x / cupy-cuda13x): {exc}"
        ) from None
    return cupy


def device_array(cp: Any, ptr: int, nbytes: int, device: int, owner: object) -> Any:
    """A CuPy uint8 array over device memory CuPy does not own (``owner`` kept alive)."""
    mem = cp.cuda.UnownedMemory(ptr, nbytes, owner, device)
    return cp.ndarray((nbytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))


class CudaArena:
    """Device memory of CUDA device ``device``. ``vmm``: False one CuPy allocation;
    None VMM where supported; True VMM or ``DeviceUnavailable``. ``driver``: for tests."""

    device_type = "GPU"
    kind = "cuda"
    address: int | None = None  # device memory: no address in this process

    def __init__(self, size: int, device: int = 0, *, vmm: bool | None = False,
                 driver: Driver | None = None) -> None:
        spec = f"cuda:{device}"
        if size <= 0:
            raise DeviceUnavailable(f"{spec}: arena size must be positive")
        cp = _import_cupy(spec)
        try:
            count = int(cp.cuda.runtime.getDeviceCount())
        except Exception as exc:  # no driver, no devices: CUDARuntimeError
            raise DeviceUnavailable(f"{spec}: no usable CUDA device here ({exc})") from None
        if not 0 <= device < count:
            raise DeviceUnavailable(f"{spec}: no such CUDA device (this node has {count})")
        self.xp = cp
        self.size = size
        self.device = device
        self._dev = cp.cuda.Device(device)
        self._vmm: VmmBacking | None = None
        self.backing_why = "" if vmm is not False else "VMM not asked for"
        if vmm is not False:
            self._vmm = self._make_vmm(spec, driver, required=vmm is True)
        if self._vmm is not None:
            self.granularity = self._vmm.granularity
            self._ledger = self._vmm.ledger
            try:
                with self._dev:
                    self._mem = device_array(cp, self._vmm.base, self._vmm.reserved, device,
                                             self._vmm)
            except Exception as exc:
                undo(exc, self._vmm.close)
                raise DeviceUnavailable(f"{spec}: cannot view the reserved range "
                                        f"({type(exc).__name__}: {exc})") from None
        else:
            self.granularity = CUPY_GRANULARITY
            self._ledger = Ledger(size, CUPY_GRANULARITY)
            try:
                with self._dev:
                    self._mem = cp.empty(size, dtype=cp.uint8)
            except Exception as exc:  # cupy.cuda.memory.OutOfMemoryError and friends
                free = self._free_bytes()
                raise DeviceUnavailable(
                    f"{spec}: cannot allocate {size} bytes ({type(exc).__name__}: {exc}; "
                    f"{free} bytes free)"
                ) from None
        props = cp.cuda.runtime.getDeviceProperties(device)
        name = props.get("name", b"CUDA device")
        self.name = name.decode(errors="replace") if isinstance(name, bytes) else str(name)

    def _make_vmm(self, spec: str, driver: Driver | None, required: bool) -> VmmBacking | None:
        try:
            drv = driver if driver is not None else open_driver(self.device)
            why = drv.support.why_not
        except (NoHandleSharing, CudaError) as exc:
            why = str(exc)
        if not why:
            try:
                backing = VmmBacking(drv, self.size)
            except CudaError as exc:  # the range cannot be reserved
                why = f"cannot reserve {self.size} bytes of virtual addresses ({exc})"
            else:
                try:
                    backing.probe()
                    return backing
                except CudaError as exc:  # e.g. cuMemCreate or the export refused
                    undo(exc, backing.close)
                    why = f"the VMM probe failed ({exc})"
        if required:
            raise DeviceUnavailable(f"{spec}: CUDA VMM was asked for, but {why}")
        self.backing_why = why
        return None

    @property
    def backing(self) -> str:
        """``"vmm"`` or ``"cupy"``."""
        return "vmm" if self._vmm is not None else "cupy"

    def _free_bytes(self) -> int | None:
        try:
            with self._dev:
                free, _ = self.xp.cuda.runtime.memGetInfo()
            return int(free)
        except Exception:
            return None

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Make this arena's device current (CuPy's current device is per thread)."""
        with self._dev:
            yield

    # -- what the registry calls around its allocator -----------------------------------

    def back(self, offset: int, nbytes: int) -> None:
        """Give a block just handed out its memory. ``BackingError`` (misaligned, outside,
        overlapping) or ``CudaError``; either way nothing stays backed."""
        if self._vmm is not None:
            self._vmm.back(offset, nbytes)
        else:
            self._ledger.add(offset, nbytes)

    def unback(self, offset: int, nbytes: int) -> None:
        """Its memory goes (once importers released it too). ``BackingError``: no such block."""
        if self._vmm is not None:
            self._vmm.unback(offset, nbytes)
        else:
            self._ledger.remove(offset, nbytes)

    def export(self, offset: int, nbytes: int) -> int:
        """A new POSIX fd of one backed block; the caller closes it. ``NoHandleSharing``
        (cupy), ``BackingError``, ``CudaError``."""
        if self._vmm is None:
            raise NoHandleSharing(
                f"cuda:{self.device}: GPU buffers here are one CuPy allocation and cannot "
                f"be shared by handle ({self.backing_why})")
        return self._vmm.export(offset, nbytes)

    # -- views ------------------------------------------------------------------------

    def _check(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise IndexError(f"[{offset}, {offset + nbytes}) is outside the arena of {self.size}")
        if self._vmm is not None and nbytes and not self._vmm.covers(offset, nbytes):
            raise IndexError(f"[{offset}, {offset + nbytes}) is not inside one backed buffer")

    def view(self, offset: int, nbytes: int) -> Any:
        self._check(offset, nbytes)
        return self._mem[offset : offset + nbytes]

    def checksum(self, offset: int, nbytes: int) -> int:
        """``devsum`` of the range, computed on the GPU."""
        with self._dev:
            return devsum(self.view(offset, nbytes))

    def checksums(self, offsets: list[int], sizes: list[int]) -> list[int]:
        """xxh3-64 of many ranges, each copied to the host first (slow)."""
        for o, n in zip(offsets, sizes, strict=True):
            self._check(o, n)
        with self._dev:
            return [xxh3(self.xp.asnumpy(self._mem[o : o + n]).data)
                    for o, n in zip(offsets, sizes, strict=True)]

    def synchronize(self) -> None:
        self._dev.synchronize()

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device_type": self.device_type, "device": self.device,
                               "name": self.name, "kind": self.kind,
                               "backing": self.backing, "granularity": self.granularity}
        if self._vmm is None:
            out["backing_why"] = self.backing_why
        else:
            out["fabric"] = self._vmm.fabric
            if not self._vmm.fabric:
                out["fabric_why"] = self._vmm.fabric_why
        try:
            with self._dev:
                free, total = self.xp.cuda.runtime.memGetInfo()
            out["gpu_memory_total"], out["gpu_memory_free"] = int(total), int(free)
        except Exception:  # describe must not fail a list_devices call
            pass
        return out

    def close(self) -> None:
        """Give all memory and the range back (idempotent); earlier views must not be used."""
        if self._vmm is not None:
            with self._dev:
                self._dev.synchronize()
                self._vmm.close()


def is_device_arena(arena: object) -> TypeGuard[CudaArena]:
    return isinstance(arena, CudaArena)


def array_module(arena: Any) -> Any:
    import numpy as np

    return arena.xp if is_device_arena(arena) else np


def active(arena: Any) -> contextlib.AbstractContextManager[None]:
    """The arena's device made current (a no-op for host arenas)."""
    return arena.active() if is_device_arena(arena) else contextlib.nullcontext()


def copy_device(src: Any, src_offset: int, dst: Any, dst_offset: int, nbytes: int) -> None:
    """``copy_between`` where either arena is on a GPU (H2D, D2H, D2D; overlap-safe)."""
    s, d = src.view(src_offset, nbytes), dst.view(dst_offset, nbytes)
    if not is_device_arena(dst):  # device -> host
        with active(src):
            s.get(out=d)
        return
    with active(dst):
        if not is_device_arena(src):  # host -> device
            d.set(s)
        else:
            overlap = src is dst and src_offset < dst_offset + nbytes and \
                dst_offset < src_offset + nbytes
            d[...] = s.copy() if overlap else s
        dst.synchronize()
