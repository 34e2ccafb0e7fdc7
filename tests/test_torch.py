"""PyTorch as a client (issue 28): every verb takes every torch dtype a model
file can hold (bfloat16 and the float8s, which NumPy lacks, among them), and
gives them back as torch tensors when asked (``framework="torch"``).  Real
torch tensors, a real daemon.  Without torch these tests skip, saying why
(``.ci/run`` installs torch==2.13.0 where its CPU wheel lies on the disk)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc
from rpcbuf.control.client import arrays
from rpcbuf.control.client.arrays import as_bytes

torch = pytest.importorskip(
    "torch", reason="torch is not installed (.ci/run installs torch==2.13.0 where its CPU "
                    "wheel is on the machine's disk; elsewhere: pip install torch)")

TENANT = "torch"
# Every dtype a safetensors file can hold that torch has (safetensors.torch's table).
DTYPES = [name for name in (
    "float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2",
    "float8_e4m3fnuz", "float8_e5m2fnuz", "int64", "int32", "int16", "int8",
    "uint64", "uint32", "uint16", "uint8", "bool", "complex64") if hasattr(torch, name)]


def sample(name: str, shape: tuple[int, ...] = (5, 7), seed: int = 0) -> Any:
    """A tensor of dtype ``name`` with varied values (random bits for the
    float8s, so NaN patterns are in there too: compare bits, not values)."""
    dt = getattr(torch, name)
    g = torch.Generator().manual_seed(seed)
    if dt == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dt.is_complex:
        return torch.randn(shape, dtype=dt, generator=g)
    if dt.is_floating_point and dt.itemsize >= 2:
        return (torch.randn(shape, generator=g) * 100).to(dt)
    bits = torch.randint(0, 256, (*shape, dt.itemsize), dtype=torch.uint8, generator=g)
    return bits.view(dt).reshape(shape)


def same(a: Any, b: Any) -> bool:
    """Bit for bit, with dtype and shape."""
    return bool(a.dtype == b.dtype and a.shape == b.shape
                and as_bytes(a.contiguous()).tobytes() == as_bytes(b.contiguous()).tobytes())


@pytest.fixture
async def tctx(clean_pool: DaemonProc) -> AsyncIterator[rpcbuf.RpcContext]:
    async with clean_pool.connect(TENANT) as c:
        yield c


@pytest.mark.parametrize("name", DTYPES)
def test_host_array_is_a_view_with_the_file_dtype_name(name: str) -> None:
    """The one conversion every verb uses: no copy, and for a dtype NumPy
    lacks the bits in an integer of its width plus the safetensors name."""
    t = sample(name)
    arr, source = arrays.host_array(t)
    assert isinstance(arr, np.ndarray) and arr.shape == tuple(t.shape)
    assert arr.ctypes.data == t.data_ptr() and arr.nbytes == t.nbytes
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                "float8_e5m2fnuz"):
        assert source is not None and arr.dtype.kind == "u"
    else:
        assert source is None and arr.dtype == t.numpy().dtype


@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
def test_a_dtype_no_model_file_holds_is_a_clear_error() -> None:
    half_complex = torch.zeros(3, dtype=torch.complex64).to(torch.complex32) \
        if hasattr(torch, "complex32") else None
    if half_complex is None:
        pytest.skip("this torch has no complex32")
    with pytest.raises(rpcbuf.BadRequest, match="complex32"):
        arrays.host_array(half_complex)


async def test_store_tensors_takes_every_dtype_and_load_tensors_gives_it_back(
        tctx: rpcbuf.RpcContext) -> None:
    """Issue 28 item 8: ``store_tensors({"bf": bf16})`` raised torch's bare
    ``TypeError: Got unsupported ScalarType BFloat16``."""
    tensors = {f"t.{n}": sample(n, seed=i) for i, n in enumerate(DTYPES)}
    tensors["strided"] = sample("bfloat16", (6, 4)).t()  # non-contiguous: copied once
    buf = await tctx.request_buffer(rpcbuf.calculate_buffer_size(tensors))
    try:
        written = await tctx.store_tensors(buf, tensors, verify="checksum")
        assert written["t.bfloat16"]["source_type"] == "BF16"
        assert written["t.bfloat16"]["dtype"] == "<u2"
        back = await tctx.load_tensors(buf, framework="torch")
        assert set(back) == set(tensors)
        for k, t in tensors.items():
            assert same(back[k], t), k
        raw = await tctx.load_tensors(buf, ["t.bfloat16"])  # NumPy: the bits
        assert raw["t.bfloat16"].dtype == np.uint16
        with pytest.raises(rpcbuf.BadRequest, match="framework"):
            await tctx.load_tensors(buf, framework="jax")
    finally:
        await tctx.release_buffer(buf)


async def test_store_tensors_dedup_takes_every_dtype(tctx: rpcbuf.RpcContext) -> None:
    tensors = {n: sample(n, seed=7) for n in DTYPES}
    size = rpcbuf.calculate_buffer_size(tensors)
    a, b = await tctx.request_buffer(size), await tctx.request_buffer(size)
    try:
        first = await tctx.store_tensors_dedup(a, tensors)
        assert first["tensors"] == len(DTYPES)
        again = await tctx.store_tensors_dedup(b, tensors)  # all placed from a's copy
        assert again["sent"] == 0
        back = await tctx.load_tensors(b, framework="torch")
        for k, t in tensors.items():
            assert same(back[k], t), k
    finally:
        await tctx.release_buffer(a)
        await tctx.release_buffer(b)


@pytest.mark.parametrize("name", DTYPES)
async def test_store_tensor_batches_and_reads_take_every_dtype(
        tctx: rpcbuf.RpcContext, name: str) -> None:
    t = sample(name, (9, 3), seed=3)
    buf = await tctx.request_buffer(4096)
    try:
        await tctx.store_tensor(buf, t, verify="checksum")
        out = torch.empty_like(t)
        assert await tctx.read_buffer(buf, out=out) is out and same(out, t)
        await tctx.store_batch(buf, [(1024, t), (2048, t[1:])], verify="checksum")
        blocks = await tctx.read_batch(buf, [(1024, t.nbytes), (2048, t[1:].nbytes)])
        assert blocks[0].tobytes() == as_bytes(t).tobytes()
        assert blocks[1].tobytes() == as_bytes(t[1:]).tobytes()
        assert await tctx.verify_write(buf, 1024, t)
    finally:
        await tctx.release_buffer(buf)


async def test_a_saved_safetensors_of_every_dtype_loads_and_comes_back_as_torch(
        clean_pool: DaemonProc, tmp_path: Path) -> None:
    """``safetensors.torch.save_file`` of every dtype, ``load_model``, then
    the tensors again through ``load_tensors(framework="torch")``."""
    from safetensors.torch import save_file

    tensors = {f"w.{n}": sample(n, (4, 6), seed=i) for i, n in enumerate(DTYPES)}
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path))
    async with rpcbuf.Cluster.connect(clean_pool.addr, clean_pool.token(TENANT)) as cl:
        await rpcbuf.load_model(cl, path, name="all-dtypes", progress=False)
        try:
            ctx = cl[cl.endpoints[0]]
            info = await rpcbuf.model_info(ctx, "all-dtypes")
            got: dict[str, Any] = {}
            for bid in {t.buffer_id for t in info.tensors.values()}:
                got |= await ctx.load_tensors(bid, framework="torch")
            for k, t in tensors.items():
                assert same(got[k], t), k
        finally:
            await rpcbuf.unload_model(cl, "all-dtypes")


# -- attach_model(framework="torch") (item 9) -------------------------------------------


class TinyNet(torch.nn.Module):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(32, 16, dtype=torch.bfloat16)
        self.proj = torch.nn.Linear(16, 8, dtype=torch.bfloat16)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, ids: Any) -> Any:
        return self.head(self.proj(self.emb(ids)).float())


async def _loaded_tiny_net(cl: rpcbuf.Cluster, tmp_path: Path, name: str) -> TinyNet:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    net = TinyNet().eval()
    save_file(net.state_dict(), str(tmp_path / f"{name}.safetensors"))
    await rpcbuf.load_model(cl, tmp_path / f"{name}.safetensors", name=name, progress=False)
    return net


async def test_attach_model_torch_gives_read_only_tensors_on_the_pages(
        clean_pool: DaemonProc, tmp_path: Path) -> None:
    """Issue 28 item 9: ``torch.from_numpy(model[name])`` warned that the
    array is not writable (an error here: filterwarnings=error).  The torch
    form is the file's dtype, on the attached pages (no copy), and a module
    built on the meta device takes them with ``load_state_dict(assign=True)``."""
    async with rpcbuf.Cluster.connect(clean_pool.addr, clean_pool.token(TENANT)) as cl:
        net = await _loaded_tiny_net(cl, tmp_path, "tiny-net")
        ctx = cl[cl.endpoints[0]]
        try:
            if not ctx.same_host:
                pytest.skip("attach needs the same-host path")
            with pytest.raises(rpcbuf.BadRequest, match="framework"):
                await rpcbuf.attach_model(ctx, "tiny-net", framework="tf")
            async with rpcbuf.attach_model(ctx, "tiny-net", framework="torch") as model:
                assert set(model) == set(net.state_dict())  # no reserved entry
                w = model["emb.weight"]
                assert isinstance(w, torch.Tensor) and w.dtype == torch.bfloat16
                assert torch.equal(w, net.emb.weight)
                # on the attached mapping of its slot buffer: no copy
                where = model.info["emb.weight"]
                pages = model._views[where.buffer_id].array()
                assert w.data_ptr() == pages.ctypes.data + where.offset
                assert not pages.flags.writeable
                with torch.device("meta"):
                    worker = TinyNet()
                worker.load_state_dict(dict(model), assign=True)
                assert worker.emb.weight.data_ptr() == w.data_ptr()
                ids = torch.tensor([[1, 5, 31], [0, 2, 7]])
                with torch.inference_mode():
                    assert torch.equal(worker(ids), net(ids))
                with pytest.raises(rpcbuf.Busy):  # the daemon refuses writes meanwhile
                    await ctx.clear_buffer(model.info["emb.weight"].buffer_id)
                kept = model["head.bias"]
            assert torch.equal(kept, net.head.bias)  # a tensor kept keeps its attachment
            del kept, w, worker
        finally:
            await rpcbuf.unload_model(cl, "tiny-net")


WRITER = """
import asyncio, sys, rpcbuf
async def main():
    async with rpcbuf.connect(sys.argv[1], token=sys.argv[2]) as c:
        async with rpcbuf.attach_model(c, sys.argv[3], framework="torch") as m:
            print("attached", flush=True)
            m["head.bias"].add_(1.0)  # the pages are PROT_READ: the kernel refuses
            print("wrote", flush=True)
asyncio.run(main())
"""


async def test_a_write_through_an_attached_torch_tensor_is_refused(
        clean_pool: DaemonProc, tmp_path: Path) -> None:
    """Torch has no read-only tensors; the pages are mapped read-only, so a
    write kills the writer (SIGSEGV) and the model stays as loaded."""
    import os
    import signal
    import subprocess
    import sys

    async with rpcbuf.Cluster.connect(clean_pool.addr, clean_pool.token(TENANT)) as cl:
        net = await _loaded_tiny_net(cl, tmp_path, "tiny-ro")
        ctx = cl[cl.endpoints[0]]
        try:
            if not ctx.same_host:
                pytest.skip("attach needs the same-host path")
            env = {**os.environ, "UCX_WARN_UNUSED_ENV_VARS": "n"}
            env.pop("PYTHONFAULTHANDLER", None)
            p = subprocess.run([sys.executable, "-c", WRITER, clean_pool.addr,
                                clean_pool.token(TENANT), "tiny-ro"],
                               capture_output=True, text=True, env=env, timeout=90)
            assert p.stdout.startswith("attached") and "wrote" not in p.stdout, p.stderr
            assert p.returncode == -signal.SIGSEGV, (p.returncode, p.stderr[-2000:])
            info = await rpcbuf.model_info(ctx, "tiny-ro")
            bias = info.tensors["head.bias"]
            got = await ctx.load_tensors(bias.buffer_id, ["head.bias"], framework="torch")
            assert torch.equal(got["head.bias"], net.head.bias)
        finally:
            await rpcbuf.unload_model(cl, "tiny-ro")


# -- a real inference library on rpcbuf weights (item 10) -------------------------------


async def test_a_transformers_model_runs_on_attached_weights(
        clean_pool: DaemonProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A small Llama from a config (no download), saved as safetensors,
    ``rpcbuf load``-ed with the CLI, attached as torch tensors and made the
    parameters of a meta-device model: its forward pass equals the
    original's, bit for bit, and its weights are the attached pages."""
    import asyncio
    import os
    import subprocess
    import sys

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing here may reach a hub
    transformers = pytest.importorskip(
        "transformers", reason="transformers is not installed (the 'torch-test' extra; "
                               ".ci/run installs it beside torch)")
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    original = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    original.save_pretrained(tmp_path / "tiny-llama")
    env = {**os.environ, "RPCBUF_ENDPOINTS": clean_pool.addr,
           "RPCBUF_TOKEN": clean_pool.token(TENANT), "COLUMNS": "120"}
    res = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "rpcbuf.cli", "load",
                         str(tmp_path / "tiny-llama" / "model.safetensors"),
                         "--name", "tiny-llama"],
        capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    async with rpcbuf.Cluster.connect(clean_pool.addr, clean_pool.token(TENANT)) as cl:
        ctx = cl[cl.endpoints[0]]
        try:
            if not ctx.same_host:
                pytest.skip("attach needs the same-host path")
            ids = torch.tensor([[1, 17, 4, 99, 23, 5, 64, 2]])
            with torch.inference_mode():
                want = original(ids).logits
            async with rpcbuf.attach_model(ctx, "tiny-llama", framework="torch") as weights:
                with torch.device("meta"):
                    net = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
                net.load_state_dict(dict(weights), assign=True)
                # buffers the module makes itself are not in the file: made
                # as the original's were (on the CPU, then cast with it)
                net.model.rotary_emb = type(original.model.rotary_emb)(config=cfg).to(
                    torch.bfloat16)
                net.eval()
                emb = net.model.embed_tokens.weight
                assert emb.data_ptr() == weights["model.embed_tokens.weight"].data_ptr()
                with torch.inference_mode():
                    got = net(ids).logits
                assert got.dtype == want.dtype and torch.equal(got, want)
                del net, emb
        finally:
            await rpcbuf.unload_model(cl, "tiny-llama")


async def test_an_attached_buffer_gives_its_tensors_as_torch(tctx: rpcbuf.RpcContext) -> None:
    """``ctx.attach(buf).tensors(framework="torch")``: what ``store_tensors``
    stored, in its own dtype, over the attached pages."""
    if not tctx.same_host:
        pytest.skip("attach needs the same-host path")
    tensors = {n: sample(n, seed=11) for n in ("bfloat16", "float8_e4m3fn", "float32")
               if n in DTYPES}
    buf = await tctx.request_buffer(rpcbuf.calculate_buffer_size(tensors))
    try:
        await tctx.store_tensors(buf, tensors)
        async with tctx.attach(buf) as view:
            got = view.tensors(framework="torch")
            for k, t in tensors.items():
                assert same(got[k], t), k
            pages = view.array()
            entry = (await tctx.get_buffer_meta(buf))["tensors"]["bfloat16"]
            assert got["bfloat16"].data_ptr() == pages.ctypes.data + entry["offset"]
            with pytest.raises(rpcbuf.BadRequest, match="framework"):
                view.tensors(framework="cupy")
            del got
    finally:
        await tctx.release_buffer(buf)


async def test_a_gguf_bf16_tensor_attaches_as_bfloat16(clean_pool: DaemonProc,
                                                       tmp_path: Path) -> None:
    """GGUF's BF16 tensors arrive as uint8 rows (two bytes an element, the
    reader's form for a type NumPy lacks); the torch form is bfloat16 of the
    logical shape.  A Q8_0 matrix stays its uint8 rows (no torch dtype)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    want = sample("bfloat16", (8, 6), seed=4)
    q8 = gguf.quants.quantize(np.random.default_rng(0).standard_normal(
        (4, 32), dtype=np.float32), Q.Q8_0)
    path = tmp_path / "bf.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_tensor("blk.0.w", want.view(torch.uint16).numpy(), raw_dtype=Q.BF16)
    w.add_tensor("blk.0.q", q8, raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    async with rpcbuf.Cluster.connect(clean_pool.addr, clean_pool.token(TENANT)) as cl:
        await rpcbuf.load_model(cl, path, name="gguf-bf", progress=False)
        ctx = cl[cl.endpoints[0]]
        try:
            if not ctx.same_host:
                pytest.skip("attach needs the same-host path")
            async with rpcbuf.attach_model(ctx, "gguf-bf", framework="torch") as model:
                assert same(model["blk.0.w"], want)
                assert model["blk.0.q"].dtype == torch.uint8
                assert model["blk.0.q"].shape == q8.shape
                assert model["blk.0.q"].numpy().tobytes() == q8.tobytes()
        finally:
            await rpcbuf.unload_model(cl, "gguf-bf")


def test_a_tensor_off_the_host_or_sparse_is_a_clear_error() -> None:
    with pytest.raises(rpcbuf.BadRequest, match="meta"):
        arrays.host_array(torch.empty(3, device="meta"))
    with pytest.raises(rpcbuf.BadRequest, match="to_dense"):
        arrays.host_array(torch.eye(3).to_sparse())
    got, _ = arrays.host_array(torch.tensor([1 + 2j], dtype=torch.complex64).conj())
    assert got.tolist() == [1 - 2j]  # a lazy conjugate is made real (one copy)
