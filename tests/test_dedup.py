"""Content-hash dedup: the daemon's index, the disk cache, and their guarantees."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc, start_daemon
from control import protocol as P
from control.dedup import content_hashes
from control.diskcache import HEADER, DiskCache, digest128
from dataplane.checksum import checksum


def tensors(n: int = 12, seed: int = 0, size: int = 5000) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layers.{i}.w": rng.standard_normal(size + 17 * i, dtype=np.float32)
            for i in range(n)}


async def stored(ctx: rpcbuf.RpcContext, model: dict[str, np.ndarray],
                 name: str | None = None) -> tuple[str, dict[str, int]]:
    bid = await ctx.request_buffer(rpcbuf.calculate_buffer_size(model, headroom=0), name=name)
    return bid, await ctx.store_tensors_dedup(bid, model)


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


async def test_dedup_is_per_tenant(clean_pool: DaemonProc) -> None:
    model = tensors(seed=7)
    async with clean_pool.connect("alice") as alice, clean_pool.connect("mallory") as mallory:
        a, _ = await stored(alice, model)
        m = await mallory.request_buffer(rpcbuf.calculate_buffer_size(model, headroom=0))
        got = await mallory.store_tensors_dedup(m, model)  # knows every hash: learns nothing
        assert got["placed"] == 0 and got["sent"] == len(model)
        await alice.release_buffer(a)
        await mallory.release_buffer(m)


async def test_dedup_store_validates_its_request(ctx: rpcbuf.RpcContext) -> None:
    bid = await ctx.request_buffer(4096)
    good = dict(buffer_id=bid, offsets=P.pack_u64([0]), sizes=P.pack_u64([16]),
                hashes=P.pack_u64([1, 2]), checksums=P.pack_u64([3]), names=["x"],
                dtypes=["<f4"], shapes=[[4]])
    assert P.unpack_u64((await ctx._call(P.DedupStore(**good)))["placed"]).size == 0
    for bad in ({"hashes": P.pack_u64([1])}, {"sizes": P.pack_u64([8])},
                {"offsets": P.pack_u64([4090])}, {"names": ["x", "y"]}, {"dtypes": ["O"]}):
        with pytest.raises((rpcbuf.BadRequest, rpcbuf.OutOfRange)):
            await ctx._call(P.DedupStore(**{**good, **bad}))  # type: ignore[arg-type]
    with pytest.raises(rpcbuf.NotFound):
        await ctx._call(P.DedupStore(**{**good, "buffer_id": "b-nope"}))  # type: ignore[arg-type]
    await ctx.release_buffer(bid)


def _cached_files(root: Path) -> list[Path]:
    return sorted(root.glob("*/*/*.bin"))


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
