"""A GPU arena: one CuPy allocation on one CUDA device, handed out as views.

It implements the ``Arena`` protocol of ``dataplane.arena``: ``view``
returns a zero-copy CuPy ``uint8`` slice that UCX receives into or sends
from directly (ucxx takes any ``__cuda_array_interface__`` buffer; UCX moves
it with cuda_copy/cuda_ipc or GPUDirect RDMA), ``checksum`` is the device
checksum ``devsum`` (``dataplane.devsum``: computed by a kernel, no copy to
the host), and ``describe`` names the GPU.

CuPy is imported only when a ``CudaArena`` is made, so a CPU-only node never
needs it.  Every failure to make one (no CuPy, no such device, not enough
memory) is a ``DeviceUnavailable`` whose message names the device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dataplane.checksum import xxh3

from .devsum import devsum


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


class CudaArena:
    """Device memory of CUDA device ``device``: one ``cupy.empty(size, uint8)``."""

    device_type = "GPU"
    kind = "cuda"

    def __init__(self, size: int, device: int = 0) -> None:
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

    def view(self, offset: int, nbytes: int) -> Any:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise IndexError(f"[{offset}, {offset + nbytes}) is outside the arena of {self.size}")
        return self._mem[offset : offset + nbytes]

    def checksum(self, offset: int, nbytes: int) -> int:
        """``devsum`` of the range, computed on the GPU."""
        with self._dev:
            return devsum(self.view(offset, nbytes))

    def checksums(self, offsets: list[int], sizes: list[int]) -> list[int]:
        """xxh3-64 of many ranges (what batches and dedup compare against host
        checksums): copies each range to the host first, so it is slow."""
        if any(o < 0 or n < 0 or o + n > self.size for o, n in zip(offsets, sizes, strict=True)):
            raise IndexError("a range is outside the arena")
        with self._dev:
            return [xxh3(self.xp.asnumpy(self._mem[o : o + n]).data)
                    for o, n in zip(offsets, sizes, strict=True)]

    def synchronize(self) -> None:
        self._dev.synchronize()

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"device_type": self.device_type, "device": self.device,
                               "name": self.name, "kind": self.kind}
        try:
            with self._dev:
                free, total = self.xp.cuda.runtime.memGetInfo()
            out["gpu_memory_total"], out["gpu_memory_free"] = int(total), int(free)
        except Exception:  # describe must not fail a list_devices call
            pass
        return out


def is_device_arena(arena: Any) -> bool:
    return getattr(arena, "xp", None) is not None and hasattr(arena, "active")


def array_module(arena: Any) -> Any:
    """NumPy for host arenas, CuPy for device arenas."""
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
