"""Named tensor layouts, batches, and the daemon-side clear/copy."""

from __future__ import annotations

import asyncio
import itertools

import numpy as np
import pytest

import rpcbuf
from rpcbuf.control.client.tensors import ALIGN, plan_layout

pytestmark = pytest.mark.both_paths  # the same-host and the UCX data path


def llama_like(n_layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    t: dict[str, np.ndarray] = {"tok_embeddings.weight": rng.standard_normal((64, 32), np.float32)}
    for i in range(n_layers):
        for name, shape, dt in [("attention.wq.weight", (32, 32), np.float16),
                                ("attention.wk.weight", (32, 32), np.float16),
                                ("attention.wv.weight", (32, 32), np.float16),
                                ("attention.wo.weight", (32, 32), np.float16),
                                ("feed_forward.w1.weight", (32, 86), np.float16),
                                ("feed_forward.w2.weight", (86, 32), np.float16),
                                ("feed_forward.w3.weight", (32, 86), np.float16),
                                ("attention_norm.weight", (32,), np.float32),
                                ("ffn_norm.weight", (33,), np.float32),
                                ("rope.freqs", (7,), np.int8)]:
            t[f"layers.{i}.{name}"] = (rng.standard_normal(shape) * 10).astype(dt)
    t["norm.weight"] = rng.standard_normal(32).astype(np.float32)
    t["output.weight"] = rng.standard_normal((64, 32)).astype(np.float32)
    return t


def test_calculate_buffer_size() -> None:
    arrays = {"a": np.zeros(10, np.uint8), "b": np.zeros(300, np.float32)}
    assert rpcbuf.calculate_buffer_size(arrays, headroom=0) == 256 + 1280
    specs = [((10,), "uint8"), ((300,), np.float32)]
    assert rpcbuf.calculate_buffer_size(specs, headroom=0) == 256 + 1280
    assert rpcbuf.calculate_buffer_size(specs) == 1792  # +10 %, aligned up
    with pytest.raises(rpcbuf.BadRequest):
        rpcbuf.calculate_buffer_size(["nonsense"])
    with pytest.raises(rpcbuf.BadRequest):
        rpcbuf.calculate_buffer_size(arrays, headroom=-1)


def test_plan_layout_keeps_slots_and_appends() -> None:
    a = {"x": np.zeros(100, np.uint8), "y": np.zeros(1000, np.uint8)}
    first = plan_layout(a, {})
    assert first == {"x": 0, "y": 256}
    existing = {n: {"offset": o, "nbytes": a[n].nbytes} for n, o in first.items()}
    again = plan_layout({"y": np.ones(1000, np.uint8), "z": np.zeros(5, np.uint8)}, existing)
    assert again == {"y": 256, "z": 1280}
    assert all(o % ALIGN == 0 for o in again.values())
    grown = plan_layout({"x": np.zeros(300, np.uint8)}, existing)
    assert grown == {"x": 1280}  # a different size gets a new slot


async def test_300_tensor_manifest_written_by_one_read_by_another(clean_pool) -> None:  # type: ignore[no-untyped-def]
    model = llama_like(29)  # 3 + 29 * 10 = 293 ... plus the rest
    assert len(model) >= 290
    size = rpcbuf.calculate_buffer_size(model)
    async with clean_pool.connect("alice") as writer:
        bid = await writer.request_buffer(size, name="llama-mini/shard0")
        entries = await writer.store_tensors(bid, model, verify="checksum")
        assert set(entries) == set(model)
        offsets = sorted((e["offset"], e["nbytes"]) for e in entries.values())
        assert all(o % ALIGN == 0 for o, _ in offsets)
        assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(offsets))
    async with clean_pool.connect("alice") as reader:  # another process of the tenant
        bid2 = await reader.open_buffer("llama-mini/shard0")
        assert bid2 == bid
        meta = await reader.get_buffer_meta(bid2)
        man = meta["tensors"]
        assert set(man) == set(model)
        e = man["layers.3.attention.wq.weight"]
        assert e["dtype"] == "<f2" and e["shape"] == [32, 32] and e["nbytes"] == 2048
        assert e["checksum"] == rpcbuf.checksum(model["layers.3.attention.wq.weight"])
        loaded = await reader.load_tensors(bid2)
        assert set(loaded) == set(model)
        for name, arr in model.items():
            assert loaded[name].dtype == arr.dtype and loaded[name].shape == arr.shape
            np.testing.assert_array_equal(loaded[name], arr)
        some = await reader.load_tensors(bid2, names=["norm.weight", "rope.freqs"][:1])
        assert list(some) == ["norm.weight"]
        with pytest.raises(rpcbuf.NotFound):
            await reader.load_tensors(bid2, names=["no.such.tensor"])
        await reader.release_buffer(bid2)
    async with clean_pool.connect("bob") as bob:  # other tenants cannot even find it
        with pytest.raises(rpcbuf.NotFound):
            await bob.open_buffer("llama-mini/shard0")


async def test_overwrite_in_place_and_stale_entries_dropped(ctx: rpcbuf.RpcContext) -> None:
    bid = await ctx.request_buffer(8192)
    await ctx.store_tensors(bid, {"a": np.full(256, 1, np.uint8), "b": np.full(256, 2, np.uint8)})
    await ctx.store_tensors(bid, {"a": np.full(256, 9, np.uint8)})  # same size: same slot
    man = (await ctx.get_buffer_meta(bid))["tensors"]
    assert man["a"]["offset"] == 0 and man["b"]["offset"] == 256
    got = await ctx.load_tensors(bid)
    assert (got["a"] == 9).all() and (got["b"] == 2).all()
    # c is placed over b's bytes explicitly: b's entry no longer holds and goes
    await ctx.store_tensors(bid, {"c": np.full(300, 3, np.uint8)}, offset=256)
    man = (await ctx.get_buffer_meta(bid))["tensors"]
    assert set(man) == {"a", "c"}
    # a plain store over a tensor is caught by the manifest checksum on load
    await ctx.store_tensor(bid, np.zeros(10, np.uint8), offset=0)
    with pytest.raises(rpcbuf.VerifyFailed) as info:
        await ctx.load_tensors(bid)
    assert info.value.details["tensors"] == ["a"]
    assert (await ctx.load_tensors(bid, verify=False))["a"][0] == 0
    await ctx.release_buffer(bid)


async def test_store_tensors_errors(ctx: rpcbuf.RpcContext) -> None:
    bid = await ctx.request_buffer(1024)
    with pytest.raises(rpcbuf.OutOfRange):  # the buffer is too small
        await ctx.store_tensors(bid, {"big": np.zeros(2000, np.uint8)})
    with pytest.raises(rpcbuf.BadRequest):
        await ctx.store_tensors(bid, {"obj": np.array([object()])})
    with pytest.raises(rpcbuf.BadRequest):
        await ctx.store_tensors(bid, {1: np.zeros(4)})  # type: ignore[dict-item]
    with pytest.raises(rpcbuf.NotFound):
        await ctx.store_tensors("b-nope", {"a": np.zeros(4)})
    assert (await ctx.get_buffer_meta(bid))["tensors"] == {}  # nothing recorded
    await ctx.store_tensors(bid, {"ok": np.arange(4, dtype=np.int32)})
    assert await ctx.ping() > 0
    await ctx.release_buffer(bid)


async def test_batches(ctx: rpcbuf.RpcContext) -> None:
    bid = await ctx.request_buffer(1 << 20)
    items = [(i * 4096, np.full(4096, i % 251, np.uint8)) for i in range(200)]  # one run
    items += [(900_000, np.arange(1000, dtype=np.uint8)), (950_001, np.ones(7, np.uint8))]
    res = await ctx.store_batch(bid, list(reversed(items)), verify="checksum")  # any order
    # UCX: three messages (the 200 touching items coalesce); same host: no messages at all
    assert res["items"] == 202 and res["messages"] == (0 if ctx.same_host else 3)
    back = await ctx.read_batch(bid, [(o, a.nbytes) for o, a in items] + [(0, 0)])
    for (_, a), b in zip(items, back, strict=False):
        np.testing.assert_array_equal(a, b)
    assert back[-1].nbytes == 0
    await ctx.store_batch(bid, [])  # an empty batch is fine
    assert await ctx.read_batch(bid, []) == []
    bad_batches = [
        [(0, np.zeros(10, np.uint8)), (5, np.zeros(10, np.uint8))],  # overlap
        [((1 << 20) - 4, np.zeros(10, np.uint8))],  # past the end
    ]
    errors = [rpcbuf.BadRequest, rpcbuf.OutOfRange]
    for batch, err in zip(bad_batches, errors, strict=True):
        with pytest.raises(err):
            await ctx.store_batch(bid, batch)
    with pytest.raises(rpcbuf.BadRequest):
        await ctx.store_batch(bid, [(-1, np.zeros(1))])
    with pytest.raises(rpcbuf.OutOfRange):
        await ctx.read_batch(bid, [(0, 10), ((1 << 20) - 1, 2)])
    with pytest.raises(rpcbuf.BadRequest):
        await ctx.read_batch(bid, [(0, "x")])  # type: ignore[list-item]
    # nothing of the refused batches landed
    back = await ctx.read_batch(bid, [(0, 4096)])
    assert (back[0] == 0).all()
    await ctx.release_buffer(bid)


async def test_clear_and_copy(ctx: rpcbuf.RpcContext) -> None:
    a = await ctx.request_buffer(1 << 20)
    b = await ctx.request_buffer(1 << 20)
    data = np.random.default_rng(1).integers(0, 255, 1 << 20, dtype=np.uint8)
    await ctx.store_tensor(a, data)
    await ctx.clear_buffer(b, value=7)
    assert (await ctx.read_buffer(b) == 7).all()
    await ctx.copy_buffer(a, 100, b, 5000, 50_000)
    out = await ctx.read_buffer(b)
    np.testing.assert_array_equal(out[5000:55000], data[100:50100])
    assert (out[:5000] == 7).all() and (out[55000:] == 7).all()
    await ctx.copy_buffer(a, 0, a, 10, 1000)  # overlapping, within one buffer
    np.testing.assert_array_equal((await ctx.read_buffer(a, 10, 1000)), data[:1000])
    await ctx.clear_buffer(a, 0, offset=10, nbytes=5)
    assert (await ctx.read_buffer(a, 10, 5) == 0).all()
    for call in (ctx.clear_buffer(a, 256), ctx.clear_buffer(a, -1)):
        with pytest.raises(rpcbuf.BadRequest):
            await call
    for call in (ctx.clear_buffer(a, 0, offset=(1 << 20) + 1),
                 ctx.copy_buffer(a, 0, b, 1, 1 << 20),
                 ctx.copy_buffer(a, 1 << 20, b, 0, 1)):
        with pytest.raises(rpcbuf.OutOfRange):
            await call
    with pytest.raises(rpcbuf.NotFound):
        await ctx.copy_buffer(a, 0, "b-gone", 0, 1)
    await ctx.release_buffer(a)
    await ctx.release_buffer(b)


async def test_copy_across_tenants_is_not_found(clean_pool) -> None:  # type: ignore[no-untyped-def]
    async with clean_pool.connect("alice") as alice, clean_pool.connect("bob") as bob:
        secret = await alice.request_buffer(4096)
        mine = await bob.request_buffer(4096)
        with pytest.raises(rpcbuf.NotFound):
            await bob.copy_buffer(secret, 0, mine, 0, 4096)
        with pytest.raises(rpcbuf.NotFound):
            await bob.clear_buffer(secret)
        await asyncio.gather(alice.release_buffer(secret), bob.release_buffer(mine))


async def test_stale_manifest_cache_is_refused_and_replanned(clean_pool) -> None:  # type: ignore[no-untyped-def]
    async with clean_pool.connect("alice") as a, clean_pool.connect("alice") as b:
        bid = await a.request_buffer(1 << 16, name="shared/manifest")
        await a.store_tensors(bid, {"a": np.full(1000, 1, np.uint8)})  # a caches the manifest
        await b.store_tensors(bid, {"b": np.full(1000, 2, np.uint8)})  # appended after a
        await a.store_tensors(bid, {"c": np.full(1000, 3, np.uint8)})  # a's copy is stale
        man = (await b.get_buffer_meta(bid))["tensors"]
        spans = sorted((e["offset"], e["offset"] + e["nbytes"]) for e in man.values())
        assert set(man) == {"a", "b", "c"}
        assert all(x[1] <= y[0] for x, y in itertools.pairwise(spans)), "slots overlap"
        got = await a.load_tensors(bid)
        assert [int(got[k][0]) for k in "abc"] == [1, 2, 3]
        meta = await a.get_buffer_meta(bid, tensors=False)
        assert meta["tensors"] is None and meta["tensor_count"] == 3
        assert meta["manifest_version"] == 3 and meta["tensors_end"] == spans[-1][1] + 24
        await a.release_buffer(bid)
