"""GPU buffers on CUDA VMM, the logic a CPU can check: the per-buffer backing
(``rpcbuf.dataplane.cuda_backing``), the client's import (``rpcbuf.dataplane.cuda_import``)
and the arena's choice of backing (``rpcbuf.dataplane.cuda_arena``) over a fake
driver that enforces CUDA's rules (``fakevmm.py``), and the real driver's
calls (``rpcbuf.dataplane.cuda_vmm.RealDriver``) over fake bindings that check the
arguments it builds.  The same calls on a real GPU: tests/test_gpu_vmm.py."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from fakevmm import FakeDriver, FakeGpu, MiB, RuleBroken
from hypothesis import given, settings, strategies as st

from rpcbuf.dataplane import cuda_arena
from rpcbuf.dataplane.allocator import BuddyAllocator
from rpcbuf.dataplane.cuda_backing import BackingError, Ledger, VmmBacking
from rpcbuf.dataplane.cuda_import import import_mapping
from rpcbuf.dataplane.cuda_vmm import CudaError, NoHandleSharing, RealDriver, Support, open_driver
from rpcbuf.dataplane.devsum import devsum

G = 2 * MiB


def backing(size: int = 64 * MiB, gpu: FakeGpu | None = None) -> tuple[VmmBacking, FakeDriver]:
    drv = FakeDriver(gpu)
    return VmmBacking(drv, size), drv


# -- backing: the happy sequences ---------------------------------------------------------


def test_reserves_once_and_backs_each_buffer_on_its_own() -> None:
    b, drv = backing(64 * MiB)
    assert drv.names() == ["cuMemGetAllocationGranularity", "cuMemGetAllocationGranularity",
                           "cuMemAddressReserve"]
    assert b.granularity == G and list(drv.reservations.values()) == [64 * MiB]
    drv.calls.clear()
    b.back(0, G)
    b.back(4 * MiB, 8 * MiB)
    assert drv.names() == ["cuMemCreate", "cuMemMap", "cuMemSetAccess"] * 2
    assert drv.mappings.keys() == {b.base, b.base + 4 * MiB}
    assert set(drv.access.values()) == {"rw"}
    assert len(drv.gpu.allocations) == 2 and drv.gpu.used == 10 * MiB
    assert b.ledger.items() == [(0, G), (4 * MiB, 8 * MiB)] and b.ledger.bytes == 10 * MiB
    assert "cuMemAddressReserve" not in drv.names()  # no reservation per buffer
    b.unback(0, G)
    assert drv.names()[-2:] == ["cuMemUnmap", "cuMemRelease"]  # unmap before release
    assert drv.gpu.used == 8 * MiB
    b.back(0, 4 * MiB)  # a freed range is backed again, bigger
    b.unback(0, 4 * MiB)
    b.unback(4 * MiB, 8 * MiB)
    assert drv.gpu.used == 0 and not drv.mappings and not drv.handles
    b.close()
    drv.check_clean()


def test_close_unbacks_what_is_left_and_is_idempotent() -> None:
    b, drv = backing()
    for i in range(5):
        b.back(i * 2 * G, G)
    b.close()
    b.close()
    drv.check_clean()
    assert drv.gpu.used == 0
    with pytest.raises(BackingError, match="closed"):
        b.back(0, G)
    with pytest.raises(BackingError, match="closed"):
        b.export(0, G)


def test_granularity_rounding() -> None:
    b, drv = backing(64 * MiB + 1)  # the range is rounded up, the arena is not
    assert b.reserved == 66 * MiB and b.ledger.size == 64 * MiB + 1
    drv.calls.clear()
    for offset, nbytes in [(0, 4096), (4096, G), (G, G + 1), (0, 0), (-G, G), (62 * MiB, 4 * MiB),
                           (0, 66 * MiB), (True, G)]:
        with pytest.raises(BackingError):
            b.back(offset, nbytes)
    assert drv.calls == []  # refused before any driver call
    b.back(62 * MiB, G)  # the last whole granule
    b.close()
    drv.check_clean()


def test_overlapping_and_double_backs_are_bugs() -> None:
    b, drv = backing()
    b.back(4 * MiB, 4 * MiB)
    drv.calls.clear()
    for offset, nbytes in [(4 * MiB, 4 * MiB), (4 * MiB, G), (G, 2 * G), (6 * MiB, 4 * MiB),
                           (0, 16 * MiB)]:
        with pytest.raises(BackingError, match="overlaps"):
            b.back(offset, nbytes)
    assert drv.calls == []
    b.back(G, G)  # touching is not overlapping
    b.back(8 * MiB, G)
    b.close()
    drv.check_clean()


def test_unback_of_what_is_not_backed_is_a_bug() -> None:
    b, drv = backing()
    b.back(0, 4 * MiB)
    drv.calls.clear()
    for offset, nbytes in [(0, G), (G, G), (0, 8 * MiB), (8 * MiB, G)]:
        with pytest.raises(BackingError, match="not exactly one backed buffer"):
            b.unback(offset, nbytes)
    assert drv.calls == []
    b.unback(0, 4 * MiB)
    with pytest.raises(BackingError):  # a double unback
        b.unback(0, 4 * MiB)
    b.close()
    drv.check_clean()


def test_covers() -> None:
    b, _ = backing()
    b.back(4 * MiB, 4 * MiB)
    assert b.covers(4 * MiB, 4 * MiB) and b.covers(5 * MiB, 100) and b.covers(8 * MiB - 1, 1)
    assert not b.covers(4 * MiB - 1, 2) and not b.covers(7 * MiB, 2 * MiB)
    assert not b.covers(0, 1) and not b.covers(8 * MiB, 1)
    b.close()


# -- backing: failures in the middle -----------------------------------------------------------


@pytest.mark.parametrize("call", ["cuMemCreate", "cuMemMap", "cuMemSetAccess"])
def test_a_failure_in_back_leaves_nothing(call: str) -> None:
    b, drv = backing()
    b.back(0, G)
    before = (dict(drv.mappings), dict(drv.handles), drv.gpu.used, b.ledger.items())
    drv.fail(call)
    with pytest.raises(CudaError, match=call) as err:
        b.back(4 * MiB, 4 * MiB)
    assert err.value.name == "CUDA_ERROR_OUT_OF_MEMORY" and err.value.call == call
    assert (dict(drv.mappings), dict(drv.handles), drv.gpu.used, b.ledger.items()) == before
    assert not b.covers(4 * MiB, 1)
    b.back(4 * MiB, 4 * MiB)  # the same block works once the driver does
    b.close()
    drv.check_clean()


def test_a_failed_undo_is_noted_and_the_first_error_raised() -> None:
    b, drv = backing()
    drv.fail("cuMemSetAccess", "CUDA_ERROR_INVALID_DEVICE")
    drv.fail("cuMemUnmap", "CUDA_ERROR_UNKNOWN")
    with pytest.raises(CudaError, match="CUDA_ERROR_INVALID_DEVICE") as err:
        b.back(0, G)
    assert any("CUDA_ERROR_UNKNOWN" in n for n in err.value.__notes__)
    assert not b.ledger.items()


def test_the_driver_out_of_memory() -> None:
    gpu = FakeGpu(total=8 * MiB)
    b, drv = backing(64 * MiB, gpu)  # an arena bigger than the device: only backs fail
    b.back(0, 8 * MiB)
    with pytest.raises(CudaError, match="OUT_OF_MEMORY"):
        b.back(8 * MiB, G)
    b.unback(0, 8 * MiB)
    b.back(8 * MiB, G)
    b.close()
    drv.check_clean()


def test_a_failed_unmap_keeps_the_buffer_backed() -> None:
    b, drv = backing()
    b.back(0, G)
    drv.fail("cuMemUnmap")
    with pytest.raises(CudaError):
        b.unback(0, G)
    assert b.ledger.items() == [(0, G)] and b.covers(0, G)
    b.unback(0, G)
    b.close()
    drv.check_clean()


def test_a_reserve_failure_is_a_cuda_error() -> None:
    drv = FakeDriver()
    drv.fail("cuMemAddressReserve")
    with pytest.raises(CudaError, match="cuMemAddressReserve"):
        VmmBacking(drv, 64 * MiB)
    drv.check_clean()


# -- export, and an importer in another "process" ------------------------------------------------


def test_export_gives_a_new_fd_for_exactly_one_buffer() -> None:
    b, drv = backing()
    b.back(0, 4 * MiB)
    b.back(8 * MiB, G)
    fds = [b.export(0, 4 * MiB), b.export(0, 4 * MiB), b.export(8 * MiB, G)]
    assert len(set(fds)) == 3
    for offset, nbytes in [(0, G), (G, G), (0, 10 * MiB), (4 * MiB, G), (16 * MiB, G)]:
        with pytest.raises(BackingError, match="export of"):
            b.export(offset, nbytes)
    assert drv.open_exports() == fds  # the caller owns them ...
    for fd in fds:
        os.close(fd)  # ... and closes them after sending
    b.unback(0, 4 * MiB)
    with pytest.raises(BackingError):  # an unbacked buffer cannot be exported
        b.export(0, 4 * MiB)
    b.close()
    drv.check_clean()


def test_an_export_failure_leaves_no_fd() -> None:
    b, drv = backing()
    b.back(0, G)
    drv.fail("cuMemExportToShareableHandle", "CUDA_ERROR_NOT_PERMITTED")
    with pytest.raises(CudaError, match="NOT_PERMITTED"):
        b.export(0, G)
    b.close()
    drv.check_clean()


@pytest.mark.parametrize("writable", [False, True])
def test_imported_memory_outlives_the_arenas_unback(writable: bool) -> None:
    gpu = FakeGpu()
    b, daemon = backing(64 * MiB, gpu)
    client = FakeDriver(gpu)
    b.back(4 * MiB, 4 * MiB)
    fd = b.export(4 * MiB, 4 * MiB)
    m = import_mapping(fd, 4 * MiB, client, writable=writable)
    with pytest.raises(OSError):
        os.fstat(fd)  # import closed the fd it was given
    assert client.names() == ["cuMemGetAllocationGranularity", "cuMemImportFromShareableHandle",
                              "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"]
    assert client.access == {m.ptr: "rw" if writable else "r"}
    assert m.ptr != b.base + 4 * MiB  # its own virtual range
    b.unback(4 * MiB, 4 * MiB)
    assert gpu.used == 4 * MiB  # the importer still holds it
    client.calls.clear()
    m.close()
    m.close()
    assert client.names() == ["cuCtxSynchronize", "cuMemUnmap", "cuMemRelease",
                              "cuMemAddressFree"]
    assert gpu.used == 0
    b.close()
    daemon.check_clean()
    client.check_clean()


# -- import: refusals and failures --------------------------------------------------------------


def _exported(gpu: FakeGpu) -> tuple[VmmBacking, FakeDriver, int]:
    b, daemon = backing(64 * MiB, gpu)
    b.back(0, 4 * MiB)
    return b, daemon, b.export(0, 4 * MiB)


@pytest.mark.parametrize("nbytes", [0, -G, G + 1, 4096, 4.0 * MiB, True])
def test_import_refuses_a_bad_size_and_closes_the_fd(nbytes: Any) -> None:
    gpu = FakeGpu()
    b, daemon, fd = _exported(gpu)
    client = FakeDriver(gpu)
    with pytest.raises(ValueError, match="multiple of"):
        import_mapping(fd, nbytes, client)
    assert not daemon.open_exports()
    b.close()
    client.check_clean()


def test_import_on_a_device_without_vmm() -> None:
    gpu = FakeGpu()
    b, daemon, fd = _exported(gpu)
    client = FakeDriver(gpu, support=Support(vmm=True, posix_fd=False))
    with pytest.raises(NoHandleSharing, match="POSIX file descriptor"):
        import_mapping(fd, 4 * MiB, client)
    assert not daemon.open_exports() and client.calls == []
    b.close()


def test_import_of_a_foreign_fd() -> None:
    client = FakeDriver()
    fd = os.open(os.devnull, os.O_RDONLY)
    with pytest.raises(CudaError, match="INVALID_VALUE"):
        import_mapping(fd, 4 * MiB, client)
    with pytest.raises(OSError):
        os.fstat(fd)
    client.check_clean()


@pytest.mark.parametrize("call", ["cuMemAddressReserve", "cuMemMap", "cuMemSetAccess"])
def test_a_failure_in_import_leaves_nothing(call: str) -> None:
    gpu = FakeGpu()
    b, daemon, fd = _exported(gpu)
    client = FakeDriver(gpu)
    client.fail(call)
    with pytest.raises(CudaError, match=call):
        import_mapping(fd, 4 * MiB, client)
    client.check_clean()
    assert not daemon.open_exports()
    b.close()
    assert gpu.used == 0  # the importer's handle was released too


def test_import_close_after_a_failed_unmap_frees_nothing_under_the_mapping() -> None:
    gpu = FakeGpu()
    b, _, fd = _exported(gpu)
    client = FakeDriver(gpu)
    m = import_mapping(fd, 4 * MiB, client)
    client.fail("cuMemUnmap")
    with pytest.raises(CudaError):
        m.close()
    assert client.names()[-2:] == ["cuCtxSynchronize", "cuMemUnmap"]  # no release, no free
    m.close()  # closed is closed: the leak is reported once
    b.close()


# -- the backing against the allocator, step by step ------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 9 * MiB), st.integers(0, 50)),
                max_size=40))
def test_backing_follows_the_allocator(steps: list[tuple[bool, int, int]]) -> None:
    """The registry's use: allocate with min_block = granularity, back what it
    hands out, unback at free.  After every step the backed ranges are the
    allocated blocks, each mapped once, and the device holds exactly them."""
    size = 32 * MiB
    alloc = BuddyAllocator(size, min_block=G)
    b, drv = backing(size, FakeGpu(total=24 * MiB))
    live: dict[int, int] = {}
    for is_alloc, nbytes, pick in steps:
        if is_alloc or not live:
            offset = alloc.allocate(nbytes)
            if offset is None:
                continue
            block = alloc.block_size(nbytes)
            try:
                b.back(offset, block)
            except CudaError:  # the device is smaller than the arena: undo, as the registry does
                alloc.free(offset)
                continue
            live[offset] = block
        else:
            offset = sorted(live)[pick % len(live)]
            b.unback(offset, live.pop(offset))
            alloc.free(offset)
        assert b.ledger.items() == sorted(live.items())
        assert {p - b.base: n for p, (n, _) in drv.mappings.items()} == live
        assert drv.gpu.used == sum(live.values()) == b.ledger.bytes
    b.close()
    drv.check_clean()


def test_the_fake_enforces_the_rules() -> None:
    """The fake refuses what the code under test must never do (else the
    tests above could not fail)."""
    drv = FakeDriver()
    ptr = drv.reserve(8 * MiB, G)
    h = drv.create(G)
    with pytest.raises(RuleBroken, match="multiple"):
        drv.create(G + 4096)
    with pytest.raises(RuleBroken, match="not inside a reservation"):
        drv.map(ptr + 8 * MiB, G, h)
    with pytest.raises(RuleBroken, match="allocation"):
        drv.map(ptr, 2 * G, h)
    drv.map(ptr, G, h)
    h2 = drv.create(G)
    with pytest.raises(RuleBroken, match="overlaps"):
        drv.map(ptr, G, h2)
    with pytest.raises(RuleBroken, match="still mapped"):
        drv.release(h)
    with pytest.raises(RuleBroken, match="still mapped inside"):
        drv.free_address(ptr, 8 * MiB)
    with pytest.raises(RuleBroken, match="not one mapped range"):
        drv.set_access(ptr, 2 * G, writable=True)
    with pytest.raises(RuleBroken, match="not exactly one mapping"):
        drv.unmap(ptr + G, G)
    fd = drv.export(h)
    with pytest.raises(AssertionError, match="handles not released"):
        drv.check_clean()
    drv.unmap(ptr, G)
    drv.release(h)
    drv.release(h2)
    drv.free_address(ptr, 8 * MiB)
    with pytest.raises(AssertionError, match="exported fds left open"):
        drv.check_clean()
    os.close(fd)
    drv.check_clean()


def test_ledger_sizes() -> None:
    led = Ledger(10 * G, G)
    led.add(0, G)
    led.add(4 * G, 2 * G)
    assert len(led) == 2 and led.bytes == 3 * G
    led.remove(0, G)
    assert led.items() == [(4 * G, 2 * G)]


# -- the arena: which backing, and the VMM arena over the fake driver -----------------------------


def test_the_cupy_backing_by_default(fake_cupy: Any) -> None:
    arena = cuda_arena.CudaArena(16 * MiB, 1)
    assert arena.backing == "cupy" and arena.granularity == 256
    d = arena.describe()
    assert d["backing"] == "cupy" and d["granularity"] == 256 and d["backing_why"]
    arena.back(0, 4096)  # the books are kept, with the same rules
    with pytest.raises(BackingError):
        arena.back(256, 256)
    with pytest.raises(BackingError):
        arena.back(100, 256)
    with pytest.raises(NoHandleSharing, match="cannot be shared by handle"):
        arena.export(0, 4096)
    arena.view(8192, 16)[...] = 3  # views need no backing here (one allocation)
    arena.unback(0, 4096)
    with pytest.raises(BackingError):
        arena.unback(0, 4096)
    arena.close()


@pytest.mark.parametrize("support, why", [
    (Support(vmm=False, posix_fd=True), "virtual memory management"),
    (Support(vmm=True, posix_fd=False), "POSIX file descriptor"),
])
def test_falls_back_where_vmm_is_missing(fake_cupy: Any, support: Support, why: str) -> None:
    drv = FakeDriver(support=support)
    arena = cuda_arena.CudaArena(16 * MiB, 0, vmm=None, driver=drv)
    assert arena.backing == "cupy" and why in arena.describe()["backing_why"]
    with pytest.raises(NoHandleSharing, match=why):
        arena.export(0, 256)
    with pytest.raises(cuda_arena.DeviceUnavailable,
                       match=f"cuda:0: CUDA VMM was asked for.*{why}"):
        cuda_arena.CudaArena(16 * MiB, 0, vmm=True, driver=drv)
    drv.check_clean()


def test_falls_back_without_a_driver(fake_cupy: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_driver(device: int) -> Any:
        raise NoHandleSharing("no usable CUDA driver (DynamicLibNotFoundError: ...)")

    monkeypatch.setattr(cuda_arena, "open_driver", no_driver)
    arena = cuda_arena.CudaArena(16 * MiB, 0, vmm=None)
    assert arena.backing == "cupy" and "no usable CUDA driver" in arena.backing_why
    drv = FakeDriver()
    drv.fail("cuMemAddressReserve")
    arena = cuda_arena.CudaArena(16 * MiB, 0, vmm=None, driver=drv)
    assert arena.backing == "cupy" and "cannot reserve" in arena.backing_why


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="a CUDA driver is here")
def test_a_failed_view_of_the_range_gives_it_back(fake_cupy: Any,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("no view")

    monkeypatch.setattr(cuda_arena, "device_array", broken)
    drv = FakeDriver()
    with pytest.raises(cuda_arena.DeviceUnavailable, match="cuda:0: cannot view"):
        cuda_arena.CudaArena(16 * MiB, 0, vmm=True, driver=drv)
    drv.check_clean()


def test_open_driver_without_libcuda_is_unsupported_device() -> None:
    pytest.importorskip("cuda.bindings.driver")
    with pytest.raises(NoHandleSharing, match="no usable CUDA driver"):
        open_driver(0)


@pytest.fixture
def vmm_arena(fake_cupy: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A VMM arena over the fake driver; host memory stands in for its range."""
    monkeypatch.setattr(cuda_arena, "device_array",
                        lambda cp, ptr, nbytes, device, owner: np.zeros(nbytes, np.uint8))
    drv = FakeDriver(FakeGpu(total=64 * MiB))
    arena = cuda_arena.CudaArena(63 * MiB, 0, vmm=True, driver=drv)
    arena.fake = drv
    yield arena
    arena.close()
    drv.check_clean()


def test_vmm_arena_views_only_inside_backed_buffers(vmm_arena: Any) -> None:
    a = vmm_arena
    assert a.backing == "vmm" and a.granularity == G and "backing_why" not in a.describe()
    with pytest.raises(IndexError, match="not inside one backed buffer"):
        a.view(0, 1)
    a.back(0, 4 * MiB)
    a.back(4 * MiB, G)
    data = np.arange(1000, dtype=np.uint8)
    a.view(100, 1000)[...] = data
    assert a.checksum(100, 1000) == devsum(data)
    assert a.checksums([100, 4 * MiB], [1000, G]) == [
        cuda_arena.xxh3(data.data), cuda_arena.xxh3(bytes(G))]
    for offset, nbytes in [(4 * MiB - 1, 2), (0, 6 * MiB + 1), (6 * MiB, 1)]:
        with pytest.raises(IndexError):
            a.view(offset, nbytes)
        with pytest.raises(IndexError):
            a.checksums([0, offset], [1, nbytes])
    with pytest.raises(IndexError, match="outside the arena"):
        a.view(63 * MiB, 1)
    assert a.view(10 * MiB, 0).nbytes == 0  # an empty view touches nothing
    cuda_arena.copy_device(a, 100, a, 4 * MiB, 1000)  # between two buffers of one arena
    assert np.array_equal(a.view(4 * MiB, 1000), data)
    a.unback(0, 4 * MiB)
    with pytest.raises(IndexError):  # a freed buffer's range is no longer viewable
        a.view(100, 1)


def test_vmm_arena_back_unback_export(vmm_arena: Any) -> None:
    a, drv = vmm_arena, vmm_arena.fake
    with pytest.raises(BackingError):
        a.back(256, 256)  # the cupy backing's alignment is not enough here
    a.back(8 * MiB, 4 * MiB)
    fd = a.export(8 * MiB, 4 * MiB)
    os.close(fd)
    with pytest.raises(BackingError):
        a.export(8 * MiB, G)
    drv.fail("cuMemCreate")
    with pytest.raises(CudaError):
        a.back(0, G)
    assert not a._vmm.covers(0, 1)
    a.unback(8 * MiB, 4 * MiB)
    with pytest.raises(BackingError):
        a.unback(8 * MiB, 4 * MiB)
    assert drv.gpu.used == 0


# -- the real driver's calls, over fake bindings ------------------------------------------------


class FakeBindings:
    """``cuda.bindings.driver`` with the real enums and structs and fake
    functions that check what RealDriver passes them."""

    def __init__(self, cu: Any, rdma: int = 0, fabric: int = 0) -> None:
        self.real = cu
        for name in ("CUresult", "CUdevice_attribute", "CUmemAllocationHandleType",
                     "CUmemAllocationProp", "CUmemAllocationType", "CUmemLocationType",
                     "CUmemAllocationGranularity_flags", "CUmemAccessDesc", "CUmemAccess_flags"):
            setattr(self, name, getattr(cu, name))
        a = cu.CUdevice_attribute
        self.attrs = {a.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED: 1,
                      a.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED: 1,
                      a.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED: rdma,
                      a.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED: fabric}
        self.ok = cu.CUresult.CUDA_SUCCESS
        self.init_result = self.ok
        self.handle_types: list[int] = []
        self.exported_kinds: list[Any] = []
        self.depth = 0
        self.calls: list[str] = []
        self.result = self.ok
        self.access: list[Any] = []

    def _ctx(self, name: str) -> None:
        self.calls.append(name)
        assert self.depth == 1, f"{name} outside the primary context"

    def _prop(self, prop: Any) -> None:
        cu = self.real
        assert isinstance(prop, cu.CUmemAllocationProp)
        assert prop.type == cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        assert prop.location.type == cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        assert prop.location.id == 1
        # The C field, read raw: a mask (POSIX fd | FABRIC) has no enum member
        # for the bindings' getter to return.
        mask = ctypes.c_uint32.from_address(int(prop.getPtr()) + 4).value
        kinds = cu.CUmemAllocationHandleType
        posix, fabric = (int(kinds.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                         int(kinds.CU_MEM_HANDLE_TYPE_FABRIC))
        assert mask in (posix, posix | fabric), mask
        self.handle_types.append(mask)

    def cuInit(self, flags: int) -> tuple[Any]:
        assert flags == 0
        return (self.init_result,)

    def cuDeviceGet(self, n: int) -> tuple[Any, Any]:
        return self.ok, self.real.CUdevice(n)

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> tuple[Any, Any]:
        assert int(dev) == 1
        return self.ok, "primary-ctx-1"

    def cuDeviceGetAttribute(self, attr: Any, dev: Any) -> tuple[Any, int]:
        return self.ok, self.attrs[attr]

    def cuCtxPushCurrent(self, ctx: Any) -> tuple[Any]:
        assert ctx == "primary-ctx-1" and self.depth == 0
        self.depth += 1
        return (self.ok,)

    def cuCtxPopCurrent(self) -> tuple[Any, Any]:
        self.depth -= 1
        return self.ok, "primary-ctx-1"

    def cuMemGetAllocationGranularity(self, prop: Any, flag: Any) -> tuple[Any, int]:
        self._ctx("granularity")
        self._prop(prop)
        f = self.real.CUmemAllocationGranularity_flags
        return self.ok, {f.CU_MEM_ALLOC_GRANULARITY_MINIMUM: G,
                         f.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED: 2 * G}[flag]

    def cuMemCreate(self, nbytes: int, prop: Any, flags: int) -> tuple[Any, Any]:
        self._ctx("create")
        self._prop(prop)
        assert flags == 0
        self.rdma_flag = prop.allocFlags.gpuDirectRDMACapable
        return self.result, self.real.CUmemGenericAllocationHandle(77)

    def cuMemRelease(self, handle: int) -> tuple[Any]:
        self._ctx("release")
        assert handle == 77
        return (self.ok,)

    def cuMemAddressReserve(self, nbytes: int, align: int, addr: int, flags: int
                            ) -> tuple[Any, Any]:
        self._ctx("reserve")
        assert (align, addr, flags) == (G, 0, 0)
        return self.ok, self.real.CUdeviceptr(0x7000_0000_0000)

    def cuMemAddressFree(self, ptr: int, nbytes: int) -> tuple[Any]:
        self._ctx("free")
        return (self.ok,)

    def cuMemMap(self, ptr: int, nbytes: int, offset: int, handle: int, flags: int
                 ) -> tuple[Any]:
        self._ctx("map")
        assert (offset, handle, flags) == (0, 77, 0)
        return (self.ok,)

    def cuMemUnmap(self, ptr: int, nbytes: int) -> tuple[Any]:
        self._ctx("unmap")
        return (self.ok,)

    def cuMemSetAccess(self, ptr: int, nbytes: int, descs: list[Any], count: int
                       ) -> tuple[Any]:
        self._ctx("access")
        assert count == len(descs) == 1 and isinstance(descs[0], self.real.CUmemAccessDesc)
        assert descs[0].location.id == 1
        assert descs[0].location.type == self.real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self.access.append(descs[0].flags)
        return (self.ok,)

    def cuMemExportToShareableHandle(self, handle: int, kind: Any, flags: int
                                     ) -> tuple[Any, int]:
        self._ctx("export")
        assert handle == 77 and flags == 0
        kinds = self.real.CUmemAllocationHandleType
        assert kind in (kinds.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                        kinds.CU_MEM_HANDLE_TYPE_FABRIC)
        self.exported_kinds.append(kind)
        return self.ok, 42 if kind == kinds.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR else b"f"

    def cuMemImportFromShareableHandle(self, fd: int, kind: Any) -> tuple[Any, Any]:
        self._ctx("import")
        assert fd == 42 and isinstance(fd, int)
        assert kind == self.real.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return self.ok, self.real.CUmemGenericAllocationHandle(77)

    def cuMemGetInfo(self) -> tuple[Any, int, int]:
        self._ctx("info")
        return self.ok, 5, 8

    def cuCtxSynchronize(self) -> tuple[Any]:
        self._ctx("sync")
        return (self.ok,)


@pytest.fixture
def bindings() -> Any:
    return pytest.importorskip("cuda.bindings.driver")


@pytest.mark.parametrize("rdma", [0, 1])
def test_real_driver_calls(bindings: Any, rdma: int) -> None:
    fake = FakeBindings(bindings, rdma=rdma)
    drv = RealDriver(1, cu=fake)
    assert drv.support == Support(vmm=True, posix_fd=True, gpudirect_rdma=bool(rdma))
    assert drv.granularity() == G and drv.granularity(recommended=True) == 2 * G
    h = drv.create(4 * MiB)
    assert h == 77 and fake.rdma_flag == rdma
    ptr = drv.reserve(8 * MiB, G)
    assert ptr == 0x7000_0000_0000
    drv.map(ptr, 4 * MiB, h)
    drv.set_access(ptr, 4 * MiB, writable=True)
    drv.set_access(ptr, 4 * MiB, writable=False)
    flags = bindings.CUmemAccess_flags
    assert fake.access == [flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
                           flags.CU_MEM_ACCESS_FLAGS_PROT_READ]
    assert drv.export(h) == 42 and drv.import_fd(42) == 77
    assert drv.mem_info() == (5, 8)
    drv.synchronize()
    drv.unmap(ptr, 4 * MiB)
    drv.release(h)
    drv.free_address(ptr, 8 * MiB)
    assert fake.depth == 0  # every push popped
    assert fake.calls == ["granularity", "granularity", "create", "reserve", "map", "access",
                          "access", "export", "import", "info", "sync", "unmap", "release",
                          "free"]


def test_real_driver_errors(bindings: Any) -> None:
    fake = FakeBindings(bindings)
    drv = RealDriver(1, cu=fake)
    fake.result = bindings.CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaError) as err:
        drv.create(G)
    assert (err.value.call, err.value.name) == ("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY")
    assert fake.depth == 0

    def missing(*args: Any) -> Any:
        raise RuntimeError('Function "cuMemMap" not found')

    fake.cuMemMap = missing  # type: ignore[method-assign]
    with pytest.raises(CudaError, match=r"RuntimeError.*not found"):
        drv.map(0x7000_0000_0000, G, 77)
    assert fake.depth == 0

    def no_library(flags: int) -> Any:
        raise OSError("libcuda.so.1: cannot open shared object file")

    fake.cuInit = no_library  # type: ignore[method-assign]
    with pytest.raises(NoHandleSharing, match=r"no usable CUDA driver.*libcuda"):
        RealDriver(1, cu=fake)


def test_real_driver_checks_what_cuinit_returns(bindings: Any) -> None:
    """cuInit returns its error (no device, a driver too old) rather than
    raising it: the driver is unusable, and says why."""
    fake = FakeBindings(bindings)
    fake.init_result = bindings.CUresult.CUDA_ERROR_NO_DEVICE
    with pytest.raises(NoHandleSharing, match=r"no usable CUDA driver.*cuInit.*NO_DEVICE"):
        RealDriver(1, cu=fake)


@pytest.mark.parametrize("fabric", [0, 1])
def test_real_driver_asks_for_fabric_handles_where_offered(bindings: Any, fabric: int) -> None:
    fake = FakeBindings(bindings, fabric=fabric)
    drv = RealDriver(1, cu=fake)
    assert drv.support.fabric is bool(fabric)
    kinds = bindings.CUmemAllocationHandleType
    posix, fab = (int(kinds.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                  int(kinds.CU_MEM_HANDLE_TYPE_FABRIC))
    drv.create(G)
    assert fake.handle_types == [posix]
    if fabric:
        drv.create(G, fabric=True)
        assert fake.handle_types == [posix, posix | fab]  # both, as one mask
        drv.export_fabric(77)
        assert fake.exported_kinds == [kinds.CU_MEM_HANDLE_TYPE_FABRIC]
    else:
        with pytest.raises(CudaError, match=r"NOT_SUPPORTED.*no FABRIC"):
            drv.create(G, fabric=True)
    assert drv.export(77) == 42  # the attach's POSIX fd either way
    assert fake.depth == 0


# -- the probe at arena creation ----------------------------------------------------------


@pytest.mark.parametrize("call", ["cuMemCreate", "cuMemMap", "cuMemSetAccess",
                                  "cuMemExportToShareableHandle"])
def test_a_refused_probe_falls_back_to_cupy(fake_cupy: Any, call: str) -> None:
    """A device whose attributes say VMM but whose driver refuses a step
    (gVisor, say) gets a plain CuPy arena at start, not failing buffers."""
    drv = FakeDriver()
    drv.refuse(call)
    arena = cuda_arena.CudaArena(16 * MiB, 0, vmm=None, driver=drv)
    assert arena.backing == "cupy", arena.describe()
    assert "VMM probe failed" in arena.backing_why and call in arena.backing_why
    drv.check_clean()  # the probe's granule and the reserved range are given back
    with pytest.raises(cuda_arena.DeviceUnavailable, match=f"asked for.*probe failed.*{call}"):
        cuda_arena.CudaArena(16 * MiB, 0, vmm=True, driver=drv)
    drv.check_clean()


def test_the_probe_leaves_nothing_and_is_the_first_thing_done(vmm_arena: Any) -> None:
    drv = vmm_arena.fake
    assert drv.names()[:9] == [
        "cuMemGetAllocationGranularity", "cuMemGetAllocationGranularity", "cuMemAddressReserve",
        "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemExportToShareableHandle",
        "cuMemUnmap", "cuMemRelease"]
    assert not drv.mappings and not drv.handles and drv.gpu.used == 0
    assert not drv.open_exports()  # the probe's fd was closed


def test_fabric_handles_where_the_device_offers_them(fake_cupy: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX's cuda_ipc shares VMM memory only by FABRIC handle: where the
    device has them, every buffer's allocation asks for one too."""
    monkeypatch.setattr(cuda_arena, "device_array",
                        lambda cp, ptr, nbytes, device, owner: np.zeros(nbytes, np.uint8))
    drv = FakeDriver(FakeGpu(fabric=True))
    arena = cuda_arena.CudaArena(16 * MiB, 0, vmm=None, driver=drv)
    assert arena.backing == "vmm" and arena.describe()["fabric"] is True
    assert "fabric_why" not in arena.describe()
    arena.back(0, G)
    assert [a.fabric for a in drv.gpu.allocations.values()] == [True]
    os.close(arena.export(0, G))  # the attach's POSIX fd still works
    arena.close()
    drv.check_clean()


@pytest.mark.parametrize("fabric_gpu", [False, True])
def test_vmm_without_fabric_says_why(fake_cupy: Any, monkeypatch: pytest.MonkeyPatch,
                                     fabric_gpu: bool) -> None:
    monkeypatch.setattr(cuda_arena, "device_array",
                        lambda cp, ptr, nbytes, device, owner: np.zeros(nbytes, np.uint8))
    drv = FakeDriver(FakeGpu(fabric=fabric_gpu))
    if fabric_gpu:  # offered, but refused (a node without IMEX channels)
        drv.refuse("cuMemExportToShareableHandle(FABRIC)", "CUDA_ERROR_NOT_PERMITTED")
    arena = cuda_arena.CudaArena(16 * MiB, 0, vmm=None, driver=drv)
    d = arena.describe()
    assert d["backing"] == "vmm" and d["fabric"] is False
    assert ("NOT_PERMITTED" if fabric_gpu else "offers no FABRIC") in d["fabric_why"]
    arena.back(0, G)
    assert [a.fabric for a in drv.gpu.allocations.values()] == [False]
    arena.close()
    drv.check_clean()


def test_the_fake_refuses_as_the_driver_does() -> None:
    drv = FakeDriver()
    with pytest.raises(CudaError, match="NOT_SUPPORTED"):  # no FABRIC on this device
        drv.create(G, fabric=True)
    h = drv.create(G)
    with pytest.raises(CudaError, match="INVALID_VALUE"):  # made without FABRIC
        drv.export_fabric(h)
    drv.refuse("cuMemExportToShareableHandle")
    for _ in range(2):  # every time, not once
        with pytest.raises(CudaError, match="NOT_SUPPORTED"):
            drv.export(h)
    drv.release(h)
    drv.check_clean()
