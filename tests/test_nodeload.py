"""Node-local load on one node over loopback: a real rpcbufd with
``--model-dir``, real files, the real client (``load_model(...,
source="node")``, ``rpcbuf load --from-node``, ``rpcbuf hash``) and raw
requests: what is loaded is verified, what differs is named and leaves
nothing, and nothing outside the model directories is ever read.  (Three
nodes with their own copies: ``test_netns_nodeload.py``.)"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tests.hardening.rawwire import frame, hello

import rpcbuf
from conftest import ROOT, DaemonProc, start_daemon
from models import corrupt_tensor, gguf_tensors, llama_tensors, write_gguf, write_safetensors
from rpcbuf.control.client.fileload import FileTensor
from rpcbuf.control.daemon.observe import logs
from rpcbuf.control.wire import protocol as P
from rpcbuf.models import metadata as MD, record as LR
from rpcbuf.models.hashfile import MAX_BYTES, describe, manifest_path
from rpcbuf.models.modelfile import open_model

VICTIM = "model.layers.1.mlp.up_proj.weight"
FAKE_CUPY = Path(__file__).parent / "fakecupy"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonProc, Path, Path]]:
    """(daemon, its model directory, the driver's own directory)."""
    tmp = tmp_path_factory.mktemp("nodeload")
    models, local = tmp / "models", tmp / "local"
    models.mkdir()
    local.mkdir()
    write_safetensors(local / "tiny.safetensors", llama_tensors(3, hidden=64))
    shutil.copy(local / "tiny.safetensors", models / "tiny.safetensors")
    d = start_daemon(tmp / "d", "--model-dir", str(models), "--device", "cpu:64MiB",
                     "--audit-log", str(tmp / "audit.log"))
    yield d, models, local
    assert d.stop() == 0, d.log()


async def free(d: DaemonProc) -> int:
    async with d.connect("probe") as c:
        return sum(int(x["free"]) for x in await c.list_devices())


async def test_a_node_reads_verifies_and_reloads_in_place(
        node: tuple[DaemonProc, Path, Path]) -> None:
    d, _, local = node
    start = await free(d)
    want = llama_tensors(3, hidden=64)
    async with rpcbuf.Cluster.connect(d.addr, d.token("alice"), timeout=10) as cluster:
        ctx = cluster[d.addr]
        before = await ctx.stats()
        res = await rpcbuf.load_model(cluster, local / "tiny.safetensors", source="node",
                                      node_path="tiny.safetensors", progress=False)
        out = res.to_json()
        total = sum(a.nbytes for a in want.values())
        assert out["bytes_total"] == out["bytes_read_locally"] == total
        assert out["bytes_sent"] == 0 and out["source"] == "node"
        bid = res.buffers[0]["buffer_id"]
        got = await ctx.load_tensors(bid)  # verified against the manifest's checksums
        assert set(got) == set(want)  # rpcbuf's own entries only when named:
        got |= await ctx.load_tensors(bid, [MD.META_TENSOR, LR.LOAD_TENSOR])
        for n, a in want.items():
            assert np.array_equal(got[n], a), n
        model = open_model(local / "tiny.safetensors")
        blob = MD.encode(model.format, model.metadata)
        model.close()
        assert np.array_equal(got[MD.META_TENSOR], blob)  # the upload's metadata tensor
        after = await ctx.stats()
        # No tensor byte of the file was sent: only rpcbuf's own metadata blob,
        # and the load record, planned then committed.
        rec = LR.decode(got[LR.LOAD_TENSOR].tobytes())
        records = rec.encode().nbytes + LR.plan(rec.slots, rec.slot, rec.names,
                                                rec.load).encode().nbytes
        assert after["bytes_stored"] - before["bytes_stored"] == blob.nbytes + records
        assert blob.nbytes + records < 4096
        assert after["bytes_loaded_local"] - before["bytes_loaded_local"] == total
        info = await rpcbuf.model_info(ctx, "tiny")
        assert (info.format, info.metadata) == ("safetensors", model.metadata)
        assert {n: t.source_type for n, t in info.tensors.items()} == \
            {t.name: t.source_dtype for t in model.tensors}
        again = await rpcbuf.load_model(cluster, local / "tiny.safetensors", source="node",
                                        node_path="tiny.safetensors", progress=False)
        assert (await ctx.stats())["bytes_stored"] == after["bytes_stored"]  # nothing at all
        node_stats = again.to_json()["nodes"][d.addr]
        assert node_stats["bytes_read_locally"] == 0 and node_stats["bytes_in_place"] == total
        assert again.buffers[0]["buffer_id"] == bid and again.buffers[0]["reused"]
        twin = await rpcbuf.load_model(cluster, local / "tiny.safetensors", source="node",
                                       node_path="tiny.safetensors", name="twin",
                                       progress=False)  # another name: a clone, nothing read
        twin_stats = twin.to_json()["nodes"][d.addr]
        assert twin.buffers[0]["cloned"] and twin_stats["bytes_read_locally"] == 0
        got = await ctx.load_tensors(twin.buffers[0]["buffer_id"])
        for n, a in want.items():
            assert np.array_equal(got[n], a), n
        await rpcbuf.unload_model(cluster, "twin")
        await rpcbuf.unload_model(cluster, "tiny")
    assert await free(d) == start


async def test_the_upload_and_the_node_load_lay_a_model_out_alike(
        node: tuple[DaemonProc, Path, Path]) -> None:
    d, models, local = node
    write_gguf(local / "g.gguf", gguf_tensors(2))
    shutil.copy(local / "g.gguf", models / "g.gguf")
    async with rpcbuf.Cluster.connect(d.addr, d.token("alice"), timeout=10) as cluster:
        up = await rpcbuf.load_model(cluster, local / "g.gguf", progress=False)
        bid = up.buffers[0]["buffer_id"]
        uploaded = (await cluster[d.addr].get_buffer_meta(bid))["tensors"]
        res = await rpcbuf.load_model(cluster, local / "g.gguf", source="node",
                                      node_path=str(models / "g.gguf"), progress=False)
        assert res.buffers[0]["buffer_id"] == bid
        assert (await cluster[d.addr].get_buffer_meta(bid))["tensors"] == uploaded
        got = res.to_json()["nodes"][d.addr]  # what the upload put in place is not read again
        assert got["bytes_read_locally"] == 0 and got["bytes_in_place"] == up.bytes_total
        await cluster[d.addr].clear_buffer(bid, offset=0, nbytes=64)  # the first tensor changes
        res = await rpcbuf.load_model(cluster, local / "g.gguf", source="node",
                                      node_path="g.gguf", progress=False)
        got = res.to_json()["nodes"][d.addr]
        assert 0 < got["bytes_read_locally"] < up.bytes_total
        back = await cluster[d.addr].load_tensors(bid, list(uploaded))  # verified, all
        assert set(back) == set(uploaded)
        await rpcbuf.unload_model(cluster, "g")


def without_ids(doc: Any) -> Any:
    """``doc`` with every ``buffer_id`` key dropped (each load makes new buffers)."""
    if isinstance(doc, dict):
        return {k: without_ids(v) for k, v in doc.items() if k != "buffer_id"}
    if isinstance(doc, list):
        return [without_ids(v) for v in doc]
    return doc


async def test_a_fresh_node_load_records_what_an_upload_records(
        node: tuple[DaemonProc, Path, Path]) -> None:
    """Source types, logical shapes (a Q8_0 tensor's differ from its uint8
    rows) and the metadata tensor, recorded by the node itself."""
    d, models, local = node
    write_gguf(local / "q.gguf", gguf_tensors(1, seed=7))
    shutil.copy(local / "q.gguf", models / "q.gguf")
    async with rpcbuf.Cluster.connect(d.addr, d.token("alice"), timeout=10) as cluster:
        ctx = cluster[d.addr]
        res = await rpcbuf.load_model(cluster, local / "q.gguf", source="node",
                                      node_path="q.gguf", progress=False)
        assert res.to_json()["nodes"][d.addr]["bytes_in_place"] == 0  # all read afresh
        loaded = (await ctx.get_buffer_meta(res.buffers[0]["buffer_id"]))["tensors"]
        node_info = without_ids((await rpcbuf.model_info(ctx, "q")).to_json())
        await rpcbuf.unload_model(cluster, "q")
        up = await rpcbuf.load_model(cluster, local / "q.gguf", progress=False)
        uploaded = (await ctx.get_buffer_meta(up.buffers[0]["buffer_id"]))["tensors"]
        del loaded[LR.LOAD_TENSOR], uploaded[LR.LOAD_TENSOR]  # two loads: two ids
        assert loaded == uploaded and MD.META_TENSOR in loaded
        quant = [e for e in loaded.values() if e.get("source_type") == "Q8_0"]
        assert quant and all(list(e["logical_shape"]) != list(e["shape"]) for e in quant)
        up_info = without_ids((await rpcbuf.model_info(ctx, "q")).to_json())
        assert node_info == up_info and node_info["metadata"]
        await rpcbuf.unload_model(cluster, "q")


async def test_a_corrupt_copy_fails_naming_the_tensor_and_leaves_nothing(
        node: tuple[DaemonProc, Path, Path]) -> None:
    d, models, local = node
    shutil.copy(local / "tiny.safetensors", models / "bad.safetensors")
    corrupt_tensor(models / "bad.safetensors", VICTIM)
    start = await free(d)
    async with rpcbuf.Cluster.connect(d.addr, d.token("alice"), timeout=10) as cluster:
        with pytest.raises(rpcbuf.ClusterError) as info:
            await rpcbuf.load_model(cluster, local / "tiny.safetensors", source="node",
                                    node_path="bad.safetensors", progress=False)
        err = info.value.errors[d.addr]
        assert err.code == "VERIFY_FAILED" and VICTIM in err.message
        assert "bad.safetensors" in err.message
        assert err.details["tensor"] == VICTIM and err.details["reason"] == "hash"
        assert info.value.details["cleaned"] == {d.addr: ["tiny/slot0"]}
        assert await cluster[d.addr].list_buffers() == []
        # On a buffer of its own: what was there before and is overwritten goes,
        # nothing is recorded, and no unverified byte stays readable.
        ctx = cluster[d.addr]
        hm = await asyncio.to_thread(describe, local / "tiny.safetensors")
        bid = await ctx.request_buffer(1 << 20)
        await ctx.store_tensors(bid, {"old": np.full(1000, 7, np.uint8),
                                      "far": np.full(10, 9, np.uint8)}, )
        meta = await ctx.get_buffer_meta(bid)
        far = meta["tensors"]["far"]["offset"]
        items, at = [], 0
        for _, t in hm.tensors:
            items.append(FileTensor(t.name, t.dtype, t.shape, t.file_offset, t.nbytes, at,
                                    t.digest, t.checksum))
            at += -(-t.nbytes // 256) * 256 + 4096
        assert far < items[-1].offset  # "far" lies among the items' slots, but not in one
        with pytest.raises(rpcbuf.VerifyFailed, match=VICTIM):
            await ctx.load_file(bid, "bad.safetensors", hm.files[0].size, items)
        meta = await ctx.get_buffer_meta(bid)
        assert set(meta["tensors"]) == {"far"}  # "old" was overwritten: dropped
        victim = next(i for i, x in enumerate(items) if x.name == VICTIM)
        for x in items[:victim + 1]:  # read (verified or not), then zeroed again
            assert not (await ctx.read_buffer(bid, x.offset, x.nbytes)).any(), x.name
        assert (await ctx.load_tensors(bid, ["far"]))["far"].tolist() == [9] * 10
        await ctx.release_buffer(bid)
    assert await free(d) == start


async def test_missing_or_resized_copies_are_named(node: tuple[DaemonProc, Path, Path]) -> None:
    d, models, local = node
    with open(models / "short.safetensors", "wb") as f:
        f.write((local / "tiny.safetensors").read_bytes()[:-100])
    async with rpcbuf.Cluster.connect(d.addr, d.token("alice"), timeout=10) as cluster:
        with pytest.raises(rpcbuf.ClusterError) as info:
            await rpcbuf.load_model(cluster, local / "tiny.safetensors", source="node",
                                    node_path="nothere.safetensors", progress=False)
        err = info.value.errors[d.addr]
        assert err.code == "NOT_FOUND" and "nothere.safetensors" in err.message
        with pytest.raises(rpcbuf.ClusterError) as info:
            await rpcbuf.load_model(cluster, local / "tiny.safetensors", source="node",
                                    node_path="short.safetensors", progress=False)
        err = info.value.errors[d.addr]
        assert err.code == "VERIFY_FAILED" and err.details["reason"] == "size"
        assert "short.safetensors" in err.message
        assert await cluster[d.addr].list_buffers() == []


async def test_every_node_s_copy_is_checked_before_any_reads(
        node: tuple[DaemonProc, Path, Path], tmp_path: Path) -> None:
    """Issue 37 item 12: one node read 194 MiB of its copy before the other
    said it had no ``--model-dir``.  Now every node opens its copy first:
    the node that has one reads nothing, and the refusal names the other."""
    d, _models, local = node
    (tmp_path / "n2").mkdir()
    shutil.copy(d.secret_file, tmp_path / "n2" / "secret")  # one secret: one token for both
    bare = start_daemon(tmp_path / "n2", "--device", "cpu:64MiB")  # no --model-dir
    try:
        async with rpcbuf.Cluster.connect(f"{d.addr};{bare.addr}", d.token("dave"),
                                          timeout=10) as cluster:
            before = (await cluster[d.addr].stats())["bytes_loaded_local"]
            with pytest.raises(rpcbuf.ClusterError) as info:
                await rpcbuf.load_model(cluster, local / "tiny.safetensors", source="node",
                                        node_path="tiny.safetensors",
                                        placement="0:prolog,1;1:all,epilog", progress=False)
            assert list(info.value.errors) == [bare.addr], info.value.errors
            assert info.value.errors[bare.addr].details["reason"] == "no_model_dirs"
            assert (await cluster[d.addr].stats())["bytes_loaded_local"] == before
            for addr in (d.addr, bare.addr):
                assert await cluster[addr].list_buffers() == []
    finally:
        assert bare.stop() == 0, bare.log()


@pytest.fixture
def refusals(node: tuple[DaemonProc, Path, Path], tmp_path: Path) -> Iterator[dict[str, Any]]:
    _d, models, local = node
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(local / "tiny.safetensors", outside / "tiny.safetensors")
    (models / "escape.safetensors").symlink_to(outside / "tiny.safetensors")
    (models / "escape_dir").symlink_to(outside)
    yield {"outside": outside}
    (models / "escape.safetensors").unlink()
    (models / "escape_dir").unlink()


@pytest.mark.parametrize(("path", "code"), [
    ("{outside}/tiny.safetensors", "FORBIDDEN"), ("escape.safetensors", "FORBIDDEN"),
    ("escape_dir/tiny.safetensors", "FORBIDDEN"), ("../outside/tiny.safetensors", "BAD_REQUEST"),
    ("{models}/../outside/tiny.safetensors", "BAD_REQUEST"), ("/etc/passwd", "FORBIDDEN"),
])
async def test_paths_out_of_the_model_dirs_are_refused(
        node: tuple[DaemonProc, Path, Path], refusals: dict[str, Any], path: str,
        code: str) -> None:
    d, models, local = node
    start = await free(d)
    path = path.format(outside=refusals["outside"], models=models)
    async with rpcbuf.Cluster.connect(d.addr, d.token("alice"), timeout=10) as cluster:
        with pytest.raises(rpcbuf.ClusterError) as info:
            await rpcbuf.load_model(cluster, local / "tiny.safetensors", source="node",
                                    node_path=path, progress=False)
        err = info.value.errors[d.addr]
        assert err.code == code, err
        assert str(refusals["outside"]) not in err.message or path.startswith("/")
        assert await cluster[d.addr].list_buffers() == []
        assert (await cluster[d.addr].stats())["bytes_loaded_local"] >= 0
    assert await free(d) == start


async def test_a_node_without_model_dirs_refuses(clean_pool: DaemonProc, tmp_path: Path) -> None:
    path = write_safetensors(tmp_path / "m.safetensors", llama_tensors(1))
    async with rpcbuf.Cluster.connect(clean_pool.addr, clean_pool.token("alice"),
                                      timeout=10) as cluster:
        with pytest.raises(rpcbuf.ClusterError) as info:
            await rpcbuf.load_model(cluster, path, source="node", progress=False)
        err = info.value.errors[clean_pool.addr]
        assert err.code == "FORBIDDEN" and "--model-dir" in err.message
        assert err.details["reason"] == "no_model_dirs"
        assert await cluster[clean_pool.addr].list_buffers() == []


async def test_a_stale_or_malformed_manifest_is_refused_before_any_request(
        node: tuple[DaemonProc, Path, Path], tmp_path: Path) -> None:
    d, _, _ = node
    path = write_safetensors(tmp_path / "m.safetensors", llama_tensors(1))
    manifest = manifest_path(path)
    assert subprocess.run([sys.executable, "-m", "rpcbuf.cli", "hash", str(path)],
                          cwd=ROOT, capture_output=True, timeout=60).returncode == 0
    write_safetensors(path, llama_tensors(1, hidden=32))  # changed after it was hashed
    async with rpcbuf.Cluster.connect(d.addr, d.token("alice"), timeout=10) as cluster:
        with pytest.raises(rpcbuf.BadRequest, match="does not match"):
            await rpcbuf.load_model(cluster, path, source="node", progress=False)
        manifest.write_text('{"rpcbuf_hashes": 2, "format": "gguf", "files": [' * 50)
        with pytest.raises(rpcbuf.BadRequest, match="not a valid rpcbuf hash manifest"):
            await rpcbuf.load_model(cluster, path, source="node", progress=False)
        with open(manifest, "wb") as f:
            f.truncate(MAX_BYTES + 1)
        with pytest.raises(rpcbuf.BadRequest, match="at most"):
            await rpcbuf.load_model(cluster, manifest, source="node", progress=False)
        assert await cluster[d.addr].list_buffers() == []


def raw_load(raw: Any, **fields: Any) -> dict[str, Any]:
    return raw.call("load_file", **fields)


async def test_raw_requests_are_bounded_typed_and_whole_tensors_only(
        node: tuple[DaemonProc, Path, Path]) -> None:
    d, _, local = node
    hm = await asyncio.to_thread(describe, local / "tiny.safetensors")
    t = next(t for _, t in hm.tensors if t.name == VICTIM)
    async with d.connect("alice") as alice:
        bid = await alice.request_buffer(1 << 20)
        raw, bob = hello(d.addr, d.token("alice")), hello(d.addr, d.token("bob"))
        good = dict(buffer_id=bid, path="tiny.safetensors", file_size=hm.files[0].size,
                    file_offsets=P.pack_u64([t.file_offset]), offsets=P.pack_u64([0]),
                    sizes=P.pack_u64([t.nbytes]),
                    hashes=P.pack_u64([t.digest & (2**64 - 1), t.digest >> 64]),
                    checksums=P.pack_u64([t.checksum]), names=[VICTIM],
                    kind_dtypes=[t.dtype], kind_shapes=[list(t.shape)])
        answer = raw_load(raw, **good)
        assert answer["ok"] and answer["result"]["read"] == t.nbytes, answer
        for bad, code, match in [
            ({"path": 5}, "BAD_REQUEST", "path"),
            ({"path": "a/../tiny.safetensors"}, "BAD_REQUEST", "components"),
            ({"file_offsets": [t.file_offset]}, "BAD_REQUEST", "file_offsets"),
            ({"hashes": P.pack_u64([1])}, "BAD_REQUEST", "do not match"),
            ({"file_size": -5}, "BAD_REQUEST", "file_size"),
            ({"file_size": 10}, "BAD_REQUEST", "past the file"),
            ({"sizes": P.pack_u64([2 << 20])}, "OUT_OF_RANGE", "outside buffer"),
            ({"sizes": P.pack_u64([t.nbytes - 1])}, "BAD_REQUEST", "shape"),
            ({"offsets": P.pack_u64([(1 << 20) - 8])}, "OUT_OF_RANGE", "outside buffer"),
            ({"names": ["x", "y"]}, "BAD_REQUEST", "names"),
            ({"kind_dtypes": ["O"]}, "BAD_REQUEST", "dtype"),
            # a few bytes of a tensor, or one shifted by a byte: never (no byte oracle)
            ({"file_offsets": P.pack_u64([t.file_offset + 1])}, "VERIFY_FAILED", "differs"),
            ({"sizes": P.pack_u64([8]), "kind_shapes": [[8 // np.dtype(t.dtype).itemsize]]},
             "VERIFY_FAILED", "differs"),
            ({"names": ["no.such.tensor"]}, "VERIFY_FAILED", "node's copy does not"),
        ]:
            answer = raw_load(raw, **{**good, **bad})
            assert not answer["ok"] and answer["error"]["code"] == code, (bad, answer)
            assert match in answer["error"]["message"], (bad, answer)
        answer = raw_load(bob, **good)  # another tenant's buffer: it does not exist
        assert answer["error"]["code"] == "NOT_FOUND", answer
        assert raw.call("ping")["ok"] and bob.call("ping")["ok"]
        assert list((await alice.get_buffer_meta(bid))["tensors"]) == [VICTIM]
        raw.close()
        bob.close()
        await alice.release_buffer(bid)


ENV = b"HF_TOKEN=hf_SeCrEtToKeNvAlUe1234567890\nOTHER=x\n"


def quotes(message: str, body: bytes) -> list[str]:
    """What of ``body`` (a file's bytes) ``message`` gives away: any run of
    4 of its bytes, or its first 8 bytes read as a number either way."""
    head = body[:8].ljust(8, b"\0")
    found = [str(int.from_bytes(head, order)) for order in ("little", "big")
             if str(int.from_bytes(head, order)) in message]
    text = body.decode("latin-1")
    return found + [text[i:i + 4] for i in range(len(text) - 3) if text[i:i + 4] in message]


async def test_a_file_that_is_no_model_leaks_none_of_its_bytes(
        node: tuple[DaemonProc, Path, Path]) -> None:
    """A tenant names a ``.env`` in the model directory: the refusal says it
    is no model (and its size) and quotes none of its bytes; it quoted the
    first 8 as "a header of 5639996912441443912 bytes" (``HF_TOKEN``)."""
    d, models, _ = node
    (models / ".env").write_bytes(ENV)
    (models / "notes.safetensors").write_bytes(ENV)
    async with d.connect("alice") as alice:
        bid = await alice.request_buffer(4096)
        raw = hello(d.addr, d.token("alice"))
        try:
            for path in (".env", "notes.safetensors"):
                answer = raw_load(raw, buffer_id=bid, path=path, file_size=len(ENV),
                                  file_offsets=P.pack_u64([8]), offsets=P.pack_u64([0]),
                                  sizes=P.pack_u64([8]), hashes=P.pack_u64([1, 2]),
                                  checksums=P.pack_u64([3]), names=["t"],
                                  kind_dtypes=["uint8"], kind_shapes=[[8]])
                assert answer["error"]["code"] == "BAD_REQUEST", answer
                message = answer["error"]["message"]
                assert "not a safetensors header" in message and str(len(ENV)) in message
                assert quotes(message, ENV) == [], message
                assert quotes(json.dumps(answer["error"].get("details")), ENV) == []
        finally:
            raw.close()
            await alice.release_buffer(bid)


async def test_the_audit_trail_names_who_loaded_which_file_escaped(
        node: tuple[DaemonProc, Path, Path]) -> None:
    d, models, local = node
    odd = models / "evil\nop=release tenant=root.safetensors"
    shutil.copy(local / "tiny.safetensors", odd)
    (models / "plain.safetensors").symlink_to(odd.name)
    async with rpcbuf.Cluster.connect(d.addr, d.token("carol"), timeout=10) as cluster:
        await rpcbuf.load_model(cluster, local / "tiny.safetensors", source="node",
                                node_path="plain.safetensors", name="audited",
                                progress=False)
        with pytest.raises(rpcbuf.ClusterError):
            await rpcbuf.load_model(cluster, local / "tiny.safetensors", source="node",
                                    node_path="/etc/shadow", name="audited2", progress=False)
        await rpcbuf.unload_model(cluster, "audited")
    await asyncio.sleep(0.2)
    lines = [json.loads(x) for x in (d.tmp.parent / "audit.log").read_text().splitlines()]
    mine = [x for x in lines if x["op"] == "load_file" and x["tenant"] == "carol"]
    # Each load first has the node open its copy (no tensors: its header only).
    assert [x["code"] for x in mine] == ["OK", "OK", "FORBIDDEN"]
    assert "items=0 read=0" in mine[0]["note"]
    mine = mine[1:]
    assert mine[0]["note"].startswith("file=plain.safetensors (") and "\n" in mine[0]["note"]
    assert mine[0]["bytes"] > 0 and "read=" in mine[0]["note"]
    assert mine[1]["note"].startswith("file=/etc/shadow ") and "root:" not in json.dumps(mine)
    text = logs._text(mine[0])  # the same record in the text log: one line, escaped
    assert "\n" not in text and "\\nop=release" in text


def cli(d: DaemonProc, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rpcbuf.cli", *args, "--endpoint", d.addr,
                           "--token", d.token("dave")], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})


async def test_cli_hash_then_load_from_node(node: tuple[DaemonProc, Path, Path],
                                            tmp_path: Path) -> None:
    d, _models, local = node
    res = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "rpcbuf.cli",
                                                   "hash",
                                                   str(local / "tiny.safetensors"), "--json"],
                                  cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    made = json.loads(res.stdout)
    assert made["manifest"] == str(manifest_path(local / "tiny.safetensors"))
    only = tmp_path / Path(made["manifest"]).name  # the driver holds the manifest alone
    shutil.copy(made["manifest"], only)
    res = await asyncio.to_thread(cli, d, "load", str(only), "--from-node", "tiny.safetensors",
                                  "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["name"] == "tiny" and out["hashes"] == "manifest" and out["bytes_hashed"] == 0
    assert out["bytes_sent"] == 0 and out["bytes_read_locally"] == out["bytes_total"] > 0
    assert out["nodes"][d.addr]["bytes_read_locally"] == out["bytes_total"]
    res = await asyncio.to_thread(cli, d, "load", str(local / "tiny.safetensors"),
                                  "--from-node", "tiny.safetensors")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and "read there" in res.stdout, res.stdout
    assert "hash manifest" in res.stdout
    res = await asyncio.to_thread(cli, d, "load", str(local / "tiny.safetensors"),
                                  "--from-node", "missing.safetensors")
    assert res.returncode == 1 and "missing.safetensors" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    res = await asyncio.to_thread(cli, d, "unload", "tiny")
    assert res.returncode == 0, res.stderr
    os.unlink(made["manifest"])


async def test_a_gpu_buffer_loads_through_the_bounce_buffer(tmp_path: Path) -> None:
    """The daemon's device branch, against the NumPy-backed fake CuPy."""
    models = tmp_path / "models"
    models.mkdir()
    path = write_safetensors(models / "m.safetensors", llama_tensors(2))
    pythonpath = f"{FAKE_CUPY}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    d = start_daemon(tmp_path / "d", "--model-dir", str(models), "--device", "cpu:16MiB",
                     "--device", "cuda:0:16MiB",
                     env={"PYTHONPATH": pythonpath, "RPCBUF_UCX_CUDA": "0"})
    try:
        async with rpcbuf.Cluster.connect(d.addr, d.token("alice"), timeout=10) as cluster:
            res = await rpcbuf.load_model(cluster, path, "1:prolog,all,epilog", source="node",
                                          node_path="m.safetensors", progress=False)
            assert res.buffers[0]["device"] == "gpu:0"
            got = await cluster[d.addr].load_tensors(res.buffers[0]["buffer_id"])
            for n, a in llama_tensors(2).items():
                assert np.array_equal(got[n], a), n
            await rpcbuf.unload_model(cluster, "m")
    finally:
        assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A 256 MiB model in a model directory of its own, and its hashes."""
    models = tmp_path_factory.mktemp("big-models")
    rng = np.random.default_rng(3)
    path = write_safetensors(models / "big.safetensors",
                             {f"layers.{i}.w": rng.integers(0, 255, 32 << 20, dtype=np.uint8)
                              for i in range(8)})
    return path, describe(path, use_cache=False)


def big_request(bid: str, hm: Any) -> dict[str, Any]:
    ts = [t for _, t in hm.tensors]
    offs, at = [], 0
    for t in ts:
        offs.append(at)
        at += t.nbytes
    return dict(buffer_id=bid, path="big.safetensors", file_size=hm.files[0].size,
                file_offsets=P.pack_u64([t.file_offset for t in ts]), offsets=P.pack_u64(offs),
                sizes=P.pack_u64([t.nbytes for t in ts]),
                hashes=P.pack_u64([w for t in ts for w in (t.digest & (2**64 - 1),
                                                           t.digest >> 64)]),
                checksums=P.pack_u64([t.checksum for t in ts]), names=[t.name for t in ts],
                kinds=P.pack_u64(range(len(ts))), kind_dtypes=[t.dtype for t in ts],
                kind_shapes=[list(t.shape) for t in ts])


async def test_a_load_past_its_deadline_records_nothing(big: tuple[Path, Any],
                                                        tmp_path: Path) -> None:
    path, hm = big
    d = start_daemon(tmp_path / "d", "--model-dir", str(path.parent), "--device", "cpu:512MiB",
                     "--transfer-timeout", "0.02s")
    try:
        async with d.connect("alice") as ctx:
            bid = await ctx.request_buffer(300 << 20)
            raw = hello(d.addr, d.token("alice"))
            answer = raw.call("load_file", **big_request(bid, hm))
            assert not answer["ok"] and answer["error"]["code"] == "TIMEOUT", answer
            assert "big.safetensors" in answer["error"]["message"]
            assert (await ctx.get_buffer_meta(bid))["tensors"] == {}
            for at in (0, 8 << 20):  # what was read was zeroed again (small reads: the
                assert not (await ctx.read_buffer(bid, at, 1 << 20)).any()  # 20 ms deadline)
            raw.close()
            await ctx.release_buffer(bid)
    finally:
        assert d.stop() == 0, d.log()


async def test_a_client_that_vanishes_mid_load_leaves_nothing(big: tuple[Path, Any],
                                                              tmp_path: Path) -> None:
    path, hm = big
    d = start_daemon(tmp_path / "d", "--model-dir", str(path.parent), "--device", "cpu:512MiB",
                     "--audit-log", str(tmp_path / "audit.log"))
    try:
        start = await free(d)
        raw = hello(d.addr, d.token("alice"))
        bid = raw.call("request_buffer", size=300 << 20)["result"]["buffer_id"]
        raw.send(frame({"op": "load_file", "id": 99, **big_request(bid, hm)}))
        raw.close()  # gone while its 256 MiB are read
        for _ in range(100):
            if await free(d) == start:
                break
            await asyncio.sleep(0.05)
        assert await free(d) == start  # the session's buffer went with it, once the read ended
        async with d.connect("alice") as ctx:
            assert await ctx.list_buffers() == []
    finally:
        assert d.stop() == 0, d.log()
    records = [json.loads(x) for x in (tmp_path / "audit.log").read_text().splitlines()]
    loads = [r for r in records if r["op"] == "load_file"]
    assert [r["code"] for r in loads] == ["CONNECTION_LOST"], loads
    assert "did not end" not in d.log()


async def test_a_directory_of_shards_loads_shard_by_shard(
        node: tuple[DaemonProc, Path, Path]) -> None:
    d, models, local = node
    t = llama_tensors(2, seed=4)
    names = list(t)
    for where in (local / "sharded", models / "sharded"):
        where.mkdir(exist_ok=True)
        write_safetensors(where / "model-00001-of-00002.safetensors",
                          {n: t[n] for n in names[:7]})
        write_safetensors(where / "model-00002-of-00002.safetensors",
                          {n: t[n] for n in names[7:]})
    res = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "rpcbuf.cli",
                                                   "hash",
                                                   str(local / "sharded")],
                                  cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "rpcbuf-hashes.json" in res.stdout, res.stderr
    async with rpcbuf.Cluster.connect(d.addr, d.token("alice"), timeout=10) as cluster:
        out = await rpcbuf.load_model(cluster, local / "sharded" / "rpcbuf-hashes.json",
                                      source="node", node_path="sharded", progress=False)
        assert out.name == "sharded" and out.to_json()["hashes"] == "manifest"
        got = await cluster[d.addr].load_tensors(out.buffers[0]["buffer_id"])
        assert set(got) == set(t)  # rpcbuf's own entries only when named
        assert all(np.array_equal(got[n], t[n]) for n in t)
        model = open_model(local / "sharded")  # the manifest alone carried the metadata
        want = (model.format, model.metadata)
        model.close()
        info = await rpcbuf.model_info(cluster[d.addr], "sharded")
        assert (info.format, info.metadata) == want and info.metadata
        await rpcbuf.unload_model(cluster, "sharded")
