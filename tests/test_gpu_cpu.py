"""Issue 6 (GPU buffers), the parts a CPU machine can test: the devsum
checksum, zero-copy views of torch/DLPack arrays, wire fp16, the CUDA UCX
defaults, the clear start-up error without CuPy, and the daemon's GPU code
paths against a NumPy-backed fake CuPy (tests/fakecupy)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import rpcbuf
from rpcbuf.control.client.arrays import as_bytes
from rpcbuf.control.client.datapath import Transfer
from rpcbuf.control.wire import protocol as P
from rpcbuf.dataplane import devsum as D, ucx

FAKE = Path(__file__).parent / "fakecupy"

# -- devsum -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 9))
def test_devsum_numpy_matches_reference(data: bytes, skip: int) -> None:
    buf = np.frombuffer(bytes(skip) + data, dtype=np.uint8)[skip:]  # unaligned starts
    assert D.host_devsum(buf) == D.reference(data)
    assert D.devsum(buf) == D.reference(data)


def test_devsum_chunks_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    data = np.random.default_rng(1).integers(0, 256, 8 * 37 + 5, dtype=np.uint8)
    whole = D.host_devsum(data)
    monkeypatch.setattr(D, "_CHUNK", 4)
    monkeypatch.setattr(D, "_ODD", D._ODD[:4].copy())
    assert D.host_devsum(data) == whole == D.reference(data.tobytes())


def test_devsum_large_words_wrap() -> None:
    data = np.full(8 * 1000 + 3, 0xFF, dtype=np.uint8)
    assert D.host_devsum(data) == D.reference(data.tobytes())


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=1, max_size=200), st.data())
def test_devsum_sees_every_byte_change(data: bytes, draw: st.DataObject) -> None:
    i = draw.draw(st.integers(0, len(data) - 1))
    flip = draw.draw(st.integers(1, 255))
    changed = bytearray(data)
    changed[i] ^= flip
    assert D.reference(bytes(changed)) != D.reference(data)
    assert D.host_devsum(changed) != D.host_devsum(data)


def test_devsum_counts_length_and_order() -> None:
    assert D.host_devsum(b"abc") != D.host_devsum(b"abc\0")
    assert D.host_devsum(b"") != D.host_devsum(b"\0")
    a, b = b"A" * 8, b"B" * 8
    assert D.host_devsum(a + b) != D.host_devsum(b + a)
    assert D.host_devsum(b"") == D.finish(0, 0)


# -- UCX defaults for CUDA ------------------------------------------------------------


def test_cuda_ucx_defaults_respect_the_user() -> None:
    env: dict[str, str] = {"UCX_TLS": "tcp"}
    ucx.apply_defaults(env, cuda=True)
    assert env["UCX_TLS"] == "tcp,cuda_copy,cuda_ipc"
    # Host bounce buffers stay (tcp stages device memory through them), and
    # UCP picks the rendezvous scheme (put_zcopy excludes the staged ones).
    assert env["UCX_RNDV_FRAG_MEM_TYPE"] == "host,cuda"
    assert env["UCX_RNDV_SCHEME"] == "auto"
    env = {"UCX_TLS": "rc,cuda_copy", "UCX_RNDV_FRAG_MEM_TYPE": "host",
           "UCX_RNDV_SCHEME": "put_zcopy"}
    ucx.apply_defaults(env, cuda=True)
    assert env["UCX_TLS"] == "rc,cuda_copy" and env["UCX_RNDV_FRAG_MEM_TYPE"] == "host"
    assert env["UCX_RNDV_SCHEME"] == "put_zcopy"
    env = {"UCX_TLS": "tcp", "RPCBUF_UCX_CUDA": "0"}
    ucx.apply_defaults(env, cuda=True)
    assert env["UCX_TLS"] == "tcp" and env["UCX_RNDV_FRAG_MEM_TYPE"] == "host"
    assert env["UCX_RNDV_SCHEME"] == "auto"  # host default too: put_zcopy needs the tcp PUT
    env = {}
    ucx.apply_defaults(env, cuda=False)
    assert "UCX_TLS" not in env and env["UCX_RNDV_FRAG_MEM_TYPE"] == "host"
    assert ucx.with_cuda_tls("^ib") == "^ib" and ucx.with_cuda_tls("all") == "all"


def test_ucx_reads_the_cuda_defaults_as_meant() -> None:
    """The names and values are UCX's own: a context made under them shows
    host and device bounce buffers and UCP's choice of scheme, and ucxx's
    import (which sets ``UCX_RNDV_FRAG_MEM_TYPE=cuda`` when it is unset)
    leaves them alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_RNDV")}
    env.update({"UCX_TLS": "tcp", "UCX_LOG_LEVEL": "error", "RPCBUF_UCX_CUDA": "1"})
    code = ("from rpcbuf.dataplane import ucx; ucx.ucxx(); from ucxx._lib import libucxx as u; "
            "c = dict(u.UCXContext().config); print(c['RNDV_FRAG_MEM_TYPES'], c['RNDV_SCHEME'])")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["host,cuda", "auto"], res.stdout


# -- the daemon without CuPy / without the device ---------------------------------------


def _daemon(tmp: Path, *flags: str, env: dict[str, str] | None = None
            ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rpcbuf.control.daemon", "--secret-file",
                           str(tmp / "s"), "--listen", "127.0.0.1:0", "--ucx-port", "0", *flags],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_gpu_device_without_cupy_is_a_clear_error(tmp_path: Path) -> None:
    try:
        import cupy  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("CuPy is installed here")
    res = _daemon(tmp_path, "--device", "cuda:0:1GiB")
    assert res.returncode == 2, res.stderr
    assert "cuda:0" in res.stderr and "CuPy" in res.stderr
    assert "Traceback" not in res.stderr


def test_missing_gpu_is_a_clear_error(tmp_path: Path) -> None:
    res = _daemon(tmp_path, "--device", "cuda:5:1MiB",
                  env={"PYTHONPATH": f"{FAKE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert res.returncode == 2, res.stderr
    assert "cuda:5" in res.stderr and "no such CUDA device" in res.stderr
    assert "Traceback" not in res.stderr


def test_gpu_backing_switch(tmp_path: Path) -> None:
    """``--gpu-backing vmm`` refuses to start where VMM cannot be had (no CUDA
    driver here), with one line; ``cupy`` starts with the plain arena."""
    env = {"PYTHONPATH": f"{FAKE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "RPCBUF_UCX_CUDA": "0"}
    res = _daemon(tmp_path, "--device", "cuda:0:1MiB", "--gpu-backing", "vmm", env=env)
    assert res.returncode == 2, res.stderr
    assert "cuda:0: CUDA VMM was asked for" in res.stderr and "Traceback" not in res.stderr
    res = _daemon(tmp_path, "--device", "cuda:0:1MiB", "--gpu-backing", "mmap", env=env)
    assert res.returncode == 2 and "invalid choice" in res.stderr


async def test_gpu_backing_cupy_says_why(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    path = f"{FAKE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    d = daemon_factory("--device", "cuda:0:4MiB", "--gpu-backing", "cupy",
                       env={"PYTHONPATH": path, "RPCBUF_UCX_CUDA": "0"})
    async with d.connect() as c:
        dev = {x["key"]: x for x in await c.list_devices()}["cuda:0"]
        assert dev["backing"] == "cupy" and dev["backing_why"] == "VMM not asked for"


# -- the protocol ----------------------------------------------------------------------


def test_store_fields_are_validated() -> None:
    base = {"buffer_id": "b", "offset": 0, "nbytes": 8}
    assert P.Store.from_fields({**base, "wire_dtype": "float16"}).wire_dtype == "float16"
    assert P.Store.from_fields({**base, "checksum_kind": "devsum"}).checksum_kind == "devsum"
    for bad in ({"wire_dtype": "bfloat16"}, {"wire_dtype": 16}, {"checksum_kind": "md5"}):
        with pytest.raises(rpcbuf.BadRequest):
            P.Store.from_fields({**base, **bad})


# -- torch / DLPack on the host -----------------------------------------------------------

DTYPES = ["float32", "float16", "bfloat16", "int8", "int64", "bool", "float64"]


@pytest.mark.parametrize("dtype", DTYPES)
async def test_torch_tensors_round_trip(ctx: rpcbuf.RpcContext, dtype: str) -> None:
    torch = pytest.importorskip("torch")
    dt = getattr(torch, dtype)
    src = (torch.randn(33, 7) * 10).to(dt)
    view = as_bytes(src)
    assert view.ctypes.data == src.data_ptr() and view.nbytes == src.nbytes  # zero-copy
    assert D.memory_kind(src) != "cuda"
    buf = await ctx.request_buffer(src.nbytes + 64)
    try:
        await ctx.store_tensor(buf, src, offset=8, verify="checksum")
        out = torch.empty_like(src)
        got = await ctx.read_buffer(buf, offset=8, out=out)
        assert got is out and torch.equal(out, src)
    finally:
        await ctx.release_buffer(buf)


async def test_non_contiguous_tensors(ctx: rpcbuf.RpcContext) -> None:
    torch = pytest.importorskip("torch")
    src = torch.arange(64, dtype=torch.bfloat16).reshape(8, 8).t()  # a transposed view
    assert not src.is_contiguous()
    buf = await ctx.request_buffer(256)
    try:
        await ctx.store_tensor(buf, src, verify="checksum")
        out = torch.empty(8, 8, dtype=torch.bfloat16)
        await ctx.read_buffer(buf, out=out)
        assert torch.equal(out, src)
        with pytest.raises(rpcbuf.BadRequest, match="contiguous"):
            await ctx.read_buffer(buf, out=torch.empty(8, 8, dtype=torch.bfloat16).t())
    finally:
        await ctx.release_buffer(buf)


async def test_dlpack_objects(ctx: rpcbuf.RpcContext) -> None:
    class OnlyDLPack:  # exposes DLPack and nothing else
        def __init__(self, a: np.ndarray) -> None:
            self.a = a

        def __dlpack__(self, **kw: object) -> object:
            return self.a.__dlpack__(**kw)

        def __dlpack_device__(self) -> tuple[int, int]:
            return self.a.__dlpack_device__()

    arr = np.arange(100, dtype=np.int32)
    assert as_bytes(OnlyDLPack(arr)).ctypes.data == arr.ctypes.data
    buf = await ctx.request_buffer(arr.nbytes)
    try:
        await ctx.store_tensor(buf, OnlyDLPack(arr), verify="checksum")
        assert np.array_equal((await ctx.read_buffer(buf)).view(np.int32), arr)
    finally:
        await ctx.release_buffer(buf)


# -- device arrays in this process (a fake CuPy, tests/fakecupy) --------------------------


def test_fake_device_arrays_take_the_device_path(fake_cupy) -> None:  # type: ignore[no-untyped-def]
    arr = fake_cupy.asarray(np.arange(10, dtype=np.float32))
    assert not isinstance(arr, np.ndarray) and D.memory_kind(arr) == "cuda"
    view = as_bytes(arr)
    assert isinstance(view, fake_cupy.ndarray) and view.nbytes == 40
    assert D.devsum(np.arange(10, dtype=np.float32)) == D.host_devsum(arr.get())


async def test_batch_verbs_refuse_device_arrays(ctx: rpcbuf.RpcContext,
                                                fake_cupy) -> None:  # type: ignore[no-untyped-def]
    """What the real API refuses, the fake makes the client refuse too: the
    batch and block verbs take host arrays (tests/test_gpu.py once stored a CuPy array
    with store_tensors and so could never reach its attach)."""
    buf = await ctx.request_buffer(1 << 16)
    try:
        dev = fake_cupy.asarray(np.arange(1024, dtype=np.float32))
        with pytest.raises(rpcbuf.BadRequest, match="host arrays"):
            await ctx.store_tensors(buf, {"w": dev})
        with pytest.raises(rpcbuf.BadRequest, match="host arrays"):
            await ctx.store_batch(buf, [(0, np.zeros(8, np.uint8)), (64, dev)])
        with pytest.raises(rpcbuf.BadRequest, match="put_blocks takes host arrays"):
            await ctx.put_blocks({"k": dev})
        with pytest.raises(rpcbuf.BadRequest, match="get_blocks takes host arrays"):
            await ctx.get_blocks(["k"], [dev])
        assert (await ctx.get_buffer_meta(buf))["tensors"] in ({}, [], None)  # no trace
        await ctx.store_tensors(buf, {"w": dev.get()})  # the host copy is fine
    finally:
        await ctx.release_buffer(buf)


# -- wire fp16 -------------------------------------------------------------------------


async def test_wire_fp16_round_trip(ctx: rpcbuf.RpcContext) -> None:
    rng = np.random.default_rng(6)
    src = rng.standard_normal(10_001).astype(np.float32) * 100
    buf = await ctx.request_buffer(src.nbytes + 16)
    try:
        res = await ctx.store_tensor(buf, src, offset=4, verify="checksum", wire_dtype="float16")
        assert res["nbytes"] == src.nbytes
        back = (await ctx.read_buffer(buf, 4, src.nbytes)).view(np.float32)
        assert np.array_equal(back, src.astype(np.float16).astype(np.float32))
        np.testing.assert_allclose(back, src, rtol=1e-3, atol=1e-4)
    finally:
        await ctx.release_buffer(buf)


async def test_wire_fp16_torch(ctx: rpcbuf.RpcContext) -> None:
    torch = pytest.importorskip("torch")
    src = torch.randn(64, 65)
    buf = await ctx.request_buffer(src.nbytes)
    try:
        await ctx.store_tensor(buf, src, verify="checksum", wire_dtype="float16")
        out = torch.empty_like(src)
        await ctx.read_buffer(buf, out=out)
        assert torch.equal(out, src.half().float())
    finally:
        await ctx.release_buffer(buf)


async def test_wire_fp16_bad_requests(ctx: rpcbuf.RpcContext) -> None:
    buf = await ctx.request_buffer(1024)
    try:
        with pytest.raises(rpcbuf.BadRequest, match="float32"):
            await ctx.store_tensor(buf, np.zeros(8, np.float64), wire_dtype="float16")
        with pytest.raises(rpcbuf.BadRequest, match="wire_dtype"):
            await ctx.store_tensor(buf, np.zeros(8, np.float32), wire_dtype="int8")
        with pytest.raises(rpcbuf.OutOfRange):  # the widened size is what is checked
            await ctx.store_tensor(buf, np.zeros(200, np.float32), offset=300,
                                   wire_dtype="float16")
        with pytest.raises(rpcbuf.BadRequest, match="multiple of 4"):  # a raw request
            await ctx._ranges.store(buf, np.zeros(6, np.uint8), 0, None, wire_dtype="float16")
        await ctx.store_tensor(buf, np.ones(4, np.float32))  # the session still works
    finally:
        await ctx.release_buffer(buf)


# -- the daemon's GPU paths with a NumPy-backed fake CuPy ------------------------------------


@pytest.fixture(scope="module")
def fake_gpu_daemon(daemon_factory):  # type: ignore[no-untyped-def]
    path = f"{FAKE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    return daemon_factory("--device", "cpu:64MiB", "--device", "cuda:1:64MiB",
                          env={"PYTHONPATH": path, "RPCBUF_UCX_CUDA": "0"})


async def test_fake_gpu_buffers(fake_gpu_daemon) -> None:  # type: ignore[no-untyped-def]
    async with fake_gpu_daemon.connect() as c:
        devices = {d["key"]: d for d in await c.list_devices()}
        assert devices["cuda:1"]["name"] == "Fake GPU (NumPy)"
        assert devices["cuda:1"]["device_type"] == "GPU"
        buf = await c.request_buffer(1 << 20, device_type="GPU", device=1)
        try:
            meta = await c.get_buffer_meta(buf)
            assert (meta["device_type"], meta["device"]) == ("GPU", 1)
            data = np.random.default_rng(2).integers(0, 256, 100_003, dtype=np.uint8)
            res = await c.store_tensor(buf, data, offset=5, verify="checksum")
            assert res["checksum_kind"] == "devsum" and res["checksum"] == D.devsum(data)
            assert np.array_equal(await c.read_buffer(buf, 5, data.nbytes), data)
            f = np.linspace(-3, 3, 4096, dtype=np.float32)
            await c.store_tensor(buf, f, offset=1024, verify="checksum", wire_dtype="float16")
            back = (await c.read_buffer(buf, 1024, f.nbytes)).view(np.float32)
            assert np.array_equal(back, f.astype(np.float16).astype(np.float32))
            with pytest.raises(rpcbuf.BadRequest, match="aligned"):
                await c.store_tensor(buf, f, offset=2, wire_dtype="float16")
            res = await c._ranges.store(buf, data, 0, "checksum", kind="xxh3")  # either kind works
            assert res["checksum_kind"] == "xxh3"
            bad = P.Store(buffer_id=buf, offset=0, nbytes=data.nbytes, checksum=12345,
                          verify="checksum", checksum_kind="devsum")
            with pytest.raises(rpcbuf.VerifyFailed):  # a wrong devsum is caught
                await c._paths.ucx.send(Transfer(bad, [data], lambda: [data]))
        finally:
            await c.release_buffer(buf)
        assert (await c.stats())["buffers"] == 0


async def test_checksum_kind_is_the_daemons_word(fake_gpu_daemon) -> None:  # type: ignore[no-untyped-def]
    """A context that never saw a GPU buffer still verifies a store into it
    with the kind the daemon states for its device (devsum), and routes it
    over UCX: from the buffer's metadata (asked once), not from a refusal."""
    async with fake_gpu_daemon.connect() as owner, fake_gpu_daemon.connect() as other:
        assert owner.hello["checksum_kinds"] == {"cpu:0": "xxh3", "cuda:1": "devsum"}
        buf = await owner.request_buffer(1 << 16, device_type="GPU", device=1)
        host = await owner.request_buffer(1 << 16)
        try:
            name = await owner.get_buffer_meta(buf)
            assert name["device_type"] == "GPU"
            data = np.arange(4096, dtype=np.uint8)
            res = await other.store_tensor(buf, data, verify="checksum")
            assert res["checksum_kind"] == "devsum" and res["checksum"] == D.devsum(data)
            res = await other.store_tensor(host, data, verify="checksum")
            assert res.get("checksum_kind", "xxh3") == "xxh3"
            assert np.array_equal(await other.read_buffer(buf, 0, 4096), data)
        finally:
            await owner.release_buffer(buf)
            await owner.release_buffer(host)


async def test_gpu_buffers_are_not_written_in_place(fake_gpu_daemon) -> None:  # type: ignore[no-untyped-def]
    """Writing in place is for host buffers (docs/dataplane.md): a GPU
    buffer cannot be mapped, and the verbs carry its bytes over UCX as ever."""
    async with fake_gpu_daemon.connect() as c:
        buf = await c.request_buffer(1 << 16, device_type="GPU", device=1)
        try:
            if c.same_host:
                with pytest.raises(rpcbuf.UnsupportedDevice):
                    async with c.map(buf):
                        pass
            data = np.arange(4096, dtype=np.uint8)
            await c.store_tensor(buf, data)
            assert np.array_equal(await c.read_buffer(buf, 0, 4096), data)
            assert c.in_place_counts()["stores"] == 0
        finally:
            await c.release_buffer(buf)
