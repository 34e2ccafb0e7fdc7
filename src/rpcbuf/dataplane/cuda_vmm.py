"""The CUDA virtual memory management (VMM) calls rpcbuf uses, behind one seam.

Memory other processes attach by handle must be a ``cuMemCreate`` allocation
with a POSIX-fd handle type, mapped into a ``cuMemAddressReserve`` range. Where
offered, allocations also ask for a FABRIC handle: UCX's cuda_ipc shares VMM
memory only through one (else transfers stage through cuda_copy). ``Driver`` is
the protocol (``RealDriver`` over cuda-bindings, a recording fake in tests);
cuda-bindings has these calls and CuPy's driver module does not. It is imported
only when a driver is opened.

Every failed call is a ``CudaError`` naming the call and its ``CUresult``; a node
where VMM cannot be used at all (no driver, no bindings, no VMM or POSIX-fd
handles, ``cuInit`` failing) is ``NoHandleSharing`` saying which.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol


class CudaError(RuntimeError):
    """A CUDA driver call failed: ``call`` is its name, ``name`` the ``CUresult``."""

    def __init__(self, call: str, name: str, detail: str = "") -> None:
        self.call, self.name, self.detail = call, name, detail
        super().__init__(f"{call}: {name}" + (f" ({detail})" if detail else ""))


class NoHandleSharing(RuntimeError):
    """This device or node cannot share GPU memory by handle (message says why)."""


@dataclass(frozen=True)
class Support:
    """What a device offers, read once when its driver is opened."""

    vmm: bool  # CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    posix_fd: bool  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
    gpudirect_rdma: bool = False  # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
    fabric: bool = False  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED

    @property
    def why_not(self) -> str:
        """Empty when VMM buffers with POSIX-fd handles work here, else the reason."""
        if not self.vmm:
            return "the device does not support CUDA virtual memory management"
        if not self.posix_fd:
            return "the device does not support POSIX file descriptor memory handles"
        return ""


class Driver(Protocol):
    """The VMM calls for one device; sizes and addresses multiples of ``granularity()``."""

    device: int
    support: Support

    def granularity(self, *, recommended: bool = False) -> int: ...

    def create(self, nbytes: int, *, fabric: bool = False) -> int: ...
    # cuMemCreate: POSIX-fd handle type requested, and FABRIC too with ``fabric``

    def release(self, handle: int) -> None: ...  # cuMemRelease

    def reserve(self, nbytes: int, alignment: int) -> int: ...  # cuMemAddressReserve

    def free_address(self, ptr: int, nbytes: int) -> None: ...  # cuMemAddressFree

    def map(self, ptr: int, nbytes: int, handle: int) -> None: ...  # cuMemMap, offset 0

    def unmap(self, ptr: int, nbytes: int) -> None: ...  # cuMemUnmap

    def set_access(self, ptr: int, nbytes: int, *, writable: bool) -> None: ...  # cuMemSetAccess

    def export(self, handle: int) -> int: ...  # cuMemExportToShareableHandle: a new fd

    def export_fabric(self, handle: int) -> None: ...
    # cuMemExportToShareableHandle(FABRIC): only checked (the handle is UCX's business)

    def import_fd(self, fd: int) -> int: ...  # cuMemImportFromShareableHandle (fd stays open)

    def mem_info(self) -> tuple[int, int]: ...  # cuMemGetInfo: (free, total)

    def synchronize(self) -> None: ...  # cuCtxSynchronize


def _bindings() -> Any:
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        raise NoHandleSharing(f"cuda-bindings is not installed ({exc})") from None
    return driver


class RealDriver:
    """``Driver`` over cuda-bindings in the device's primary context (CuPy's), pushed
    and popped around every call."""

    def __init__(self, device: int, cu: Any = None) -> None:
        self.device = device
        self._cu = cu = cu if cu is not None else _bindings()
        try:
            # Raises when there is no driver library; returns its error (no
            # device, a driver too old for the bindings) otherwise.
            self._call("cuInit", cu.cuInit, 0)
        except CudaError as exc:
            raise NoHandleSharing(f"no usable CUDA driver ({exc})") from None
        self._dev = self._call("cuDeviceGet", cu.cuDeviceGet, device)
        self._ctx = self._call("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain, self._dev)
        attr = cu.CUdevice_attribute
        self.support = Support(
            vmm=bool(self._attribute(attr.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)),
            posix_fd=bool(self._attribute(
                attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED)),
            gpudirect_rdma=bool(self._attribute(
                attr.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED)),
            fabric=bool(self._attribute(attr.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED)))
        kinds = cu.CUmemAllocationHandleType
        self._posix, self._fabric = (kinds.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                                     kinds.CU_MEM_HANDLE_TYPE_FABRIC)
        self._prop = self._allocation_prop(fabric=False)
        self._fabric_prop: Any = None
        self._no_fabric = "the device offers no FABRIC handles"
        if self.support.fabric:
            try:
                self._fabric_prop = self._allocation_prop(fabric=True)
            except NoHandleSharing as exc:
                self._no_fabric = str(exc)

    def _allocation_prop(self, *, fabric: bool) -> Any:
        cu = self._cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.device
        prop.requestedHandleTypes = self._posix
        if fabric:
            _request_also(prop, self._posix, self._fabric)
        if self.support.gpudirect_rdma:  # NICs may DMA into it (InfiniBand/RoCE GPUDirect)
            prop.allocFlags.gpuDirectRDMACapable = 1
        return prop

    def _call(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            out = fn(*args)
        except Exception as exc:  # a symbol this driver lacks, an argument the bindings refuse
            raise CudaError(name, type(exc).__name__, str(exc)) from None
        err, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise CudaError(name, getattr(err, "name", str(err)))
        return rest[0] if len(rest) == 1 else rest

    def _attribute(self, attr: Any) -> int:
        return int(self._call("cuDeviceGetAttribute", self._cu.cuDeviceGetAttribute,
                              attr, self._dev))

    @contextmanager
    def _current(self) -> Iterator[None]:
        self._call("cuCtxPushCurrent", self._cu.cuCtxPushCurrent, self._ctx)
        try:
            yield
        finally:
            self._call("cuCtxPopCurrent", self._cu.cuCtxPopCurrent)

    def _in_ctx(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        with self._current():
            return self._call(name, fn, *args)

    def granularity(self, *, recommended: bool = False) -> int:
        flags = self._cu.CUmemAllocationGranularity_flags
        flag = (flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED if recommended
                else flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        return int(self._in_ctx("cuMemGetAllocationGranularity",
                                self._cu.cuMemGetAllocationGranularity, self._prop, flag))

    def create(self, nbytes: int, *, fabric: bool = False) -> int:
        prop = self._fabric_prop if fabric else self._prop
        if prop is None:
            raise CudaError("cuMemCreate", "CUDA_ERROR_NOT_SUPPORTED", self._no_fabric)
        return int(self._in_ctx("cuMemCreate", self._cu.cuMemCreate, nbytes, prop, 0))

    def release(self, handle: int) -> None:
        self._in_ctx("cuMemRelease", self._cu.cuMemRelease, handle)

    def reserve(self, nbytes: int, alignment: int) -> int:
        return int(self._in_ctx("cuMemAddressReserve", self._cu.cuMemAddressReserve,
                                nbytes, alignment, 0, 0))

    def free_address(self, ptr: int, nbytes: int) -> None:
        self._in_ctx("cuMemAddressFree", self._cu.cuMemAddressFree, ptr, nbytes)

    def map(self, ptr: int, nbytes: int, handle: int) -> None:
        self._in_ctx("cuMemMap", self._cu.cuMemMap, ptr, nbytes, 0, handle, 0)

    def unmap(self, ptr: int, nbytes: int) -> None:
        self._in_ctx("cuMemUnmap", self._cu.cuMemUnmap, ptr, nbytes)

    def set_access(self, ptr: int, nbytes: int, *, writable: bool) -> None:
        cu = self._cu
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = self.device
        desc.flags = (cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE if writable
                      else cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ)
        self._in_ctx("cuMemSetAccess", cu.cuMemSetAccess, ptr, nbytes, [desc], 1)

    def export(self, handle: int) -> int:
        return int(self._in_ctx("cuMemExportToShareableHandle",
                                self._cu.cuMemExportToShareableHandle, handle, self._posix, 0))

    def export_fabric(self, handle: int) -> None:
        self._in_ctx("cuMemExportToShareableHandle", self._cu.cuMemExportToShareableHandle,
                     handle, self._fabric, 0)

    def import_fd(self, fd: int) -> int:
        # The bindings pass an int osHandle through as the pointer value, which
        # is what the C API wants for a POSIX fd: (void *)(uintptr_t)fd.
        return int(self._in_ctx("cuMemImportFromShareableHandle",
                                self._cu.cuMemImportFromShareableHandle, fd, self._posix))

    def mem_info(self) -> tuple[int, int]:
        free, total = self._in_ctx("cuMemGetInfo", self._cu.cuMemGetInfo)
        return int(free), int(total)

    def synchronize(self) -> None:
        self._in_ctx("cuCtxSynchronize", self._cu.cuCtxSynchronize)


def _request_also(prop: Any, first: Any, also: Any) -> None:
    """Make ``prop.requestedHandleTypes`` the mask ``first | also``: the bindings'
    setter takes one enum member only, so the mask is written into the struct, once
    the word there is seen to hold ``first``."""
    import ctypes

    field = ctypes.c_uint32.from_address(int(prop.getPtr()) + 4)  # after the type
    if field.value != int(first):
        raise NoHandleSharing("cuda-bindings' CUmemAllocationProp has an unexpected layout")
    field.value = int(first) | int(also)


_drivers: dict[int, RealDriver] = {}
_lock = threading.Lock()


def open_driver(device: int) -> RealDriver:
    """The process's ``RealDriver`` for ``device`` (made once). ``NoHandleSharing``:
    no driver or bindings; ``CudaError``: the device cannot be opened."""
    with _lock:
        drv = _drivers.get(device)
        if drv is None:
            drv = _drivers[device] = RealDriver(device)
        return drv


def round_up(n: int, granularity: int) -> int:
    return -(-n // granularity) * granularity
