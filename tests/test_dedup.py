"""Content-hash dedup: the daemon's index, the disk cache, and their guarantees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc, start_daemon
from rpcbuf.control.client.dedup import content_hashes
from rpcbuf.control.daemon.content.diskcache import HEADER, DiskCache
from rpcbuf.control.wire import protocol as P
from rpcbuf.dataplane.checksum import checksum, digest128


def tensors(n: int = 12, seed: int = 0, size: int = 5000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layers.{i}.w": rng.standard_normal(size + 17 * i, dtype=np.float32)
            for i in range(n)}


async def stored(ctx: rpcbuf.RpcContext, model: dict[str, np.ndarray],
                 name: str | None = None) -> tuple[str, dict[str, int]]:
    bid = await ctx.request_buffer(rpcbuf.calculate_buffer_size(model, headroom=0), name=name)
    return bid, await ctx.store_tensors_dedup(bid, model)


@pytest.mark.both_paths
async def test_second_store_sends_nothing_and_copies_verify(ctx: rpcbuf.RpcContext) -> None:
    model = tensors()
    a, first = await stored(ctx, model)
    assert first["placed"] == 0 and first["bytes_sent"] == sum(x.nbytes for x in model.values())
    b, second = await stored(ctx, model)
    assert second["sent"] == 0 and second["placed"] == len(model)
    again = await ctx.store_tensors_dedup(a, model)  # same buffer, same layout: in place
    assert again["sent"] == 0
    back = await ctx.load_tensors(b)  # manifest checksums verified on the way back
    for name, arr in model.items():
        np.testing.assert_array_equal(back[name], arr)
    # overwritten bytes are never a dedup source: index dropped at once
    await ctx.store_tensor(a, np.zeros(64, np.uint8), offset=0)
    await ctx.store_tensor(b, np.zeros(64, np.uint8), offset=0)
    c, third = await stored(ctx, model)
    assert third["sent"] == 1 and third["placed"] == len(model) - 1
    fixed = await ctx.store_tensors_dedup(a, model)  # a's first tensor is not trusted in place
    assert fixed["sent"] == 0
    assert np.array_equal((await ctx.load_tensors(a))["layers.0.w"], model["layers.0.w"])
    # released buffers are never a dedup source
    for bid in (a, b, c):
        await ctx.release_buffer(bid)
    d, fourth = await stored(ctx, model)
    assert fourth["placed"] == 0
    await ctx.release_buffer(d)


@pytest.mark.both_paths
async def test_dedup_is_per_tenant(clean_pool: DaemonProc) -> None:
    model = tensors(seed=7)
    async with clean_pool.connect("alice") as alice, clean_pool.connect("mallory") as mallory:
        a, _ = await stored(alice, model)
        m = await mallory.request_buffer(rpcbuf.calculate_buffer_size(model, headroom=0))
        got = await mallory.store_tensors_dedup(m, model)  # knows every hash: learns nothing
        assert got["placed"] == 0 and got["sent"] == len(model)
        await alice.release_buffer(a)
        await mallory.release_buffer(m)


@pytest.mark.both_paths
async def test_dedup_store_validates_its_request(ctx: rpcbuf.RpcContext) -> None:
    bid = await ctx.request_buffer(4096)
    good = dict(buffer_id=bid, offsets=P.pack_u64([0]), sizes=P.pack_u64([16]),
                hashes=P.pack_u64([1, 2]), checksums=P.pack_u64([3]), names=["x"],
                kind_dtypes=["<f4"], kind_shapes=[[4]])
    assert P.unpack_u64((await ctx._call(P.DedupStore(**good)))["placed"]).size == 0
    for bad in ({"hashes": P.pack_u64([1])}, {"sizes": P.pack_u64([8])},
                {"offsets": P.pack_u64([4090])}, {"names": ["x", "y"]}, {"kind_dtypes": ["O"]}):
        with pytest.raises((rpcbuf.BadRequest, rpcbuf.OutOfRange)):
            await ctx._call(P.DedupStore(**{**good, **bad}))  # type: ignore[arg-type]
    with pytest.raises(rpcbuf.NotFound):
        await ctx._call(P.DedupStore(**{**good, "buffer_id": "b-nope"}))  # type: ignore[arg-type]
    await ctx.release_buffer(bid)


def _cached_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*/*.bin"))


@pytest.mark.both_paths
async def test_disk_cache_survives_restart_and_never_serves_corruption(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    flags = ("--device", "cpu:16MiB", "--cache-dir", str(cache), "--cache-size", "8MiB")
    model = tensors(10, seed=3)
    d = start_daemon(tmp_path / "d1", *flags)
    try:
        async with d.connect("alice") as c:
            _, first = await stored(c, model, name="m")
            assert first["sent"] == len(model)
    finally:
        assert d.stop() == 0, d.log()  # SIGTERM lets the cache writes finish
    files = _cached_files(cache)
    assert len(files) == len(model)
    d = start_daemon(tmp_path / "d2", *flags)  # a restarted daemon on the same cache
    try:
        async with d.connect("alice") as c:
            _, warm = await stored(c, model)
            assert warm["sent"] == 0 and warm["placed"] == len(model)
        async with d.connect("bob") as c:  # another tenant's cache is not this one's
            _, other = await stored(c, model)
            assert other["placed"] == 0
    finally:
        assert d.stop() == 0, d.log()
    # corrupt one payload byte, truncate another file, forge a third's header
    alice = [f for f in _cached_files(cache) if f.parent.parent.name == files[0].parent.parent.name]
    blob = bytearray(alice[0].read_bytes())
    blob[HEADER.size + 10] ^= 0xFF
    alice[0].write_bytes(bytes(blob))
    alice[1].write_bytes(alice[1].read_bytes()[:-3])
    head = bytearray(alice[2].read_bytes())
    head[20] ^= 1  # the recorded checksum
    alice[2].write_bytes(bytes(head))
    d = start_daemon(tmp_path / "d3", *flags)
    try:
        async with d.connect("alice") as c:
            bid, third = await stored(c, model)
            assert third["sent"] == 3 and third["placed"] == len(model) - 3
            back = await c.load_tensors(bid)
            for name, arr in model.items():
                np.testing.assert_array_equal(back[name], arr)
        assert d.log().count("corrupt file") == 3
    finally:
        assert d.stop() == 0, d.log()
    assert not alice[0].exists() or alice[0].read_bytes() != bytes(blob)  # replaced, not served


def test_disk_cache_bounds_and_evicts_least_recently_used(tmp_path: Path) -> None:
    per = HEADER.size + 4000
    cache = DiskCache(tmp_path, max_bytes=3 * per)
    arrays = [np.full(1000, i, np.float32) for i in range(5)]
    keys = [(digest128(a), checksum(a)) for a in arrays]
    for i in range(3):
        assert cache.write("t", *keys[i], arrays[i])
    out = np.empty(1000, np.float32)
    assert cache.read_into("t", *keys[0], out) and (out == 0).all()  # 0 is now most recent
    assert cache.write("t", *keys[3], arrays[3])  # evicts 1, the least recently used
    assert cache.used <= cache.max_bytes and not cache.has("t", keys[1][0], 4000)
    assert cache.has("t", keys[0][0], 4000) and not cache.has("u", keys[0][0], 4000)
    assert not cache.read_into("t", *keys[1], out)
    assert not cache.read_into("t", keys[0][0], keys[0][1] ^ 1, out)  # other bytes meant:
    assert cache.read_into("t", *keys[0], out)  # a miss, the sound file stays
    assert not cache.write("t", *keys[4], np.zeros(10_000, np.uint8))  # bigger than the cache
    again = DiskCache(tmp_path, max_bytes=2 * per)  # a restart with a smaller bound
    assert again.used <= 2 * per and len(again.stats()) > 0
    assert content_hashes({"x": arrays[0]})["x"] == keys[0]


@pytest.mark.both_paths
async def test_client_hash_cache_skips_reading_and_follows_file_changes(
        clean_pool: DaemonProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from models import llama_tensors, write_safetensors
    from rpcbuf.models import reading

    monkeypatch.setenv("RPCBUF_CACHE_DIR", str(tmp_path / "hashes"))
    hashed: list[str] = []

    def counting(arrays: dict[str, np.ndarray]) -> dict[str, tuple[int, int]]:
        hashed.extend(arrays)
        return content_hashes(arrays)

    monkeypatch.setattr(reading, "content_hashes", counting)
    model = llama_tensors(3)
    path = write_safetensors(tmp_path / "m.safetensors", model)
    async with rpcbuf.Cluster.connect(clean_pool.addr, clean_pool.token("hc")) as cluster:

        async def load(**kw: bool) -> rpcbuf.LoadResult:
            hashed.clear()
            return await rpcbuf.load_model(cluster, path, name="hc", progress=False, **kw)

        first = await load()
        assert sorted(hashed) == sorted(model) and first.bytes_sent == first.bytes_total
        again = await load()  # unchanged file: nothing hashed, nothing sent
        assert hashed == [] and again.bytes_sent == 0
        await load(hash_cache=False)
        assert sorted(hashed) == sorted(model)
        # same size, new bytes: the file's identity changes, its old hashes go unused
        changed = dict(model)
        name = "model.layers.1.mlp.up_proj.weight"
        changed[name] = model[name] + 1
        st = path.stat()
        write_safetensors(path, changed)
        assert path.stat().st_size == st.st_size
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime
        fresh = await load()
        assert sorted(hashed) == sorted(model)
        assert fresh.bytes_sent == changed[name].nbytes
        # a corrupt cache file is ignored (and replaced)
        cache_file = tmp_path / "hashes" / "hashes.json"
        cache_file.write_text('{"version": 1, "files": {"x": {"tensors": ')
        await load()
        assert sorted(hashed) == sorted(model)
        await load()
        assert hashed == []
        ctx = cluster[clean_pool.addr]
        back = await ctx.load_tensors((await ctx.list_buffers())[0]["buffer_id"])
        np.testing.assert_array_equal(back[name], changed[name])
        await rpcbuf.unload_model(cluster, "hc")


async def test_tensors_are_hashed_while_the_buffers_are_requested(
        clean_pool: DaemonProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The client hashes ahead while the nodes answer its requests (a node
    backs new memory first): the requests here wait until every tensor was
    hashed, and the upload then hashes none again; when the requests answer
    at once, the upload hashes what was not reached, each tensor once."""
    import asyncio
    import contextlib

    from models import llama_tensors, write_safetensors
    from rpcbuf.models import loader, reading

    monkeypatch.setenv("RPCBUF_CACHE_DIR", str(tmp_path / "hashes"))
    hashed: list[str] = []
    during: list[list[str]] = []
    loop = asyncio.get_running_loop()
    all_hashed = asyncio.Event()

    def counting(arrays: dict[str, np.ndarray]) -> dict[str, tuple[int, int]]:
        hashed.extend(arrays)
        if len(hashed) >= len(model):
            loop.call_soon_threadsafe(all_hashed.set)
        return content_hashes(arrays)

    real = loader.place_and_acquire

    async def slow_requests(*a: object, **k: object) -> object:
        with contextlib.suppress(TimeoutError):  # a node backing fresh memory
            await asyncio.wait_for(all_hashed.wait(), 10)
        during.append(list(hashed))
        return await real(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(reading, "content_hashes", counting)
    monkeypatch.setattr(loader, "place_and_acquire", slow_requests)
    model = llama_tensors(3)
    path = write_safetensors(tmp_path / "m.safetensors", model)
    async with rpcbuf.Cluster.connect(clean_pool.addr, clean_pool.token("ahead")) as cluster:
        res = await rpcbuf.load_model(cluster, path, name="ahead", progress=False,
                                      hash_cache=False)
        assert sorted(during[0]) == sorted(model)  # all of it while the requests waited
        assert sorted(hashed) == sorted(model)  # and nothing hashed again
        assert res.bytes_sent == res.bytes_total
        ctx = cluster[clean_pool.addr]
        back = await ctx.load_tensors((await ctx.list_buffers())[0]["buffer_id"])
        for name, arr in model.items():
            np.testing.assert_array_equal(back[name], arr)
        await rpcbuf.unload_model(cluster, "ahead")
        monkeypatch.setattr(loader, "place_and_acquire", real)  # answered at once
        hashed.clear()
        await rpcbuf.load_model(cluster, path, name="ahead", progress=False,
                                hash_cache=False)
        assert sorted(hashed) == sorted(model)  # ahead or by the upload, each once
        await rpcbuf.unload_model(cluster, "ahead")


def test_prefault_flag_and_config_key(tmp_path: Path) -> None:
    from rpcbuf.control.daemon.service import config
    from rpcbuf.control.daemon.service.main import build_parser
    from rpcbuf.dataplane.arena import HostArena

    assert config.resolve(build_parser(), ["--secret-file", "s", "--prefault"]).prefault
    (tmp_path / "c.toml").write_text("prefault = true\n")
    assert config.resolve(build_parser(), ["--secret-file", "s", "--config",
                                           str(tmp_path / "c.toml")]).prefault
    arena = HostArena(8 << 20)
    arena.back(0, 4 << 20)
    arena.view(0, 4)[:] = [1, 2, 3, 4]
    assert arena.prefault.populate(0, 4 << 20) in (True, False)  # False: a kernel before 5.14
    assert arena.view(0, 4).tolist() == [1, 2, 3, 4]  # changes no byte
    arena.unback(0, 4 << 20)


@pytest.mark.both_paths
async def test_daemon_with_prefault_serves(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, "--device", "cpu:64MiB", "--prefault")
    try:
        async with d.connect("alice") as c:
            model = tensors(4)
            bid, got = await stored(c, model)
            assert got["sent"] == len(model)
            back = await c.load_tensors(bid)
            np.testing.assert_array_equal(back["layers.1.w"], model["layers.1.w"])
    finally:
        assert d.stop() == 0, d.log()
