"""What a loaded model's manifests and metadata say, through a real daemon:
source types and logical shapes beside the NumPy views, the file's own
metadata stored with the model, ``rpcbuf.model_info`` reading both back from
one node, and every way that goes wrong (a bad source type or shape on the
wire, an over-large metadata section in a file, a corrupt metadata blob the
daemon hands back, a daemon of protocol 2) leaving no trace.  Files are
written by gguf-py (``GGUFWriter``, ``gguf.quants.quantize``) and by hand
(a BF16 safetensors file, which NumPy cannot write)."""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rpcbuf
from conftest import ROOT, DaemonProc
from models import QUANT_KVS, write_quantized_gguf
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.manifest import ManifestTable, Packed
from rpcbuf.models.metadata import META_TENSOR
from rpcbuf.models.modelcheck import MAX_METADATA_ITEMS

TENANT = "model-info"


@pytest.fixture
async def cluster(clean_pool: DaemonProc) -> AsyncIterator[rpcbuf.Cluster]:
    async with rpcbuf.Cluster.connect(clean_pool.addr, clean_pool.token(TENANT)) as c:
        yield c
        left = [b["name"] for bs in (await c.list_buffers()).values() for b in bs]
        assert not left, f"buffers left behind: {left}"


def bf16_safetensors(path: Path, meta: dict[str, str]) -> tuple[Path, bytes]:
    """A safetensors file by hand: 8-byte little-endian header length, the JSON
    header (dtype, shape, data_offsets, ``__metadata__``), then the bytes."""
    bits = (np.arange(24, dtype=np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
    header = {"__metadata__": meta,
              "model.embed_tokens.weight": {"dtype": "BF16", "shape": [4, 6],
                                            "data_offsets": [0, 48]},
              "lm_head.weight": {"dtype": "F32", "shape": [2, 2], "data_offsets": [48, 64]}}
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bits + np.ones(4, "<f4").tobytes())
    return path, bits


async def test_gguf_quantized_tensors_and_key_values(cluster: rpcbuf.Cluster,
                                                     tmp_path: Path) -> None:
    import gguf

    path = write_quantized_gguf(tmp_path / "quant.gguf")
    res = await rpcbuf.load_model(cluster, path, name="quant", progress=False)
    assert res.nodes[cluster.endpoints[0]].tensors == 4  # the metadata is not a model tensor
    ctx = cluster[cluster.endpoints[0]]
    info = await rpcbuf.model_info(ctx, "quant")
    q8 = info.tensors["token_embd.weight"]
    assert (q8.source_type, q8.logical_shape, q8.shape, q8.dtype) == (
        "Q8_0", (512, 256), (512, 272), "|u1")
    q4 = info.tensors["blk.0.attn_q.weight"]
    assert (q4.source_type, q4.logical_shape, q4.shape) == ("Q4_0", (64, 256), (64, 144))
    f16 = info.tensors["blk.0.attn_norm.weight"]
    assert (f16.source_type, f16.logical_shape, f16.dtype) == ("F16", (256,), "<f2")
    assert info.tensors["output_norm.weight"].source_type == "F32"
    assert META_TENSOR not in info.tensors and len(info.tensors) == 4
    assert info.format == "gguf"
    assert info.metadata == {"general.architecture": "llama", **QUANT_KVS}
    reader = gguf.GGUFReader(str(path))  # what the file holds, by gguf's own reader
    assert info.metadata == {k: f.contents() for k, f in reader.fields.items()
                             if not k.startswith("GGUF.")}
    # where each tensor lies is what the buffer holds: the file's bytes
    (slot,) = info.slots
    assert slot.name == "quant/slot0" and slot.buffer_id == q8.buffer_id
    back = (await ctx.read_batch(q8.buffer_id, [(q8.offset, q8.nbytes)]))[0]
    raw = next(t for t in reader.tensors if t.name == "token_embd.weight").data
    assert back.tobytes() == np.asarray(raw).tobytes()
    # the entries say it too, wherever the manifest is read
    meta = await ctx.get_buffer_meta(await ctx.open_buffer("quant/slot0"))
    entry = meta["tensors"]["token_embd.weight"]
    assert entry["source_type"] == "Q8_0" and entry["logical_shape"] == [512, 256]
    assert entry["shape"] == [512, 272] and entry == q8.entry
    assert ManifestTable.of_entries(meta["tensors"])["blk.0.attn_q.weight"] == q4.entry
    assert info.to_json()["tensors"]["token_embd.weight"]["source_type"] == "Q8_0"
    # a re-load sends nothing, metadata included, and keeps the buffer
    again = await rpcbuf.load_model(cluster, path, name="quant", progress=False)
    assert again.bytes_sent == 0 and all(b["reused"] for b in again.buffers)
    assert (await rpcbuf.model_info(ctx, "quant")).tensors == info.tensors
    await rpcbuf.unload_model(cluster, "quant")
    with pytest.raises(rpcbuf.NotFound):
        await rpcbuf.model_info(ctx, "quant")


async def test_bf16_safetensors_and_its_metadata(cluster: rpcbuf.Cluster,
                                                 tmp_path: Path) -> None:
    meta = {"format": "pt", "license": "apache-2.0"}
    path, bits = bf16_safetensors(tmp_path / "bf.safetensors", meta)
    await rpcbuf.load_model(cluster, path, name="bf", progress=False, dedup=False)
    ctx = cluster[cluster.endpoints[0]]
    info = await rpcbuf.model_info(ctx, "bf")
    emb = info.tensors["model.embed_tokens.weight"]
    assert (emb.source_type, emb.logical_shape, emb.dtype, emb.shape) == (
        "BF16", (4, 6), "<u2", (4, 6))
    assert info.tensors["lm_head.weight"].source_type == "F32"
    assert (info.format, info.metadata) == ("safetensors", meta)
    got = await ctx.load_tensors(emb.buffer_id, [emb.name])
    assert got[emb.name].tobytes() == bits
    await rpcbuf.unload_model(cluster, "bf")


async def test_a_bad_source_type_or_shape_is_refused_and_leaves_no_trace(
        clean_pool: DaemonProc) -> None:
    async with clean_pool.connect(TENANT) as ctx:
        bid = await ctx.request_buffer(1 << 16)
        await ctx.clear_buffer(bid, 0)
        await ctx.store_tensors(bid, {"w": np.ones(8, np.float32)},
                                sources={"w": ("F32", (8,))})
        before = await ctx.get_buffer_meta(bid)
        assert before["tensors"]["w"]["source_type"] == "F32"
        x = {"x": np.full((2, 34), 0xAB, np.uint8)}
        bad: list[dict[str, Any]] = [
            {"x": ("Q8-0", (2, 32))}, {"x": ("Q" * 33, None)}, {"x": ("", None)},
            {"x": ("Q8_0", (1,) * (P.MAX_NDIM + 1))}, {"x": ("Q8_0", (1 << 40, 1 << 40))}]
        for sources in bad:
            for store in (ctx.store_tensors, ctx.store_tensors_dedup):
                with pytest.raises(rpcbuf.BadRequest):
                    await store(bid, x, sources=sources)  # type: ignore[operator]
        # the packed form, a kind table of the wrong length, built by hand
        packed = Packed(["x"], np.zeros(1, np.intp), ["|u1"], [(2, 34)],
                        sources=["Q8_0", "Q4_0"])
        with pytest.raises(rpcbuf.BadRequest, match="2 kind_source_types for 1 kinds"):
            await ctx.store_batch(bid, [(4096, x["x"])], manifest=packed)
        after = await ctx.get_buffer_meta(bid)
        assert after["tensors"] == before["tensors"]
        assert after["manifest_version"] == before["manifest_version"]
        assert (await ctx.read_buffer(bid, 4096, 68)).tobytes() == bytes(68)  # nothing landed
        plain = await ctx.store_tensors(bid, {"p": np.ones(2)})  # what old clients send
        assert "source_type" not in plain["p"]
        assert "source_type" not in (await ctx.get_buffer_meta(bid))["tensors"]["p"]
        await ctx.release_buffer(bid)


@pytest.mark.timeout(60)
async def test_an_over_large_metadata_section_is_refused_before_any_request(
        cluster: rpcbuf.Cluster, tmp_path: Path) -> None:
    n = MAX_METADATA_ITEMS + 1
    kv = struct.pack("<Q", 3) + b"big" + struct.pack("<IIQ", 9, 0, n) + bytes(n)
    (p := tmp_path / "big-meta.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + kv)
    free = [d["free"] for d in await cluster.devices()]
    with pytest.raises(rpcbuf.BadRequest, match=f"more than {MAX_METADATA_ITEMS} values"):
        await rpcbuf.load_model(cluster, p, progress=False)
    assert [d["free"] for d in await cluster.devices()] == free
    assert not any((await cluster.list_buffers()).values())


async def test_a_corrupt_metadata_blob_from_the_daemon_is_a_bad_answer(
        cluster: rpcbuf.Cluster, tmp_path: Path) -> None:
    """The daemon hands back what the tenant's buffer holds: here, bytes that
    are no metadata (with a checksum that matches them), then a tensor of
    another dtype under the metadata's name."""
    path = write_quantized_gguf(tmp_path / "c.gguf")
    await rpcbuf.load_model(cluster, path, name="corrupt", progress=False)
    ctx = cluster[cluster.endpoints[0]]
    bid = await ctx.open_buffer("corrupt/slot0")
    entry = (await ctx.get_buffer_meta(bid))["tensors"][META_TENSOR]
    garbage = np.frombuffer(b"\xc1" * entry["nbytes"], np.uint8)
    await ctx.store_tensors(bid, {META_TENSOR: garbage})  # same size: same slot
    with pytest.raises(rpcbuf.BadRequest) as info:
        await rpcbuf.model_info(ctx, "corrupt")
    assert info.value.details == {"field": "metadata", "reason": "bad_answer"}
    deep = np.frombuffer(b"\x81\xa1a" + b"\x91" * (entry["nbytes"] - 3), np.uint8)
    await ctx.store_tensors(bid, {META_TENSOR: deep})
    with pytest.raises(rpcbuf.BadRequest, match="not msgpack"):
        await rpcbuf.model_info(ctx, "corrupt")
    await ctx.store_tensors(bid, {META_TENSOR: np.zeros(entry["nbytes"] // 4, np.float32)},
                            offset=entry["offset"])
    with pytest.raises(rpcbuf.BadRequest, match="not a flat uint8 tensor"):
        await rpcbuf.model_info(ctx, "corrupt")
    await rpcbuf.unload_model(cluster, "corrupt")


def cli(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rpcbuf.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, "COLUMNS": str(columns),
                               "PYTHONPATH": str(ROOT / "src")})


async def test_rpcbuf_models_shows_source_types_in_80_columns(cluster: rpcbuf.Cluster,
                                                              clean_pool: DaemonProc,
                                                              tmp_path: Path) -> None:
    path = write_quantized_gguf(tmp_path / "cli.gguf")
    await rpcbuf.load_model(cluster, path, name="cli-quant", progress=False)
    token = clean_pool.token(TENANT)
    res = await asyncio.to_thread(cli, "models", "--endpoint", clean_pool.addr, "--token",
                                  token, "--json")
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout)["models"]["cli-quant"]
    assert got["tensors"] == 4 and got["metadata"] is True and got["complete"] is True
    assert got["source_types"] == {"Q8_0": 1, "Q4_0": 1, "F16": 1, "F32": 1}
    assert list(got["source_types"]) == ["Q8_0", "Q4_0", "F16", "F32"]  # most bytes first
    for columns in (80, 120):
        res = await asyncio.to_thread(cli, "models", "--endpoint", clean_pool.addr, "--token",
                                      token, columns=columns)
        assert res.returncode == 0, res.stderr
        lines = res.stdout.splitlines()
        assert max(len(line) for line in lines) <= columns, res.stdout
        assert "cli-quant" in res.stdout and clean_pool.addr in res.stdout
        assert "…" not in res.stdout
    assert "Q8_0 Q4_0 F16 +1" in res.stdout  # 120 columns: room for the types
    res = await asyncio.to_thread(cli, "models", "--endpoint", clean_pool.addr, "--token",
                                  token, "--wide", columns=80)
    assert "Q8_0 Q4_0 F16 F32" in res.stdout and "+1" not in res.stdout, res.stdout  # issue 28
    await rpcbuf.unload_model(cluster, "cli-quant")


async def test_attach_model_gives_every_tensor_in_place_with_its_source_type(
        cluster: rpcbuf.Cluster, tmp_path: Path) -> None:
    """``rpcbuf.attach_model``: the GGUF's tensors over the daemon's memory
    (read-only, no copy), each with its source type and logical shape, and
    the file's metadata; the slot buffer is BUSY while attached."""
    import gguf

    path = write_quantized_gguf(tmp_path / "quant.gguf")
    await rpcbuf.load_model(cluster, path, name="quant", progress=False)
    ctx = cluster[cluster.endpoints[0]]
    if not ctx.same_host:
        pytest.skip("attach needs the same-host path")
    reader = gguf.GGUFReader(str(path))
    async with rpcbuf.attach_model(ctx, "quant") as model:
        assert set(model) == {t.name for t in reader.tensors}  # no metadata tensor
        q8 = model["token_embd.weight"]
        assert q8.shape == (512, 272) and q8.dtype == np.uint8 and not q8.flags.writeable
        assert (model.info["token_embd.weight"].source_type,
                model.info["token_embd.weight"].logical_shape) == ("Q8_0", (512, 256))
        raw = next(t for t in reader.tensors if t.name == "token_embd.weight").data
        assert q8.tobytes() == np.asarray(raw).tobytes()
        assert model.metadata["general.architecture"] == "llama" and model.format == "gguf"
        slot = model.info["token_embd.weight"].buffer_id
        with pytest.raises(rpcbuf.Busy):
            await ctx.clear_buffer(slot)
        del q8
    await ctx.clear_buffer(slot, 0)  # detached on the way out
    with pytest.raises(rpcbuf.NotFound):
        await rpcbuf.attach_model(ctx, "no-such-model")
    await rpcbuf.unload_model(cluster, "quant")


async def test_attach_model_refuses_a_model_that_changed_between_its_check_and_attach(
        cluster: rpcbuf.Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """attach_model checked the model complete, then attached slot by slot:
    a load over it (here: a tensor rewritten) could begin in between, and
    the engine got a half-overwritten model.  Attached, the buffers refuse
    writes; the model is checked again then, and refused if it changed."""
    path = write_quantized_gguf(tmp_path / "race.gguf")
    await rpcbuf.load_model(cluster, path, name="race", progress=False)
    ctx = cluster[cluster.endpoints[0]]
    if not ctx.same_host:
        pytest.skip("attach needs the same-host path")
    info = await rpcbuf.model_info(ctx, "race")
    victim = next(t for t in info.tensors.values() if t.nbytes >= 4)
    real = ctx.attach

    async def attach_after_a_write(buffer_id: str, *a: object, **kw: object) -> object:
        if buffer_id == victim.buffer_id:  # another loader, between the check and here
            await ctx.store_tensors(buffer_id, {victim.name: np.full(victim.nbytes, 7, np.uint8)})
        return await real(buffer_id, *a, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(ctx, "attach", attach_after_a_write)
    with pytest.raises(rpcbuf.NotFound) as err:
        await rpcbuf.attach_model(ctx, "race")
    assert err.value.details.get("reason") == "incomplete", err.value
    monkeypatch.undo()
    await ctx.clear_buffer(victim.buffer_id, 0)  # detached again: writable
    await rpcbuf.unload_model(cluster, "race")


async def test_reserved_entries_are_hidden_from_ls_and_load_tensors(
        cluster: rpcbuf.Cluster, clean_pool: DaemonProc, tmp_path: Path) -> None:
    """Issue 28 item 6: the loader's own entries (``__rpcbuf_metadata__``,
    ``__rpcbuf_load__``) leaked out: ``ls`` counted them and ``load_tensors``
    returned them among the file's tensors.  Hidden unless asked for by name."""
    path, _ = bf16_safetensors(tmp_path / "hidden.safetensors", {"format": "pt"})
    await rpcbuf.load_model(cluster, path, name="hidden", progress=False)
    ctx = cluster[cluster.endpoints[0]]
    file_names = {"model.embed_tokens.weight", "lm_head.weight"}
    slot = await ctx.open_buffer("hidden/slot0")
    meta = await ctx.get_buffer_meta(slot)
    assert {META_TENSOR, "__rpcbuf_load__"} <= set(meta["tensors"])  # the manifest has all
    assert set(await ctx.load_tensors(slot)) == file_names
    asked = await ctx.load_tensors(slot, [META_TENSOR])  # by name: given
    assert asked[META_TENSOR].dtype == np.uint8
    if ctx.same_host:
        async with ctx.attach(slot) as view:
            assert set(view.tensors()) == file_names
    res = await asyncio.to_thread(cli, "ls", "--endpoint", clean_pool.addr, "--token",
                                  clean_pool.token(TENANT), "--json")
    assert res.returncode == 0, res.stderr
    listed = json.loads(res.stdout)
    rows = [b for bs in listed.values() for b in bs if b["name"] == "hidden/slot0"]
    assert [b["tensors"] for b in rows] == [len(file_names)], listed
    await rpcbuf.unload_model(cluster, "hidden")
