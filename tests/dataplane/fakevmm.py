"""A fake ``rpcbuf.dataplane.cuda_vmm.Driver`` that records calls and enforces the rules.

``FakeGpu`` is one device's physical memory, shared by the drivers that use
it (one ``FakeDriver`` per "process"): an allocation lives while a handle to
it or a mapping of it exists anywhere, as in CUDA.  Each ``FakeDriver``
holds its process's handles, reservations and mappings, and refuses what
CUDA refuses or what rpcbuf promises never to do, with ``RuleBroken`` (an
AssertionError: a test that sees one found a bug):

* sizes, addresses and alignments are multiples of the granularity;
* a mapping lies inside one reservation, covers a whole allocation and
  overlaps no other mapping (no double map);
* access is set on exactly one mapped range;
* unmap names exactly one mapping, a handle is released only once nothing
  in this process maps it (unmap before release), a reservation is freed
  only when nothing inside it is mapped;
* every fd it exported is closed by the caller (``check_clean``).

``fail(call)`` makes the next call of that kind fail with a ``CudaError``,
like a driver running out of memory; ``refuse(call)`` makes every call of
that kind fail, as a driver or a sandbox that lacks it does (gVisor without
VMM export, a node without IMEX channels for FABRIC handles).  FABRIC handles
exist only on a ``FakeGpu(fabric=True)``, as on real devices that say so
(``Support.fabric``): asking for one elsewhere is ``CUDA_ERROR_NOT_SUPPORTED``,
and exporting one from an allocation made without it
``CUDA_ERROR_INVALID_VALUE``.  Memory contents are not simulated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from rpcbuf.dataplane.cuda_vmm import CudaError, Support

MiB = 1 << 20


class RuleBroken(AssertionError):
    """The code under test did something CUDA or rpcbuf's rules forbid."""


@dataclass
class Allocation:
    nbytes: int
    fabric: bool = False  # made with the FABRIC handle type requested too
    handles: int = 0  # live handles, every process together
    mappings: int = 0


@dataclass
class FakeGpu:
    total: int = 1 << 30
    granularity: int = 2 * MiB
    recommended: int = 2 * MiB
    allocations: dict[int, Allocation] = field(default_factory=dict)
    by_inode: dict[int, int] = field(default_factory=dict)  # exported memfd inode -> allocation
    next_id: int = 1
    fabric: bool = False  # the device offers FABRIC handles

    @property
    def used(self) -> int:
        return sum(a.nbytes for a in self.allocations.values())

    def drop_if_dead(self, aid: int) -> None:
        a = self.allocations[aid]
        if not a.handles and not a.mappings:
            del self.allocations[aid]


FULL = Support(vmm=True, posix_fd=True)


class FakeDriver:
    def __init__(self, gpu: FakeGpu | None = None, device: int = 0,
                 support: Support = FULL) -> None:
        self.gpu = gpu if gpu is not None else FakeGpu()
        self.device = device
        self.support = support if not self.gpu.fabric else Support(
            support.vmm, support.posix_fd, support.gpudirect_rdma, fabric=True)
        self.calls: list[tuple[object, ...]] = []
        self.handles: dict[int, int] = {}  # handle -> allocation id
        self.reservations: dict[int, int] = {}  # ptr -> nbytes
        self.mappings: dict[int, tuple[int, int]] = {}  # ptr -> (nbytes, handle)
        self.access: dict[int, str] = {}  # mapped ptr -> "r" or "rw"
        self.exported: list[tuple[int, int]] = []  # (fd, inode)
        self._failing: dict[str, tuple[int, str]] = {}
        self._refused: dict[str, str] = {}
        self._next_handle = 1
        self._next_va = 0x7F00_0000_0000

    # -- test controls ----------------------------------------------------------------

    def fail(self, call: str, name: str = "CUDA_ERROR_OUT_OF_MEMORY", after: int = 0) -> None:
        """Make the call ``call`` (e.g. ``"cuMemMap"``) fail once, ``after`` calls from now."""
        self._failing[call] = (after, name)

    def refuse(self, call: str, name: str = "CUDA_ERROR_NOT_SUPPORTED") -> None:
        """Make every call ``call`` fail from now on (a driver without it)."""
        self._refused[call] = name

    def names(self) -> list[object]:
        return [c[0] for c in self.calls]

    def check_clean(self) -> None:
        """Nothing held: no handle, mapping or reservation; every exported fd closed."""
        assert not self.handles, f"handles not released: {self.handles}"
        assert not self.mappings, f"still mapped: {self.mappings}"
        assert not self.reservations, f"reservations not freed: {self.reservations}"
        assert not self.open_exports(), f"exported fds left open: {self.open_exports()}"

    def open_exports(self) -> list[int]:
        out = []
        for fd, ino in self.exported:
            try:
                if os.fstat(fd).st_ino == ino:
                    out.append(fd)
            except OSError:
                pass
        return out

    # -- the Driver protocol ------------------------------------------------------------

    def _enter(self, call: str, *args: object) -> None:
        self.calls.append((call, *args))
        if call in self._refused:
            raise CudaError(call, self._refused[call])
        armed = self._failing.get(call)
        if armed is not None:
            after, name = armed
            if after:
                self._failing[call] = (after - 1, name)
            else:
                del self._failing[call]
                raise CudaError(call, name)

    def _aligned(self, call: str, *values: int) -> None:
        g = self.gpu.granularity
        for v in values:
            if v <= 0 or v % g:
                raise RuleBroken(f"{call}: {v:#x} is not a positive multiple of {g:#x}")

    def granularity(self, *, recommended: bool = False) -> int:
        self._enter("cuMemGetAllocationGranularity", recommended)
        return self.gpu.recommended if recommended else self.gpu.granularity

    def create(self, nbytes: int, *, fabric: bool = False) -> int:
        self._enter("cuMemCreate", nbytes, fabric)
        self._aligned("cuMemCreate", nbytes)
        if fabric and not self.gpu.fabric:
            raise CudaError("cuMemCreate", "CUDA_ERROR_NOT_SUPPORTED")
        if self.gpu.used + nbytes > self.gpu.total:
            raise CudaError("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY")
        aid = self.gpu.next_id
        self.gpu.next_id += 1
        self.gpu.allocations[aid] = Allocation(nbytes, fabric=fabric, handles=1)
        return self._new_handle(aid)

    def _new_handle(self, aid: int) -> int:
        h = self._next_handle
        self._next_handle += 1
        self.handles[h] = aid
        return h

    def release(self, handle: int) -> None:
        self._enter("cuMemRelease", handle)
        if handle not in self.handles:
            raise RuleBroken(f"cuMemRelease of a handle that is not held: {handle}")
        if any(h == handle for _, h in self.mappings.values()):
            raise RuleBroken(f"cuMemRelease of handle {handle} while it is still mapped")
        aid = self.handles.pop(handle)
        self.gpu.allocations[aid].handles -= 1
        self.gpu.drop_if_dead(aid)

    def reserve(self, nbytes: int, alignment: int) -> int:
        self._enter("cuMemAddressReserve", nbytes, alignment)
        self._aligned("cuMemAddressReserve", nbytes, alignment)
        ptr = -(-self._next_va // alignment) * alignment
        self._next_va = ptr + nbytes + alignment  # never reused, never adjacent
        self.reservations[ptr] = nbytes
        return ptr

    def free_address(self, ptr: int, nbytes: int) -> None:
        self._enter("cuMemAddressFree", ptr, nbytes)
        if self.reservations.get(ptr) != nbytes:
            raise RuleBroken(f"cuMemAddressFree({ptr:#x}, {nbytes:#x}): no such reservation")
        if any(ptr <= p < ptr + nbytes for p in self.mappings):
            raise RuleBroken(f"cuMemAddressFree({ptr:#x}): still mapped inside")
        del self.reservations[ptr]

    def map(self, ptr: int, nbytes: int, handle: int) -> None:
        self._enter("cuMemMap", ptr, nbytes, handle)
        self._aligned("cuMemMap", ptr, nbytes)
        if handle not in self.handles:
            raise RuleBroken(f"cuMemMap of a handle that is not held: {handle}")
        alloc = self.gpu.allocations[self.handles[handle]]
        if nbytes != alloc.nbytes:
            raise RuleBroken(f"cuMemMap of {nbytes:#x} bytes of a {alloc.nbytes:#x} allocation")
        if not any(r <= ptr and ptr + nbytes <= r + n for r, n in self.reservations.items()):
            raise RuleBroken(f"cuMemMap at {ptr:#x}: not inside a reservation")
        for p, (n, _) in self.mappings.items():
            if p < ptr + nbytes and ptr < p + n:
                raise RuleBroken(f"cuMemMap at {ptr:#x}: overlaps the mapping at {p:#x}")
        self.mappings[ptr] = (nbytes, handle)
        alloc.mappings += 1

    def unmap(self, ptr: int, nbytes: int) -> None:
        self._enter("cuMemUnmap", ptr, nbytes)
        if ptr not in self.mappings or self.mappings[ptr][0] != nbytes:
            raise RuleBroken(f"cuMemUnmap({ptr:#x}, {nbytes:#x}): not exactly one mapping")
        _, handle = self.mappings.pop(ptr)
        self.access.pop(ptr, None)
        aid = self.handles[handle]
        self.gpu.allocations[aid].mappings -= 1
        self.gpu.drop_if_dead(aid)

    def set_access(self, ptr: int, nbytes: int, *, writable: bool) -> None:
        self._enter("cuMemSetAccess", ptr, nbytes, writable)
        if ptr not in self.mappings or self.mappings[ptr][0] != nbytes:
            raise RuleBroken(f"cuMemSetAccess({ptr:#x}, {nbytes:#x}): not one mapped range")
        self.access[ptr] = "rw" if writable else "r"

    def export(self, handle: int) -> int:
        self._enter("cuMemExportToShareableHandle", handle)
        if handle not in self.handles:
            raise RuleBroken(f"export of a handle that is not held: {handle}")
        fd = os.memfd_create(f"fakevmm-{self.handles[handle]}")
        ino = os.fstat(fd).st_ino
        self.gpu.by_inode[ino] = self.handles[handle]
        self.exported.append((fd, ino))
        return fd

    def export_fabric(self, handle: int) -> None:
        self._enter("cuMemExportToShareableHandle(FABRIC)", handle)
        if handle not in self.handles:
            raise RuleBroken(f"export of a handle that is not held: {handle}")
        if not self.gpu.allocations[self.handles[handle]].fabric:
            raise CudaError("cuMemExportToShareableHandle", "CUDA_ERROR_INVALID_VALUE")

    def import_fd(self, fd: int) -> int:
        self._enter("cuMemImportFromShareableHandle", fd)
        try:
            aid = self.gpu.by_inode.get(os.fstat(fd).st_ino)
        except OSError:
            aid = None
        if aid is None or aid not in self.gpu.allocations:
            raise CudaError("cuMemImportFromShareableHandle", "CUDA_ERROR_INVALID_VALUE")
        self.gpu.allocations[aid].handles += 1
        return self._new_handle(aid)

    def mem_info(self) -> tuple[int, int]:
        self._enter("cuMemGetInfo")
        return self.gpu.total - self.gpu.used, self.gpu.total

    def synchronize(self) -> None:
        self._enter("cuCtxSynchronize")
