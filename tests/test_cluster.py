"""Cluster client, model upload and unload across real daemons on loopback.

Two daemons share one secret (one token for both, like a cluster secret);
node A has two devices, so the cluster has three slots: A's cpu:0, A's cpu:1,
B's cpu:0.  The multi-host version over veth pairs is ``test_netns.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import numpy as np
import pytest

import rpcbuf
from conftest import ROOT, DaemonProc, start_daemon
from models import (
    gguf_tensors,
    llama_tensors,
    write_gguf,
    write_raw_safetensors,
    write_safetensors,
)
from rpcbuf.models.metadata import META_TENSOR
from rpcbuf.models.modelfile import open_model
from rpcbuf.models.record import LOAD_TENSOR

TOKEN_TENANT = "loader"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[DaemonProc]]:
    base = tmp_path_factory.mktemp("cluster")
    (base / "a").mkdir()
    (base / "b").mkdir()
    start_daemon(base / "seed", "--device", "cpu:1MiB").stop()  # makes a secret
    for d in ("a", "b"):
        shutil.copy(base / "seed" / "secret", base / d / "secret")
    a = start_daemon(base / "a", "--device", "cpu:0:32MiB", "--device", "cpu:1:8MiB")
    b = start_daemon(base / "b", "--device", "cpu:0:32MiB")
    yield [a, b]
    for d in (a, b):
        if d.proc.poll() is None:
            assert d.stop() == 0, d.log()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("models")
    write_safetensors(d / "tiny.safetensors", llama_tensors(6))
    write_gguf(d / "tiny.gguf", gguf_tensors(5))
    return d


def endpoints(nodes: list[DaemonProc]) -> str:
    return ";".join(n.addr for n in nodes)


@pytest.fixture
async def cluster(nodes: list[DaemonProc]) -> AsyncIterator[rpcbuf.Cluster]:
    async with rpcbuf.Cluster.connect(endpoints(nodes), nodes[0].token(TOKEN_TENANT)) as c:
        free = [d["free"] for d in await c.devices()]
        yield c
        left = {a: [b["name"] for b in bs] for a, bs in (await c.list_buffers()).items()}
        assert not any(left.values()), f"buffers left behind: {left}"
        assert [d["free"] for d in await c.devices()] == free, "memory leaked"


async def test_devices_in_slot_order_and_per_node_errors(nodes: list[DaemonProc]) -> None:
    token = nodes[0].token(TOKEN_TENANT)
    cluster = await rpcbuf.Cluster.connect([n.addr for n in nodes], token)
    try:
        devs = await cluster.devices()
        assert [(d["slot"], d["endpoint"], d["key"]) for d in devs] == [
            (0, nodes[0].addr, "cpu:0"), (1, nodes[0].addr, "cpu:1"), (2, nodes[1].addr, "cpu:0")]
        assert devs[1]["total"] == 8 << 20 and devs[1]["largest_free"] == 8 << 20
    finally:
        await cluster.close()
        await cluster.close()  # idempotent
    dead = "127.0.0.1:1"
    with pytest.raises(rpcbuf.ClusterError) as info:
        await rpcbuf.Cluster.connect(f"{nodes[0].addr};{dead}", token)
    assert set(info.value.errors) == {dead}
    assert info.value.errors[dead].code == "CONNECTION_LOST"
    assert info.value.details["nodes"][dead]["code"] == "CONNECTION_LOST"
    async with rpcbuf.Cluster.connect([nodes[0].addr, dead, nodes[1].addr], token,
                                      partial=True) as part:
        by_node = await part.devices_by_node()
        assert list(by_node) == [nodes[0].addr, dead, nodes[1].addr]
        assert isinstance(by_node[dead], rpcbuf.ConnectionLost)
        with pytest.raises(rpcbuf.ClusterError) as info:
            await part.devices()
        assert set(info.value.results) == {nodes[0].addr, nodes[1].addr}
    with pytest.raises(rpcbuf.ClusterError) as info:  # a wrong token, per node
        await rpcbuf.Cluster.connect(endpoints(nodes), {nodes[0].addr: token,
                                                        nodes[1].addr: "forged"})
    assert info.value.errors[nodes[1].addr].code == "AUTH_FAILED"
    with pytest.raises(rpcbuf.BadRequest):
        rpcbuf.Cluster.connect(f"{nodes[0].addr};{nodes[0].addr}", token)


async def test_load_by_spec_reload_dedups_then_unload(cluster: rpcbuf.Cluster,
                                                      model_dir: Path) -> None:
    path = model_dir / "tiny.safetensors"
    model = llama_tensors(6)
    seen: list[tuple[str, int, int]] = []
    res = await rpcbuf.load_model(cluster, path, "2:prolog,epilog;0:4;1:all", progress=False,
                                  batch_bytes=64 << 10,
                                  on_progress=lambda a, d, t: seen.append((a, d, t)))
    a, b = cluster.endpoints
    assert res.name == "tiny" and res.placement.spec == "2:prolog,epilog;0:4;1:all"
    assert res.bytes_sent == res.bytes_total == sum(x.nbytes for x in model.values())
    assert res.nodes[b].tensors == 3 and res.nodes[a].tensors == len(model) - 3
    assert sorted(res.nodes[a].buffers) == ["tiny/slot0", "tiny/slot1"]
    assert seen[-1][1] == seen[-1][2] and len(seen) > 3  # bounded batches, progress per node
    got: dict[str, np.ndarray] = {}
    for addr, bufs in (await cluster.list_buffers()).items():
        for meta in bufs:
            got.update(await cluster[addr].load_tensors(meta["buffer_id"]))  # checksums
            # and, by name, the file's metadata (per node) and each slot's load record
            held = set((await cluster[addr].get_buffer_meta(meta["buffer_id"]))["tensors"])
            got.update(await cluster[addr].load_tensors(
                meta["buffer_id"], sorted(held & {META_TENSOR, LOAD_TENSOR})))
    assert set(got) == set(model) | {META_TENSOR, LOAD_TENSOR}
    for addr, slots in ((a, [0, 1]), (b, [2])):
        info = await rpcbuf.model_info(cluster[addr], "tiny")
        assert [s.slot for s in info.slots] == slots
        assert (info.format, info.metadata) == ("safetensors", {"format": "np"})
        assert {t.slot for t in info.tensors.values()} == set(slots)
        assert all(t.source_type == "F16" or t.source_type == "F32"
                   for t in info.tensors.values())
        held = (await cluster[addr].get_buffer_meta(info.slots[0].buffer_id))["tensors"]
        assert META_TENSOR in held  # on the node's first slot only
        if len(slots) > 1:
            rest = (await cluster[addr].get_buffer_meta(info.slots[1].buffer_id))["tensors"]
            assert META_TENSOR not in rest
    counts = [len((await rpcbuf.model_info(cluster[x], "tiny")).tensors) for x in (a, b)]
    assert counts == [len(model) - 3, 3]
    for name, arr in model.items():
        np.testing.assert_array_equal(got[name], arr)
    slot1 = (await cluster[a].open_buffer("tiny/slot1"))
    assert sorted(set((await cluster[a].get_buffer_meta(slot1))["tensors"]) - {LOAD_TENSOR}
                  )[0].startswith("model.layers.4.")
    again = await rpcbuf.load_model(cluster, path, "2:prolog,epilog;0:4;1:all", progress=False)
    assert again.bytes_sent == 0 and all(buf["reused"] for buf in again.buffers)
    assert again.nodes[a].bytes_placed == res.nodes[a].bytes_total
    released = await rpcbuf.unload_model(cluster, "tiny")
    assert released == {a: ["tiny/slot0", "tiny/slot1"], b: ["tiny/slot2"]}
    with pytest.raises(rpcbuf.NotFound):
        await rpcbuf.unload_model(cluster, "tiny")


async def test_gguf_auto_placement_and_raw_dtypes(cluster: rpcbuf.Cluster, model_dir: Path,
                                                  tmp_path: Path) -> None:
    res = await rpcbuf.load_model(cluster, model_dir / "tiny.gguf", name="g", progress=False)
    assert res.placement.auto and res.format == "gguf"
    assert res.bytes_sent == open_model(model_dir / "tiny.gguf").nbytes
    spec = res.placement.spec
    assert spec.startswith("0:prolog") and spec.endswith("epilog")
    a = cluster.endpoints[0]
    bid = await cluster[a].open_buffer("g/slot0")
    q8 = (await cluster[a].get_buffer_meta(bid))["tensors"].get("blk.0.extra_q8.weight")
    if q8 is not None:
        assert q8["dtype"] == "|u1" and q8["shape"] == [4, 34]
    await rpcbuf.unload_model(cluster, "g")
    bits = np.arange(12, dtype="<u2").tobytes()
    raw = write_raw_safetensors(tmp_path / "bf.safetensors", {
        "tok_embeddings.weight": ("BF16", [3, 4], bits),
        "layers.0.w": ("F8_E4M3", [5], bytes(range(5))),
        "output.weight": ("F32", [2], np.ones(2, np.float32).tobytes())})
    res = await rpcbuf.load_model(cluster, raw, "0:prolog,all,epilog", progress=False)
    bid = await cluster[a].open_buffer("bf/slot0")
    back = await cluster[a].load_tensors(bid)
    assert back["tok_embeddings.weight"].dtype == np.dtype("<u2")
    assert back["tok_embeddings.weight"].tobytes() == bits
    assert back["layers.0.w"].tobytes() == bytes(range(5))
    await rpcbuf.unload_model(cluster, "bf")


async def test_refusals_happen_before_any_byte_moves(cluster: rpcbuf.Cluster,
                                                     model_dir: Path, tmp_path: Path) -> None:
    path = model_dir / "tiny.safetensors"
    for spec, words in [("0:prolog,epilog;1:2", "left over"),
                        ("0:prolog,epilog;7:all", "does not exist"),
                        ("0:prolog;1:all", "epilog"), ("0-prolog", "no ':'")]:
        with pytest.raises(rpcbuf.BadRequest) as info:
            await rpcbuf.load_model(cluster, path, spec, progress=False)
        assert words in info.value.message
    big = write_safetensors(tmp_path / "big.safetensors", llama_tensors(4, hidden=512, ffn=1024))
    with pytest.raises(rpcbuf.BadRequest) as info:  # 20 MiB of layers for the 8 MiB device
        await rpcbuf.load_model(cluster, big, "0:prolog,epilog;1:all", progress=False)
    assert info.value.details["slots"][0]["slot"] == 1
    with pytest.raises(FileNotFoundError):
        await rpcbuf.load_model(cluster, tmp_path / "missing.gguf", progress=False)
    (tmp_path / "junk.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(rpcbuf.BadRequest):
        await rpcbuf.load_model(cluster, tmp_path / "junk.safetensors", progress=False)


async def test_node_killed_mid_upload(tmp_path: Path, model_dir: Path) -> None:
    base = tmp_path
    a = start_daemon(base / "a", "--device", "cpu:32MiB")
    (base / "b").mkdir()
    shutil.copy(base / "a" / "secret", base / "b" / "secret")  # one cluster secret
    b = start_daemon(base / "b", "--device", "cpu:32MiB")
    token = a.token(TOKEN_TENANT)
    path = model_dir / "tiny.safetensors"
    try:
        async with rpcbuf.Cluster.connect([a.addr, b.addr], token) as cluster:
            def kill_b(addr: str, done: int, total: int) -> None:
                if addr == b.addr and b.proc.poll() is None:
                    b.proc.send_signal(signal.SIGKILL)

            with pytest.raises(rpcbuf.ClusterError) as info:
                await rpcbuf.load_model(cluster, path, "0:prolog,3;1:all,epilog",
                                        progress=False, batch_bytes=32 << 10,
                                        on_progress=kill_b)
            assert set(info.value.errors) == {b.addr}
            assert info.value.errors[b.addr].code == "CONNECTION_LOST"
            assert info.value.details["cleaned"] == {a.addr: ["tiny/slot0"]}
            assert await cluster[a.addr].list_buffers() == []  # cleaned up on the survivor
    finally:
        b.proc.wait(10)
        assert a.stop() == 0, a.log()


def mapped(path: Path) -> bool:
    """Whether this process maps ``path`` (``/proc/self/maps``)."""
    target = str(path.resolve())
    with open("/proc/self/maps") as f:
        return any(line.rstrip("\n").endswith(" " + target) for line in f)


async def test_load_unmaps_the_model_before_it_returns(cluster: rpcbuf.Cluster,
                                                       model_dir: Path, tmp_path: Path) -> None:
    """The model file's mapping is closed while the nodes commit (in a worker
    thread), and before ``load_model`` returns."""
    path = Path(shutil.copy(model_dir / "tiny.safetensors", tmp_path))  # mapped by us only
    seen: list[bool] = []
    model = open_model(path)  # the caller's: load_model closes it all the same
    await rpcbuf.load_model(cluster, model, progress=False, batch_bytes=64 << 10,
                            on_progress=lambda *_: seen.append(mapped(path)))
    assert seen and all(seen)  # mapped while it was sent
    assert not mapped(path)
    await rpcbuf.unload_model(cluster, "tiny")


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "rpcbuf.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout,
                          env={**os.environ, "COLUMNS": "200"})


async def test_cli_devices_load_ls_unload(nodes: list[DaemonProc], model_dir: Path) -> None:
    eps, tok = endpoints(nodes), nodes[0].token(TOKEN_TENANT)
    res = await asyncio.to_thread(cli, "devices", "--endpoints", eps, "--token", tok)
    assert res.returncode == 0, res.stderr
    assert "largest free" in res.stdout and "cpu:1" in res.stdout and nodes[1].addr in res.stdout
    res = await asyncio.to_thread(cli, "load", str(model_dir / "tiny.gguf"), "--endpoints", eps,
                                  "--token", tok, "--placement", "0:prolog,2;2:all,epilog",
                                  "--name", "llama-cli", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    a, b = nodes[0].addr, nodes[1].addr
    assert out["nodes"][a]["buffers"] == ["llama-cli/slot0"]
    assert out["nodes"][b]["buffers"] == ["llama-cli/slot2"]
    for key in ("bytes_total", "bytes_sent", "tensors", "seconds"):
        assert key in out["nodes"][a]
    assert out["bytes_sent"] == out["bytes_total"] > 0
    res = await asyncio.to_thread(cli, "ls", "--endpoints", eps, "--token", tok)
    assert "llama-cli/slot0" in res.stdout and "llama-cli/slot2" in res.stdout  # outlived load
    res = await asyncio.to_thread(cli, "load", str(model_dir / "tiny.gguf"), "--endpoints", eps,
                                  "--token", tok, "--placement", "0:prolog,2;5:all,epilog",
                                  "--name", "llama-cli")
    assert res.returncode == 2 and "slot 5 does not exist" in res.stderr
    res = await asyncio.to_thread(cli, "unload", "llama-cli", "--endpoints", eps, "--token", tok,
                                  "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["released"] == {a: ["llama-cli/slot0"],
                                                  b: ["llama-cli/slot2"]}
    res = await asyncio.to_thread(cli, "unload", "llama-cli", "--endpoints", eps, "--token", tok)
    assert res.returncode == 1 and "NOT_FOUND" in res.stderr
