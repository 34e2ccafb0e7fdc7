"""Big tensor batches: packed manifests through a daemon, the client's layouts,
spans and views, same-host copies that report what has landed, and array
addresses gathered at once.  The manifest model itself: tests/wire/test_manifest.py."""

from __future__ import annotations

import mmap
import threading
import time

import numpy as np
import pytest
import xxhash

import rpcbuf
from rpcbuf.control.client.tensors import (
    ManifestTable,
    Packed,
    bulk_views,
    plan_layout,
    plan_offsets,
    plan_spans,
)
from rpcbuf.control.wire import protocol as P
from rpcbuf.dataplane import staging

# -- through a daemon -------------------------------------------------------------------------


@pytest.mark.both_paths
async def test_bad_packed_manifests_are_refused_before_any_byte_lands(
        ctx: rpcbuf.RpcContext) -> None:
    bid = await ctx.request_buffer(1 << 16)
    await ctx.clear_buffer(bid, 7)
    items = [(0, np.ones(4, np.float32)), (64, np.ones(8, np.int16))]
    bad = [
        Packed(["a", "b"], np.array([0, 5]), ["<f4", "<i2"], [(4,), (8,)]),  # kind 5
        Packed(["a", "b"], np.array([0, 1]), ["<f4", "<i2"], [(4,), (9,)]),  # 18 != 16
        Packed(["a", "a"], np.array([0, 1]), ["<f4", "<i2"], [(4,), (8,)]),  # twice
        Packed(["a", "b"], np.array([0, 1]), ["<f4", "|O"], [(4,), (8,)]),  # objects
    ]
    for packed in bad:
        with pytest.raises(rpcbuf.BadRequest):
            await ctx.store_batch(bid, items, manifest=packed)
    with pytest.raises(rpcbuf.BadRequest):  # a manifest that does not match the items
        await ctx.store_batch(bid, items, manifest=(["a"], ["<f4"], [[4]]))
    meta = await ctx.get_buffer_meta(bid)
    assert meta["tensors"] == {} and meta["manifest_version"] == 0
    assert (await ctx.read_buffer(bid) == 7).all()  # nothing landed
    ok = Packed(["a", "b"], np.array([0, 1]), ["<f4", "<i2"], [(4,), (8,)])
    res = await ctx.store_batch(bid, items, manifest=ok)
    assert P.unpack_u64(res["checksums"]).tolist() == [xxhash.xxh3_64_intdigest(a)
                                                       for _, a in items]
    man = (await ctx.get_buffer_meta(bid))["tensors"]
    assert man["b"] == {"dtype": "<i2", "shape": [8], "offset": 64, "nbytes": 16,
                        "checksum": xxhash.xxh3_64_intdigest(items[1][1])}
    await ctx.release_buffer(bid)


@pytest.mark.both_paths
async def test_store_batch_answers_checksums_in_the_callers_order(
        ctx: rpcbuf.RpcContext) -> None:
    bid = await ctx.request_buffer(1 << 16)
    arrays = [np.full(16, i, np.uint8) for i in range(5)]
    items = [(4096 - 1024 * i, a) for i, a in enumerate(arrays)]  # descending offsets
    names = [f"t{i}" for i in range(5)]
    res = await ctx.store_batch(bid, items, verify="checksum",
                                manifest=(names, ["|u1"] * 5, [[16]] * 5))
    assert P.unpack_u64(res["checksums"]).tolist() == [xxhash.xxh3_64_intdigest(a)
                                                       for a in arrays]
    man = (await ctx.get_buffer_meta(bid))["tensors"]
    assert [man[n]["offset"] for n in names] == [o for o, _ in items]
    assert await ctx.load_tensors(bid)  # every checksum matches its own tensor
    await ctx.release_buffer(bid)


@pytest.mark.both_paths
async def test_store_batch_takes_the_callers_checksums_and_still_verifies_them(
        ctx: rpcbuf.RpcContext) -> None:
    """Checksums the caller computed already are sent as they are (in the
    caller's order, whatever the offsets); the daemon compares them with what
    it received, so a wrong one fails the batch and records nothing."""
    bid = await ctx.request_buffer(1 << 16)
    arrays = [np.full(300, i, np.uint8) for i in range(3)]
    items = [(2048 - 1024 * i, a) for i, a in enumerate(arrays)]  # descending offsets
    sums = [xxhash.xxh3_64_intdigest(a) for a in arrays]
    names = (["a", "b", "c"], ["|u1"] * 3, [[300]] * 3)
    res = await ctx.store_batch(bid, items, verify="checksum", manifest=names, checksums=sums)
    assert P.unpack_u64(res["checksums"]).tolist() == sums
    with pytest.raises(rpcbuf.VerifyFailed):
        await ctx.store_batch(bid, items, verify="checksum", manifest=(["x", "y", "z"],
                                                                       *names[1:]),
                              checksums=[sums[0], sums[2], sums[1]])
    assert set((await ctx.get_buffer_meta(bid))["tensors"]) == {"a", "b", "c"}
    for bad in ([1, 2], [-1, 2, 3], ["x", 1, 2]):
        with pytest.raises(rpcbuf.BadRequest):
            await ctx.store_batch(bid, items, verify="checksum", checksums=bad)  # type: ignore[arg-type]
    await ctx.release_buffer(bid)


@pytest.mark.both_paths
async def test_store_tensors_new_names_before_kept_slots_verify_on_load(
        ctx: rpcbuf.RpcContext) -> None:
    bid = await ctx.request_buffer(1 << 16)
    await ctx.store_tensors(bid, {"old": np.arange(64, dtype=np.int32)})
    # "new" comes first but gets a slot after "old", which keeps its own
    written = await ctx.store_tensors(bid, {"new": np.ones(8, np.float64),
                                            "old": np.arange(64, dtype=np.int32) * 2})
    assert written["old"]["offset"] == 0 and written["new"]["offset"] == 256
    got = await ctx.load_tensors(bid)  # verified against the cached manifest
    assert (got["old"] == np.arange(64) * 2).all() and (got["new"] == 1).all()
    assert dict(written) == {n: (await ctx.get_buffer_meta(bid))["tensors"][n] for n in written}
    assert dict(await ctx.store_tensors(bid, {})) == {}  # nothing to store: nothing changes
    assert set(await ctx.load_tensors(bid)) == {"old", "new"}
    assert await ctx.load_tensors(bid, names=[]) == {}
    await ctx.release_buffer(bid)


@pytest.mark.both_paths
async def test_thousands_of_tensors_of_many_kinds_round_trip(ctx: rpcbuf.RpcContext) -> None:
    rng = np.random.default_rng(5)
    kinds = [((4, 8), np.float32), ((16,), np.float16), ((), np.int64), ((3, 0), np.float32),
             ((7,), np.uint8), ((2, 3, 5), np.int16)]
    tensors = {}
    for i in range(3000):
        shape, dt = kinds[i % 7 % len(kinds)]
        tensors[f"layers.{i}.w"] = (rng.standard_normal(shape) * 100).astype(dt)
    tensors["big"] = rng.standard_normal(300_000).astype(np.float32)  # its own span
    bid = await ctx.request_buffer(rpcbuf.calculate_buffer_size(tensors) + (8 << 20))
    written = await ctx.store_tensors(bid, tensors)
    assert len(written) == len(tensors)
    for attempt in range(2):  # from the cache, then as another client would
        if attempt:
            ctx._tensors.manifests.clear()
        back = await ctx.load_tensors(bid)
        assert list(back) == list(tensors)
        for name, a in tensors.items():
            b = back[name]
            assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b), name
        some = ["layers.2999.w", "big", "layers.5.w", "layers.5.w"]
        part = await ctx.load_tensors(bid, names=some)
        assert list(part) == ["layers.2999.w", "big", "layers.5.w"]
        assert np.array_equal(part["big"], tensors["big"])
    # overwrite in place: same slots, new bytes, new checksums
    again = {n: a + 1 if a.dtype != np.uint8 else a ^ 1 for n, a in tensors.items()}
    rewritten = await ctx.store_tensors(bid, again)
    assert [e["offset"] for e in rewritten.values()] == [e["offset"] for e in written.values()]
    back = await ctx.load_tensors(bid)
    assert all(np.array_equal(back[n], a) for n, a in again.items())
    await ctx.release_buffer(bid)


@pytest.mark.both_paths
async def test_read_batch_spans_overlaps_duplicates_and_empty_ranges(
        ctx: rpcbuf.RpcContext) -> None:
    bid = await ctx.request_buffer(1 << 20)
    data = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
    await ctx.store_tensor(bid, data)
    ranges = [(900_000, 100), (0, 4096), (10, 20), (4096, 4096), (0, 0), (500_000, 70_000),
              (10, 20), ((1 << 20) - 1, 1), (1 << 20, 0), (4000, 200), (300_001, 3)]
    back = await ctx.read_batch(bid, ranges)
    assert len(back) == len(ranges)
    for (off, n), b in zip(ranges, back, strict=True):
        assert b.dtype == np.uint8 and b.shape == (n,)
        assert np.array_equal(b, data[off:off + n]), (off, n)
    with pytest.raises(rpcbuf.OutOfRange):
        await ctx.read_batch(bid, [(0, 4), ((1 << 20) + 1, 0)])
    await ctx.release_buffer(bid)


# -- client columns ------------------------------------------------------------------------


def test_plan_offsets_matches_plan_layout() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(0, 30))
        sizes = rng.integers(0, 2000, n)
        names = [f"t{int(i)}" for i in rng.choice(60, n, replace=False)]
        existing = {f"t{i}": {"offset": int(rng.integers(0, 100)) * 256,
                              "nbytes": int(rng.integers(0, 2000)) if i % 3 else int(sizes[0])
                              if n else 1}
                    for i in range(0, 60, 2)}
        arrays = {nm: np.zeros(int(s), np.uint8) for nm, s in zip(names, sizes, strict=True)}
        start = None if rng.random() < 0.7 else int(rng.integers(0, 5000))
        want = plan_layout(arrays, existing, start)
        got = plan_offsets(names, sizes, existing, start)
        assert dict(zip(names, got.tolist(), strict=True)) == want
        table = ManifestTable.of_entries({k: {**v, "dtype": "|u1", "shape": [v["nbytes"]]}
                                          for k, v in existing.items()})
        assert plan_offsets(names, sizes, table, start).tolist() == got.tolist()


def test_spans_and_bulk_views() -> None:
    rng = np.random.default_rng(4)
    mem = rng.integers(0, 256, 1 << 16, dtype=np.uint8)
    for _ in range(30):
        n = int(rng.integers(1, 40))
        offs = np.sort(rng.integers(0, 60_000, n)).astype(np.int64)
        sizes = rng.choice([0, 4, 8, 12, 4096], n).astype(np.int64)
        if rng.random() < 0.5:  # an evenly strided run of one kind
            offs = np.arange(n, dtype=np.int64) * 16
            sizes = np.full(n, 8, np.int64)
        starts, lengths, span_of = plan_spans(offs, sizes, gap=int(rng.choice([0, 64, 4096])))
        assert (starts[span_of] <= offs).all()
        assert (offs + sizes <= starts[span_of] + lengths[span_of]).all()
        blocks = [mem[s:s + ln].copy() for s, ln in zip(starts, lengths, strict=True)]
        kinds = (sizes // 4).astype(np.intp)
        dtypes = [np.dtype("<f4")] * 1025
        shapes = [(k,) for k in range(1025)]
        views = bulk_views(blocks, span_of, offs - starts[span_of], kinds, dtypes, shapes)
        for o, s, v in zip(offs.tolist(), sizes.tolist(), views, strict=True):
            assert v.dtype == np.float32 and v.shape == (s // 4,) and v.flags.c_contiguous
            assert v.tobytes() == mem[o:o + s].tobytes()


# -- the staging ring on its own (two threads of this process, one area) ---------------


def _area() -> tuple[staging.Area, mmap.mmap]:
    mem = mmap.mmap(-1, staging.SIZE)
    return staging.Area(mem, np.frombuffer(mem, np.uint8, count=1).ctypes.data), mem


@pytest.mark.parametrize("pieces", [[1], [staging.RING_CHUNK], [0, 3, 0],
                                    [staging.RING_CHUNK * staging.RING_SLOTS * 3 + 17],
                                    [70_000] * 150 + [0, 1, 5_000_000]])
def test_the_ring_carries_every_byte_in_order_and_says_what_landed(pieces: list[int]) -> None:
    rng = np.random.default_rng(len(pieces))
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in pieces]
    dst = [np.zeros(n, np.uint8) for n in pieces]
    area, _ = _area()
    area.reset()
    done: list[int] = []

    def landed(i: int) -> None:  # pieces [0, i) complete, told in order
        assert not done or i >= done[-1]
        for k in range(i):
            assert np.array_equal(dst[k], src[k]), "reported before it landed"
        done.append(i)

    deadline = time.monotonic() + 30
    producer = threading.Thread(target=area.pump, args=(src, True, lambda: False, deadline))
    producer.start()
    area.pump(dst, False, lambda: False, deadline, landed)
    producer.join(10)
    assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))
    assert not done or done[-1] == len(pieces) or sum(pieces) == 0


def test_a_ring_whose_other_side_stops_gives_up_at_the_deadline_or_when_told() -> None:
    area, _ = _area()
    area.reset()
    t0 = time.monotonic()
    with pytest.raises(staging.Stopped):
        area.pump([np.zeros(3 * staging.RING_CHUNK, np.uint8)], False, lambda: False,
                  time.monotonic() + 0.2)
    assert 0.15 < time.monotonic() - t0 < 2
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    with pytest.raises(staging.Stopped):
        area.pump([np.zeros((staging.RING_SLOTS + 1) * staging.RING_CHUNK, np.uint8)], True,
                  stop.is_set, time.monotonic() + 30)  # fills the ring, then waits
