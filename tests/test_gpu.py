"""GPU buffers on a real CUDA device (marked ``gpu``; skipped, with the
reason, where CuPy or a CUDA device is missing).  ``scripts/gpu_check.sh``
runs them on a GPU machine: ``pytest -m gpu``."""

from __future__ import annotations

import numpy as np
import pytest

import rpcbuf
from rpcbuf.dataplane import devsum as D

pytestmark = pytest.mark.gpu


def _cupy():  # type: ignore[no-untyped-def]
    try:
        import cupy
    except ImportError:
        pytest.skip("CuPy is not installed")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device is visible")
    except Exception as exc:  # no driver
        pytest.skip(f"no CUDA device is visible ({exc})")
    return cupy


@pytest.fixture(scope="module")
def cp():  # type: ignore[no-untyped-def]
    return _cupy()


@pytest.fixture(scope="module")
def gpu_daemon(cp, daemon_factory):  # type: ignore[no-untyped-def]
    return daemon_factory("--device", "cpu:256MiB", "--device", "cuda:0:512MiB",
                          "--transfer-timeout", "60s")


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, 1 << 20, (1 << 20) + 3])
@pytest.mark.parametrize("skip", [0, 1, 5])
def test_device_devsum_matches_host(cp, n: int, skip: int) -> None:  # type: ignore[no-untyped-def]
    host = np.random.default_rng(n).integers(0, 256, n + skip, dtype=np.uint8)
    dev = cp.asarray(host)[skip:]  # unaligned device slices take the byte path
    assert D.device_devsum(dev) == D.host_devsum(host[skip:])
    if n < 5000:
        assert D.device_devsum(dev) == D.reference(host[skip:].tobytes())


def test_cuda_arena(cp) -> None:  # type: ignore[no-untyped-def]
    from rpcbuf.dataplane.cuda_arena import CudaArena
    from rpcbuf.dataplane.devops import widen_f16

    arena = CudaArena(1 << 20, 0)
    desc = arena.describe()
    assert desc["device_type"] == "GPU" and desc["gpu_memory_total"] > 0 and desc["name"]
    v = arena.view(16, 1000)
    assert isinstance(v, cp.ndarray)
    v[...] = cp.arange(1000, dtype=cp.uint8)
    assert arena.checksum(16, 1000) == D.host_devsum(np.arange(1000, dtype=np.uint8))
    f = np.linspace(-1, 1, 256, dtype=np.float32)
    widen_f16(arena, 4096, cp.asarray(f.astype(np.float16)).view(cp.uint8))
    assert np.array_equal(arena.view(4096, f.nbytes).view(cp.float32).get(),
                          f.astype(np.float16).astype(np.float32))
    with pytest.raises(IndexError):
        arena.view(1 << 20, 1)


async def test_cupy_to_gpu_buffer(cp, gpu_daemon) -> None:  # type: ignore[no-untyped-def]
    async with gpu_daemon.connect() as c:
        buf = await c.request_buffer(64 << 20, device_type="GPU", device=0)
        try:
            src = cp.random.standard_normal(4 << 20, dtype=cp.float32)
            out = cp.empty_like(src)
            res = await c.store_tensor(buf, src, offset=64, verify="checksum")
            assert res["checksum_kind"] == "devsum"
            await c.read_buffer(buf, 64, out=out)
            assert bool((out == src).all())
            assert await c.verify_write(buf, 64, src)
        finally:
            await c.release_buffer(buf)


async def test_numpy_to_gpu_buffer(cp, gpu_daemon) -> None:  # type: ignore[no-untyped-def]
    async with gpu_daemon.connect() as c:
        buf = await c.request_buffer(8 << 20, device_type="gpu", device=0)
        try:
            src = np.random.default_rng(3).integers(0, 256, (8 << 20) - 5, dtype=np.uint8)
            res = await c.store_tensor(buf, src, verify="checksum")
            assert res["checksum_kind"] == "devsum"  # the client knows the buffer is a GPU's
            assert np.array_equal(await c.read_buffer(buf, 0, src.nbytes), src)
            await c.clear_buffer(buf, 7)
            assert (await c.read_buffer(buf, 0, 100) == 7).all()
        finally:
            await c.release_buffer(buf)


async def test_cupy_to_cpu_buffer(cp, gpu_daemon) -> None:  # type: ignore[no-untyped-def]
    async with gpu_daemon.connect() as c:
        buf = await c.request_buffer(16 << 20)
        try:
            src = cp.arange(3 << 20, dtype=cp.int32)
            res = await c.store_tensor(buf, src, verify="checksum")
            assert res["checksum_kind"] == "devsum"
            out = cp.zeros_like(src)
            await c.read_buffer(buf, out=out)
            assert bool((out == src).all())
            host = (await c.read_buffer(buf, 0, src.nbytes)).view(np.int32)
            assert np.array_equal(host, cp.asnumpy(src))
        finally:
            await c.release_buffer(buf)


async def test_copy_between_gpu_and_cpu_buffers(cp, gpu_daemon) -> None:  # type: ignore[no-untyped-def]
    async with gpu_daemon.connect() as c:
        g = await c.request_buffer(1 << 20, device_type="GPU")
        h = await c.request_buffer(1 << 20)
        try:
            src = np.random.default_rng(4).integers(0, 256, 1 << 20, dtype=np.uint8)
            await c.store_tensor(h, src)
            await c.copy_buffer(h, 0, g, 0, 1 << 20)
            await c.copy_buffer(g, 0, g, 100, 1000)  # overlapping, within the GPU buffer
            expect = src.copy()
            expect[100:1100] = src[0:1000]
            assert np.array_equal(await c.read_buffer(g), expect)
        finally:
            await c.release_buffer(g)
            await c.release_buffer(h)


async def test_wire_fp16_on_device(cp, gpu_daemon) -> None:  # type: ignore[no-untyped-def]
    async with gpu_daemon.connect() as c:
        buf = await c.request_buffer(8 << 20, device_type="GPU")
        try:
            src = cp.random.standard_normal(1 << 20, dtype=cp.float32)
            res = await c.store_tensor(buf, src, verify="checksum", wire_dtype="float16")
            assert res["nbytes"] == src.nbytes
            out = cp.empty_like(src)
            await c.read_buffer(buf, out=out)
            assert bool((out == src.astype(cp.float16).astype(cp.float32)).all())
            host = np.ones(1000, np.float32) / 3
            await c.store_tensor(buf, host, offset=4096, wire_dtype="float16")
            back = (await c.read_buffer(buf, 4096, host.nbytes)).view(np.float32)
            assert np.array_equal(back, host.astype(np.float16).astype(np.float32))
        finally:
            await c.release_buffer(buf)


async def test_torch_cuda_tensors(cp, gpu_daemon) -> None:  # type: ignore[no-untyped-def]
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    async with gpu_daemon.connect() as c:
        buf = await c.request_buffer(8 << 20, device_type="GPU")
        try:
            for dt in (torch.float32, torch.bfloat16, torch.int8):
                src = (torch.randn(512, 513, device="cuda") * 10).to(dt)
                await c.store_tensor(buf, src, verify="checksum")
                out = torch.empty_like(src)
                await c.read_buffer(buf, out=out)
                assert torch.equal(out, src)
            with pytest.raises(rpcbuf.BadRequest):
                await c.store_batch(buf, [(0, torch.zeros(4, device="cuda"))])
        finally:
            await c.release_buffer(buf)


async def test_gpu_map_writes_in_place(cp, gpu_daemon) -> None:  # type: ignore[no-untyped-def]
    """``ctx.map`` of a GPU buffer: its CUDA VMM handle imported writable, a
    CuPy array over the daemon's allocation; other sessions are BUSY while
    it is open; the verbs never map a GPU buffer by themselves (issue 35)."""
    async with gpu_daemon.connect() as c, gpu_daemon.connect() as other:
        devs = {d["key"]: d for d in await c.list_devices()}
        if devs["cuda:0"].get("backing") != "vmm":
            pytest.skip(f"no VMM backing: {devs['cuda:0'].get('backing_why')}")
        bid = await c.request_buffer(4 << 20, device_type="GPU", device=0)
        try:
            async with c.map(bid) as m:
                assert isinstance(m.array, cp.ndarray) and m.array.nbytes == 4 << 20
                m.array[:] = 7
                cp.cuda.Device(0).synchronize()
                with pytest.raises(rpcbuf.Busy):
                    await other.read_buffer(bid, 0, 16)
            assert (await other.read_buffer(bid, 0, 4 << 20) == 7).all()
            await c.store_tensor(bid, cp.ones(16, cp.uint8))
            assert c.in_place_counts()["stores"] == 0
        finally:
            await c.release_buffer(bid)


async def test_gpu_attach_is_zero_copy_and_busy(cp, gpu_daemon) -> None:  # type: ignore[no-untyped-def]
    """A GPU buffer attached through its CUDA VMM handle (read-only import):
    CuPy arrays over the daemon's allocation, stores BUSY, detach on close.
    Needs the VMM backing (``describe()["backing"] == "vmm"``).  The named
    tensor goes in by ``store_tensors`` from a host copy (the batch verbs take
    host arrays: the manifest's checksum is computed on the host) and by
    ``store_tensor`` from the device, over it."""
    async with gpu_daemon.connect() as c:
        devs = {d["key"]: d for d in await c.list_devices()}
        if devs["cuda:0"].get("backing") != "vmm":
            pytest.skip(f"no VMM backing: {devs['cuda:0'].get('backing_why')}")
        bid = await c.request_buffer(4 << 20, device_type="GPU", device=0)
        src = cp.arange(1 << 20, dtype=cp.float32)
        await c.store_tensors(bid, {"w": cp.asnumpy(src)})  # the manifest entry "w"
        await c.store_tensor(bid, src[::-1].copy(), verify="checksum")  # device -> GPU buffer
        async with c.attach(bid) as view:
            w = view.tensors()["w"]
            assert isinstance(w, cp.ndarray) and bool((w == src[::-1]).all())
            assert int(w.data.ptr) == view.address  # over the mapping itself: no copy
            with pytest.raises(rpcbuf.Busy):
                await c.store_tensor(bid, cp.zeros(8, cp.uint8))
            del w
        await c.store_tensor(bid, cp.zeros(8, cp.uint8))  # detached
        await c.release_buffer(bid)
