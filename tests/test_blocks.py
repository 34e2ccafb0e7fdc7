"""The keyed block tier against real daemons, on both data paths where the
path matters: put/get/lookup/list/remove, LRU eviction under a small
quota, TTL expiry, tenant isolation, bad input, a reader-pinned block that
eviction passes by, and a put whose bytes never arrive (never visible)."""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc, metrics_url, pool_free, wait_free
from rpcbuf.control.client.blockops import HOST, _transfer
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.runs import run_tag
from rpcbuf.dataplane import progress
from rpcbuf.dataplane.checksum import checksum

MiB = 1 << 20


@pytest.fixture(scope="module")
def tier(daemon_factory) -> DaemonProc:  # type: ignore[no-untyped-def]
    """A daemon whose tenant "small" has 24 MiB (room for a few 4 MiB blocks
    beside a same-host staging area) and metrics on."""
    return daemon_factory("--device", "cpu:256MiB", "--quota", "small:24MiB:1000",  # type: ignore[no-any-return]
                          "--transfer-timeout", "30s", "--metrics", "127.0.0.1:0",
                          "--metrics-tenants")


def _blocks(n: int, size: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"chunk/{seed}/{i}": rng.integers(0, 255, size, dtype=np.uint8) for i in range(n)}


@pytest.mark.both_paths
async def test_typed_and_strided_arrays_are_their_bytes(tier: DaemonProc) -> None:
    """A block is its array's bytes whatever the dtype (the arrays go as
    they are, no uint8 view made), a strided one copied once; a read fills
    typed arrays the same way."""
    f = np.linspace(-1, 1, 1000, dtype=np.float32)
    grid = np.arange(64, dtype=np.int64).reshape(8, 8)
    async with tier.connect("alice") as c:
        await c.put_block("typed/f", f)  # as it is
        await c.put_blocks({"typed/cols": grid[:, ::2]})  # copied once
        out = [np.zeros(1000, np.float32), np.zeros((8, 4), np.int64)]
        assert await c.get_blocks(["typed/f", "typed/cols"], out) == [True, True]
        np.testing.assert_array_equal(out[0], f)
        np.testing.assert_array_equal(out[1], grid[:, ::2])
        raw = await c.get_block("typed/f")
        assert raw is not None and np.array_equal(raw.view(np.float32), f)
        with pytest.raises(rpcbuf.BadRequest, match="writable"):
            await c.get_blocks(["typed/f"], [_read_only(1000)])
        assert await c.remove_blocks(["typed/f", "typed/cols"]) == 2


def _read_only(n: int) -> np.ndarray:
    a = np.zeros(n, np.float32)
    a.flags.writeable = False
    return a


@pytest.mark.both_paths
async def test_put_get_lookup_list_remove(tier: DaemonProc, caplog: pytest.LogCaptureFixture
                                          ) -> None:
    start = await pool_free(tier)
    blocks = {**_blocks(3, 256 << 10, 1), **_blocks(2, 4 * MiB, 2),
              "tiny": np.arange(7, dtype=np.uint8)}
    keys = list(blocks)
    async with tier.connect("alice") as c:
        answer = await c.put_blocks(blocks, metas=[k.encode() for k in keys])
        assert answer == {"blocks": len(keys), "nbytes": sum(a.nbytes for a in blocks.values())}
        info = await c.lookup_blocks([*keys, "absent"], meta=True)
        sizes = [a.nbytes for a in blocks.values()]
        assert [i["nbytes"] if i else None for i in info] == [*sizes, None]
        assert [i["meta"] for i in info[:-1]] == [k.encode() for k in keys]
        out = [np.zeros_like(a) for a in blocks.values()]
        assert await c.get_blocks(keys, out) == [True] * len(keys)
        for got, want in zip(out, blocks.values(), strict=True):
            np.testing.assert_array_equal(got, want)  # read straight into the caller's arrays
        # A miss among hits: the hits are read, the miss says so.
        other = [np.zeros(256 << 10, np.uint8), np.zeros(10, np.uint8)]
        assert await c.get_blocks([keys[0], "absent"], other) == [True, False]
        np.testing.assert_array_equal(other[0], blocks[keys[0]])
        # A size other than the block's counts as missing, and says why: a
        # debug line, or with strict=True BAD_REQUEST naming both sizes (a
        # sizing bug otherwise looks like a cold cache for ever).
        with caplog.at_level(logging.DEBUG, logger="rpcbuf.client"):
            assert await c.get_blocks([keys[0]], [np.zeros(100, np.uint8)]) == [False]
        assert f"block {keys[0]!r} is {256 << 10} bytes, its array 100" in caplog.text
        with pytest.raises(rpcbuf.BadRequest, match="is 262144 bytes here; the array") as info:
            await c.get_blocks(["absent", keys[0]], [np.zeros(5, np.uint8),
                                                     np.zeros(100, np.uint8)], strict=True)
        assert info.value.details == {"key": keys[0], "nbytes": 256 << 10,
                                      "array_nbytes": 100, "reason": "size_mismatch"}
        assert await c.get_blocks(["absent"], [np.zeros(5, np.uint8)], strict=True) == [False]
        one = await c.get_block("tiny")
        assert one is not None and one.tolist() == list(range(7))
        assert await c.list_blocks(prefix="chunk/1/") == ([f"chunk/1/{i}" for i in range(3)], False)
        assert await c.list_blocks(prefix="chunk/", limit=2) == (["chunk/1/0", "chunk/1/1"], True)
        assert (await c.list_blocks(start_after="chunk/2/1"))[0] == ["tiny"]
        assert await c.list_buffers() == []  # blocks are not buffers to list
        # A put over an existing key replaces it.
        await c.put_block("tiny", np.full(3, 9, np.uint8))
        assert (await c.get_block("tiny")).tolist() == [9, 9, 9]  # type: ignore[union-attr]
        st = (await c.stats())["blocks"]
        assert st["blocks"] == len(keys) and st["hits"] >= len(keys) + 3 and st["misses"] >= 2
        assert await c.remove_blocks([*keys, "absent"]) == len(keys)
        assert await c.blocks_exist(keys) == [False] * len(keys)
    assert await wait_free(tier, start) == start, "block memory leaked"


@pytest.mark.both_paths
async def test_full_tier_evicts_least_recently_used(tier: DaemonProc) -> None:
    start = await pool_free(tier)
    blocks = _blocks(12, 4 * MiB, 3)
    keys = list(blocks)
    async with tier.connect("small") as c:
        before = (await c.stats())["blocks"]  # counters are the tenant's, since the start
        for i, key in enumerate(keys):
            await c.put_block(key, blocks[key])
            if i >= 1:
                await c.lookup_blocks([keys[0]])  # the first stays in use: most recent
        st = (await c.stats())["blocks"]
        evicted = st["evictions"] - before["evictions"]
        assert evicted > 0, st
        assert st["blocks"] + evicted == len(keys)
        assert st["bytes"] <= 24 * MiB
        present = await c.blocks_exist(keys)
        assert present[0] and present[-1]  # the one in use and the newest stayed
        assert present[1:-1] == sorted(present[1:-1])  # only the oldest went
        out = np.empty(4 * MiB, np.uint8)
        assert await c.get_blocks([keys[-1]], [out]) == [True]
        np.testing.assert_array_equal(out, blocks[keys[-1]])
        # More than the whole quota at once: refused before anything is evicted.
        with pytest.raises(rpcbuf.QuotaExceeded):
            await c.put_blocks(_blocks(7, 4 * MiB, 4))
        assert (await c.stats())["blocks"]["blocks"] == st["blocks"]
        await c.remove_blocks(keys)
    text = _metrics(tier)
    assert 'rpcbuf_block_evictions_total{tenant="small"}' in text
    assert await wait_free(tier, start) == start


def _metrics(d: DaemonProc) -> str:
    import urllib.request
    with urllib.request.urlopen(metrics_url(d), timeout=10) as res:
        return res.read().decode()


async def test_ttl_expiry(tier: DaemonProc) -> None:
    start = await pool_free(tier)
    async with tier.connect("ttl") as c:
        await c.put_blocks({"short": np.ones(MiB, np.uint8)}, ttl=0.3)
        await c.put_blocks({"long": np.ones(MiB, np.uint8)})
        assert (await c.lookup_blocks(["short"], meta=True))[0]["expires_at"] is not None  # type: ignore[index]
        await asyncio.sleep(1.0)
        st = (await c.stats())["blocks"]  # expired by the daemon's timer, not by a look
        assert st["expired"] == 1 and st["blocks"] == 1, st
        assert await c.blocks_exist(["short", "long"]) == [False, True]
        with pytest.raises(rpcbuf.BadRequest, match="ttl"):
            await c.put_blocks({"x": np.ones(4, np.uint8)}, ttl=0)
        await c.remove_blocks(["long"])
    assert await wait_free(tier, start) == start


@pytest.mark.both_paths
async def test_tenants_never_see_each_others_keys(tier: DaemonProc) -> None:
    a_data, b_data = np.full(MiB, 1, np.uint8), np.full(MiB, 2, np.uint8)
    async with tier.connect("alice") as a, tier.connect("bob") as b:
        await a.put_blocks({"shared/key": a_data})
        assert await b.blocks_exist(["shared/key"]) == [False]
        assert await b.get_blocks(["shared/key"], [np.zeros(MiB, np.uint8)]) == [False]
        assert await b.list_blocks() == ([], False)
        assert await b.remove_blocks(["shared/key"]) == 0
        await b.put_blocks({"shared/key": b_data})  # the same key, bob's own block
        out = np.zeros(MiB, np.uint8)
        assert await a.get_blocks(["shared/key"], [out]) == [True]
        np.testing.assert_array_equal(out, a_data)
        assert await b.get_blocks(["shared/key"], [out]) == [True]
        np.testing.assert_array_equal(out, b_data)
        assert (await b.stats())["blocks"]["blocks"] == 1
        await a.remove_blocks(["shared/key"])
        assert await b.blocks_exist(["shared/key"]) == [True]
        await b.remove_blocks(["shared/key"])


async def _raw(c: rpcbuf.RpcContext, msg: dict[str, Any]) -> dict[str, Any]:
    """A request as a client that skips the API's checks would send it."""
    class Raw(P.Request):
        op = msg["op"]

        def to_wire(self, req_id: int) -> dict[str, Any]:
            return {**msg, "id": req_id}
    return await c._call(Raw())


@pytest.mark.parametrize("msg", [
    {"op": "block_lookup", "keys": "k"},
    {"op": "block_lookup", "keys": []},
    {"op": "block_lookup", "keys": [1, 2]},
    {"op": "block_lookup", "keys": ["x" * (P.MAX_BLOCK_KEY + 1)]},
    {"op": "block_lookup", "keys": ["k"] * (P.MAX_BLOCK_KEYS + 1)},
    {"op": "block_lookup", "keys": ["bad\nkey"]},
    {"op": "block_remove", "keys": None},
    {"op": "block_list", "limit": 0},
    {"op": "block_list", "limit": P.MAX_BLOCK_KEYS + 1},
    {"op": "block_list", "prefix": 5},
    {"op": "block_get", "keys": ["k"], "sizes": P.pack_u64([1, 2])},
    {"op": "block_get", "keys": ["k"], "sizes": b"123"},
    {"op": "block_put", "keys": ["k"], "sizes": P.pack_u64([4]), "checksums": P.pack_u64([0]),
     "metas": [b"x" * (P.MAX_STR + 1)]},
    {"op": "block_put", "keys": ["k"], "sizes": P.pack_u64([4]), "checksums": P.pack_u64([0]),
     "ttl": -1},
    {"op": "block_put", "keys": ["k"], "sizes": 4, "checksums": P.pack_u64([0])},
    # bytes in the frame: not as many as the sizes say, more than a frame may
    # carry, both a frame and a staging slot
    {"op": "block_put", "keys": ["k"], "sizes": P.pack_u64([4]), "checksums": P.pack_u64([0]),
     "data": b"abc", "path": "inline"},
    {"op": "block_put", "keys": ["k"], "sizes": P.pack_u64([P.INLINE_MAX + 1]),
     "checksums": P.pack_u64([0]), "data": b"x" * (P.INLINE_MAX + 1), "path": "inline"},
    {"op": "block_put", "keys": ["k"], "sizes": P.pack_u64([4]), "checksums": P.pack_u64([0]),
     "data": b"abcd", "stage": 0, "path": "inline"},
])
async def test_bad_requests_are_refused_and_leave_no_trace(tier: DaemonProc,
                                                           msg: dict[str, Any]) -> None:
    start = await pool_free(tier)
    async with tier.connect("mallory", same_host=False) as c:
        with pytest.raises((rpcbuf.BadRequest, rpcbuf.UnsupportedDevice)):
            await _raw(c, msg)
        assert await c.ping() > 0  # the session serves on
        assert await c.list_blocks() == ([], False)
        assert (await c.stats())["blocks"]["blocks"] == 0
    assert await wait_free(tier, start) == start


@pytest.mark.both_paths
@pytest.mark.parametrize("fields", [
    {"checksums": P.pack_u64([])},  # too few checksums
    {"keys": ["k", "k"], "sizes": P.pack_u64([4, 4]), "checksums": P.pack_u64([0, 0])},
    {"sizes": P.pack_u64([0])},  # an empty block
    {"metas": [b"a", b"b"]},  # more metas than blocks
    {"ttl": 0.0},
    {"device_type": "GPU", "device": 7},
])
async def test_refused_puts_drain_and_store_nothing(tier: DaemonProc,
                                                    fields: dict[str, Any]) -> None:
    """Refused by the daemon after parsing: what the client sent is drained
    (the session serves on), nothing is allocated, nothing evicted."""
    start = await pool_free(tier)
    data = np.ones(4, np.uint8)
    fields = {"keys": ["k"], "sizes": P.pack_u64([4]), "checksums": P.pack_u64([checksum(data)]),
              **fields}
    arrays = [data] * len(fields["keys"]) if P.unpack_u64(fields["sizes"]).all() else \
        [np.ones(0, np.uint8)]
    async with tier.connect("mallory") as c:
        with pytest.raises((rpcbuf.BadRequest, rpcbuf.UnsupportedDevice)):
            await c._paths.run("", HOST, _transfer(P.BlockPut(**fields), arrays))
        assert await c.ping() > 0
        assert await c.list_blocks() == ([], False)
    assert await wait_free(tier, start) == start


async def test_client_checks(tier: DaemonProc) -> None:
    async with tier.connect("alice") as c:
        with pytest.raises(rpcbuf.BadRequest, match="sequence"):
            await c.lookup_blocks("abc")
        with pytest.raises(rpcbuf.BadRequest, match="printable"):
            await c.put_blocks({"x" * 600: np.ones(4, np.uint8)})
        with pytest.raises(rpcbuf.BadRequest, match="once"):
            await c.put_blocks([("a", np.ones(4, np.uint8)), ("a", np.ones(4, np.uint8))])
        with pytest.raises(rpcbuf.BadRequest, match="one byte"):
            await c.put_blocks({"a": np.ones(0, np.uint8)})
        with pytest.raises(rpcbuf.BadRequest, match="writable"):
            await c.get_blocks(["a"], [np.frombuffer(b"abcd", np.uint8)])
        with pytest.raises(rpcbuf.BadRequest):
            await c.get_blocks(["a", "b"], [np.ones(4, np.uint8)])


@pytest.mark.both_paths
async def test_wrong_checksum_stores_nothing(tier: DaemonProc) -> None:
    start = await pool_free(tier)
    data = np.arange(MiB, dtype=np.uint32).view(np.uint8)[: 2 * MiB]
    async with tier.connect("alice") as c:
        await c.put_blocks({"k": np.full(16, 5, np.uint8)})
        req = P.BlockPut(keys=["k", "j"], sizes=P.pack_u64([data.nbytes, 16]),
                         checksums=P.pack_u64([checksum(data) ^ 1, checksum(data[:16])]))
        with pytest.raises(rpcbuf.VerifyFailed):
            await c._paths.run("", HOST, _transfer(req, [data, data[:16]]))
        assert await c.blocks_exist(["k", "j"]) == [True, False]  # the old block stays
        assert (await c.get_block("k")).tolist() == [5] * 16  # type: ignore[union-attr]
        await c.remove_blocks(["k"])
    assert await wait_free(tier, start) == start


async def _stuck_get(c: rpcbuf.RpcContext, key: str, nbytes: int) -> None:
    """A block_get over UCX whose reader never posts its receive: the
    daemon's send stays in flight (the block pinned) until the session goes."""
    await c._paths.ucx.endpoint()
    conn = c._conn
    fut = conn.submit(conn.next_id(), P.BlockGet(keys=[key], sizes=P.pack_u64([nbytes])))
    answer = await asyncio.wait_for(fut, 10)
    assert answer.get("ok"), answer


async def test_a_block_being_read_is_not_evicted(tier: DaemonProc) -> None:
    start = await pool_free(tier)
    blocks = _blocks(9, 4 * MiB, 5)
    keys = list(blocks)
    async with tier.connect("small", same_host=False) as c:
        await c.put_blocks({k: blocks[k] for k in keys[:4]})
        reader = await tier.connect("small", same_host=False)
        try:
            await _stuck_get(reader, keys[0], 4 * MiB)
            await c.lookup_blocks(keys[1:4])  # keys[0] is the least recently used now
            for k in keys[4:]:
                await c.put_block(k, blocks[k])
            present = await c.blocks_exist(keys)
            assert present[0], "the block being read was evicted"
            assert present[1:4] == [False] * 3 and present[-1]
            # Nothing left to evict but the pinned block: a put that needs its room fails.
            with pytest.raises(rpcbuf.QuotaExceeded):
                await c.put_blocks(_blocks(6, 4 * MiB, 6))
        finally:
            reader.abort()
            await reader.close()
        await asyncio.sleep(0.2)
        await c.put_blocks(_blocks(6, 4 * MiB, 6))  # its reader gone: it may go now
        assert (await c.blocks_exist(keys[:1])) == [False]
        await c.remove_blocks(list(_blocks(6, 4 * MiB, 6)) + keys)
    assert await wait_free(tier, start) == start


async def test_a_put_whose_bytes_never_arrive_is_never_visible(tier: DaemonProc) -> None:
    start = await pool_free(tier)
    old = np.full(4 * MiB, 3, np.uint8)
    async with tier.connect("alice") as c:
        await c.put_blocks({"half": old})
        writer = await tier.connect("alice", same_host=False)
        try:
            await writer._paths.ucx.endpoint()
            new = np.full(4 * MiB, 4, np.uint8)
            conn = writer._conn
            fut = conn.submit(conn.next_id(), P.BlockPut(
                keys=["half", "fresh"], sizes=P.pack_u64([new.nbytes, 16]),
                checksums=P.pack_u64([checksum(new), checksum(new[:16])])))
            for _ in range(100):  # the daemon holds the two pending blocks, waiting for bytes
                if (await c.stats())["limits"]["buffers"]["held"] == 3:
                    break
                await asyncio.sleep(0.05)
            assert (await c.stats())["limits"]["buffers"]["held"] == 3
            assert await c.blocks_exist(["half", "fresh"]) == [True, False]
            out = np.empty(4 * MiB, np.uint8)
            assert await c.get_blocks(["half"], [out]) == [True]
            np.testing.assert_array_equal(out, old)
            assert await c.list_blocks() == (["half"], False)
            assert not fut.done()
        finally:
            writer.abort()
            await writer.close()
        await asyncio.sleep(0.3)
        assert await c.blocks_exist(["half", "fresh"]) == [True, False]
        assert (await c.get_block("half")).tolist()[:4] == [3] * 4  # type: ignore[union-attr]
        await c.remove_blocks(["half"])
    assert await wait_free(tier, start) == start


async def test_cli_shows_the_tier(tier: DaemonProc) -> None:
    from test_cli import as_json, rpcbuf as cli

    async with tier.connect("clitier") as c:
        await c.put_blocks({"vllm@a": np.ones(4096, np.uint8), "vllm@b": np.ones(10, np.uint8),
                            "other": np.ones(1, np.uint8)})
        await c.get_blocks(["vllm@a", "nope"], [np.empty(4096, np.uint8), np.empty(1, np.uint8)])
        (st,) = as_json(cli(tier, "blocks", "--json", "--prefix", "vllm@",
                            tenant="clitier")).values()
        assert st["blocks"] == 3 and st["bytes"] == 4107 and st["keys"] == ["vllm@a", "vllm@b"]
        assert st["hits"] == 1 and st["misses"] == 1 and st["more"] is False
        table = cli(tier, "blocks", "--keys", tenant="clitier")
        assert table.returncode == 0, table.stderr
        assert "rpcbuf blocks" in table.stdout and "vllm@b" in table.stdout
        assert "50.0%" in table.stdout  # the hit rate
        await c.remove_blocks(["vllm@a", "vllm@b", "other"])


async def test_a_same_host_hit_is_served_in_place(tier: DaemonProc) -> None:
    start = await pool_free(tier)
    data = np.random.default_rng(9).integers(0, 255, 2 * MiB, dtype=np.uint8)
    async with tier.connect("inplace", same_host=True) as c:
        assert c.same_host
        await c.put_blocks({"kv/0": data, "kv/1": data[:100]})
        async with c.attach_block("kv/0") as view:
            assert view.size == data.nbytes
            np.testing.assert_array_equal(view.array(), data)  # the daemon's pages, no copy
            assert not view.array().flags.writeable
            # Its buffer id writes nothing: a block is reached by its key only.
            with pytest.raises(rpcbuf.NotFound):
                await c.store_tensor(view.buffer_id, np.ones(4, np.uint8))
            with pytest.raises(rpcbuf.NotFound):
                await c.release_buffer(view.buffer_id)
            assert await c.remove_blocks(["kv/0"]) == 1  # out of the tier at once ...
            assert await c.blocks_exist(["kv/0"]) == [False]
            np.testing.assert_array_equal(view.array()[-16:], data[-16:])  # ... still mapped
        with pytest.raises(rpcbuf.NotFound):
            async with c.attach_block("kv/0"):
                pass
        await c.remove_blocks(["kv/1"])
    async with tier.connect("inplace", same_host=False) as c:
        with pytest.raises(rpcbuf.BadRequest, match="same-host"):
            async with c.attach_block("kv/1"):
                pass
    assert await wait_free(tier, start) == start  # freed at the detach


async def test_an_attached_block_is_not_evicted(tier: DaemonProc) -> None:
    blocks = _blocks(8, 4 * MiB, 11)
    keys = list(blocks)
    async with tier.connect("small", same_host=True) as c:
        await c.remove_blocks(keys)
        await c.put_block(keys[0], blocks[keys[0]])
        async with c.attach_block(keys[0]) as view:
            for k in keys[1:]:
                await c.put_block(k, blocks[k])
            assert (await c.blocks_exist(keys[:1])) == [True]
            np.testing.assert_array_equal(view.array(), blocks[keys[0]])
        await c.remove_blocks(keys)


async def test_a_refused_get_leaves_the_lru_order_and_the_counts_as_they_were(
        tier: DaemonProc) -> None:
    """A block_get refused after its keys were found (here: a bad staging
    slot) neither makes them the most recently used nor counts hits: the
    next eviction still takes the oldest block."""
    blocks = _blocks(5, 4 * MiB, 9)
    keys = list(blocks)
    async with tier.connect("small") as c:
        assert c.same_host
        for key in keys[:4]:  # the quota holds four beside the staging area
            await c.put_block(key, blocks[key])
        before = (await c.stats())["blocks"]
        with pytest.raises(rpcbuf.BadRequest, match="staging slot"):
            await _raw(c, {"op": "block_get", "keys": [keys[0]],
                           "sizes": P.pack_u64([4 * MiB]), "stage": 99,
                           "path": "staged"})
        after = (await c.stats())["blocks"]
        assert after["hits"] == before["hits"] and after["misses"] == before["misses"]
        await c.put_block(keys[4], blocks[keys[4]])  # evicts the least recently used
        assert await c.blocks_exist(keys) == [False, True, True, True, True]
        await c.remove_blocks(keys)


async def test_attached_blocks_at_the_head_are_never_evicted_and_come_back_when_let_go(
        tier: DaemonProc) -> None:
    """Issue 34, H1 against a real daemon: 40 attached blocks, the least
    recently used of the tenant's, stay (and read right) through puts that
    evict hundreds of others; let go, they are evicted like any other, in
    their turn.  (``test_blockstore`` counts the work: one look per
    evicted block.)"""
    size = 64 << 10
    blocks = _blocks(40, size, 21)
    keys = list(blocks)
    async with tier.connect("small", same_host=True) as c:
        await c.put_blocks(blocks)
        views = [await c.attach_block(k) for k in keys]
        before = (await c.stats())["blocks"]["evictions"]
        for seed in range(22, 26):  # 4 x 100 x 64 KiB: more than the 18 MiB left
            await c.put_blocks(_blocks(100, size, seed))
        assert (await c.stats())["blocks"]["evictions"] > before
        assert await c.blocks_exist(keys) == [True] * len(keys)
        for v, k in zip(views, keys, strict=True):
            np.testing.assert_array_equal(v.array(), blocks[k])
            await v.close()
        for seed in range(26, 30):  # the held ones went back in the order
            await c.put_blocks(_blocks(100, size, seed))
        assert await c.blocks_exist(keys) == [False] * len(keys)
        await c.remove_blocks([k for s in range(22, 30) for k in _blocks(100, 1, s)])


async def test_a_get_sends_each_block_once(tier: DaemonProc) -> None:
    """Issue 34, L13: a block_get naming one 1 MiB block 4,096 times sent
    4 GiB.  The daemon refuses a key named twice (BAD_REQUEST, nothing
    sent, no hit counted); the client reads such a key once and copies it,
    so ``get_blocks(['k'] * 4)`` still fills four arrays, moving 1 MiB."""
    block = np.random.default_rng(3).integers(0, 255, MiB, dtype=np.uint8)
    async with tier.connect("alice", same_host=False) as c:  # UCX: one message a block
        await c.put_block("dup", block)
        before = await c.stats()
        with pytest.raises(rpcbuf.BadRequest, match="each key once"):  # 64 MiB, before
            await _raw(c, {"op": "block_get", "keys": ["dup"] * 64,
                           "sizes": P.pack_u64([MiB] * 64)})
        after = await c.stats()
        assert after["bytes_read"] == before["bytes_read"]
        assert after["blocks"]["hits"] == before["blocks"]["hits"]
        out = [np.zeros(MiB, np.uint8) for _ in range(4)]
        assert await c.get_blocks(["dup", "absent", "dup", "dup"], out) == \
            [True, False, True, True]
        for i in (0, 2, 3):
            np.testing.assert_array_equal(out[i], block)
        assert not out[1].any()
        assert (await c.stats())["bytes_read"] == after["bytes_read"] + MiB
        with pytest.raises(rpcbuf.BadRequest, match="different sizes"):
            await c.get_blocks(["dup", "dup"], [out[0], np.zeros(10, np.uint8)])
        await c.remove_blocks(["dup"])


async def test_a_put_of_many_blocks_is_all_or_nothing_across_its_slices(
        tier: DaemonProc) -> None:
    """A put allocates 256 blocks at a time, letting the event loop go
    between slices (4,096 blocks at once held every other tenant for about
    100 ms when each was a memfd; slots of segments now).  It is still all
    or nothing: 600 blocks land whole, and a put whose third slice finds no
    room (the rest of the quota attached, nothing to evict) hands back
    every block of the first two and stores nothing."""
    start = await pool_free(tier)
    small = np.arange(4096, dtype=np.uint8)
    many = {f"many/{i}": small for i in range(600)}
    big = _blocks(4, 4 * MiB, 31)
    async with tier.connect("small", same_host=True) as c:
        await c.put_blocks(many)
        assert await c.blocks_exist(list(many)) == [True] * 600
        out = [np.zeros(4096, np.uint8) for _ in range(600)]
        assert await c.get_blocks(list(many), out) == [True] * 600
        assert all(np.array_equal(o, small) for o in out)
        await c.remove_blocks(list(many))
    # A segment handed to a session stays the tenant's until the session ends.
    assert await wait_free(tier, start) == start
    async with tier.connect("small", same_host=True) as c:
        await c.put_blocks(big)  # 16 of the 18 MiB beside the staging area, all attached
        views = [await c.attach_block(k) for k in big]
        before = (await c.stats())["blocks"]
        with pytest.raises((rpcbuf.QuotaExceeded, rpcbuf.OutOfMemory)):
            await c.put_blocks(many)  # 2.3 MiB: the first slices fit, a later one cannot
        after = (await c.stats())["blocks"]
        assert after["blocks"] == before["blocks"] and after["evictions"] == before["evictions"]
        assert await c.blocks_exist(list(many)[:3]) == [False] * 3
        for v in views:
            await v.close()
        await c.remove_blocks(list(big))
    assert await wait_free(tier, start) == start


# -- blocks in slabs (issue 40) ----------------------------------------------------------


def _numbered(i: int, size: int) -> np.ndarray:
    """Block ``i``: its index in the first 8 bytes, then a byte of it."""
    a = np.full(size, i % 251, np.uint8)
    a[:8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
    return a


@pytest.mark.parametrize("same_host", [True, False], ids=["same_host", "ucx"])
async def test_fifty_thousand_blocks_with_the_daemons_fds_constant(
        daemon_factory, same_host: bool) -> None:  # type: ignore[no-untyped-def]
    """50,000 blocks of 4 KiB (200 MiB), put and read back in batches of 512:
    every block intact, none evicted, and the daemon's open fds (counted in
    /proc) grow by the tenant's few segments only.  Before (a memfd per
    block) the same puts took one fd each: past the tenant's fd budget each
    put evicted the oldest (issue 40: 10,034 of 30,000 vanished)."""
    n, size, batch = 50_000, 4096, 512
    d = daemon_factory("--device", "cpu:320MiB", "--transfer-timeout", "60s")
    async with d.connect("alice", same_host=same_host) as c:
        await c.put_block("warm", np.zeros(size, np.uint8))  # the session's own fds
        await c.remove_blocks(["warm"])
        fds = d.fds()
        start = time.monotonic()
        for i in range(0, n, batch):
            await c.put_blocks({f"b/{j}": _numbered(j, size)
                                for j in range(i, min(n, i + batch))})
        st = await c.stats()
        assert st["blocks"]["blocks"] == n and st["blocks"]["evictions"] == 0
        segments = st["blocks"]["segments"]
        assert 1 <= segments <= 16, segments
        assert d.fds() - fds <= segments < 100  # a block holds no fd
        assert st["limits"]["fds"]["held"] == segments == st["limits"]["mappings"]["held"]
        assert st["limits"]["bytes:cpu:0"]["held"] >= st["blocks"]["segment_bytes"] >= n * size
        assert st["limits"]["buffers"]["held"] == n  # the quota's N counts blocks
        out = [np.empty(size, np.uint8) for _ in range(batch)]
        for i in range(0, n, batch):
            keys = [f"b/{j}" for j in range(i, min(n, i + batch))]
            assert all(await c.get_blocks(keys, out[:len(keys)]))
            for j, o in zip(range(i, i + len(keys)), out, strict=False):
                assert np.array_equal(o, _numbered(j, size)), j
        assert time.monotonic() - start < 300  # bounded (2 loaded cores: about 20 s)
        keys, _ = await c.list_blocks(prefix="b/", limit=4096)
        assert len(keys) == 4096
        for i in range(0, n, 4096):
            await c.remove_blocks([f"b/{j}" for j in range(i, min(n, i + 4096))])
        st = await c.stats()
        assert st["blocks"]["blocks"] == 0
        # Segments this session maps (puts and gets in place) stay the
        # tenant's until it ends; others go back with their last block.
        assert st["blocks"]["segments"] == (segments if same_host else 0)
    async with d.connect("alice", same_host=False) as c:
        for _ in range(100):
            st = await c.stats()
            if st["blocks"]["segments"] == 0:
                break
            await asyncio.sleep(0.05)
        assert st["blocks"]["segments"] == 0
        assert st["limits"]["fds"]["held"] == 0  # every segment given back
        assert d.fds() <= fds + 2  # this session's own


async def test_a_put_beside_thousands_of_attached_blocks_evicts_in_lru_order(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """1,000 attached blocks at the head of the LRU order, 1,000 free behind
    them, the quota full of segments: a put of 300 evicts the 300 least
    recently used free blocks (in that order, each counted), never an
    attached one, and the attached views still show their bytes."""
    size = 16 << 10
    d = daemon_factory("--device", "cpu:256MiB", "--quota", "alice:48MiB:100000",
                       "--transfer-timeout", "60s")
    async with d.connect("alice", same_host=True) as c:
        await c.put_blocks({f"a/{i}": _numbered(i, size) for i in range(1000)})
        await c.put_blocks({f"f/{i}": _numbered(i, size) for i in range(1000)})
        views = [await c.attach_block(f"a/{i}") for i in range(1000)]
        base = (await c.stats())["blocks"]
        # Fill what is left of the quota: evictions start once no segment can be made.
        i = 0
        while (await c.stats())["blocks"]["evictions"] == base["evictions"] and i < 100:
            await c.put_blocks({f"fill/{i}/{j}": _numbered(j, size) for j in range(64)})
            i += 1
        st = (await c.stats())["blocks"]
        evicted = st["evictions"] - base["evictions"]
        assert 0 < evicted <= 64
        fills = [f"fill/{k}/{j}" for k in range(i) for j in range(64)]
        # The oldest free blocks went, in the order they were put.
        alive = await c.blocks_exist([f"f/{k}" for k in range(1000)])
        assert alive == [False] * evicted + [True] * (1000 - evicted)
        assert all(await c.blocks_exist(fills))
        await c.put_blocks({f"new/{j}": _numbered(j, size) for j in range(300)})
        st2 = (await c.stats())["blocks"]
        assert st2["evictions"] - st["evictions"] == 300
        alive = await c.blocks_exist([f"f/{k}" for k in range(1000)])
        assert alive == [False] * (evicted + 300) + [True] * (700 - evicted)
        assert await c.blocks_exist([f"a/{k}" for k in range(1000)]) == [True] * 1000
        for k, v in enumerate(views):
            assert np.array_equal(v.array(), _numbered(k, size))
            await v.close()


async def test_a_same_host_reader_sees_only_its_own_tenants_blocks(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """An attached block is handed out as its tenant's segment, read-only.
    Bob's blocks (0xBB) lived and were removed in the same arena before
    alice's segment was made there: mapping all of alice's segment shows
    her blocks, and zeros where no block of hers was, never a byte of bob's
    (his live blocks are in his own segment; his freed one's memory was
    never kept, and a new memfd is zero)."""
    size = 64 << 10
    d = daemon_factory("--device", "cpu:16MiB", "--transfer-timeout", "30s")
    async with d.connect("bob") as b:
        await b.put_blocks({f"bob/{i}": np.full(size, 0xBB, np.uint8) for i in range(100)})
        await b.remove_blocks([f"bob/{i}" for i in range(100)])  # his segment freed
        await b.put_blocks({f"bob2/{i}": np.full(size, 0xBB, np.uint8) for i in range(8)})
    async with d.connect("alice", same_host=True) as a:
        mine = {f"kv/{i}": np.full(size, 0xA0 + i, np.uint8) for i in range(8)}
        await a.put_blocks(mine)
        await a.remove_blocks(["kv/7"])  # a freed slot of hers
        async with a.attach_block("kv/3") as view:
            assert np.array_equal(view.array(), mine["kv/3"])
            seg = view.array()
            while not isinstance(seg, mmap.mmap):  # the whole mapping under the view
                seg = seg.obj if isinstance(seg, memoryview) else seg.base
            whole = np.frombuffer(seg, np.uint8)
            assert len(whole) >= 8 * size
            assert not (whole == 0xBB).any(), "a reader of alice's block sees bob's bytes"
            values = set(np.unique(whole).tolist())
            assert values <= {0, *range(0xA0, 0xA8)}, values  # hers (kv/7's stale bytes too)
            assert {0xA0 + i for i in range(7)} <= values  # her other blocks: documented
    async with d.connect("bob", same_host=True) as b:
        with pytest.raises(rpcbuf.NotFound):
            await b.attach_block("kv/3")


async def test_a_full_pool_evicts_only_the_putters_blocks_and_refuses_loudly(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A pool too small for two tenants' caches: alice's puts evict her own
    least recently used blocks (each counted: blocks + evictions = puts);
    bob, with nothing to evict, gets OUT_OF_MEMORY, never an OK for blocks
    that were not kept; a put larger than the pool is refused before
    anything is evicted."""
    size = 256 << 10
    d = daemon_factory("--device", "cpu:16MiB", "--transfer-timeout", "30s")
    async with d.connect("alice") as a, d.connect("bob") as b:
        put = 0
        for i in range(20):
            await a.put_blocks({f"a/{i}/{j}": _numbered(j, size) for j in range(8)})
            put += 8
        st = (await a.stats())["blocks"]
        assert st["evictions"] > 0 and st["blocks"] + st["evictions"] == put
        alive = await a.blocks_exist([f"a/{i}/{j}" for i in range(20) for j in range(8)])
        assert alive == sorted(alive)  # the oldest went first
        with pytest.raises(rpcbuf.OutOfMemory):
            await b.put_blocks({f"b/{j}": _numbered(j, size) for j in range(8)})
        assert (await b.stats())["blocks"]["blocks"] == 0
        with pytest.raises(rpcbuf.OutOfMemory):
            await a.put_block("huge", np.zeros(32 << 20, np.uint8))
        assert (await a.stats())["blocks"]["evictions"] == st["evictions"]


# -- blocks over UCX (issue 40 item 4) ---------------------------------------------------


def _mixed(seed: int) -> dict[str, np.ndarray]:
    """A batch of 244 blocks of three sizes, interleaved (small ones between big ones)."""
    rng = np.random.default_rng(seed)
    sizes = [4096] * 200 + [256 << 10] * 40 + [2 * MiB] * 4
    order = rng.permutation(len(sizes))
    return {f"mix/{seed}/{i}": rng.integers(0, 255, sizes[j], dtype=np.uint8)
            for i, j in enumerate(order)}


async def test_a_batch_of_many_blocks_round_trips_over_ucx(tier: DaemonProc) -> None:
    """244 blocks of 4 KiB to 2 MiB in one put and one get over UCX: every
    block's messages in flight together, each byte back where it was."""
    start = await pool_free(tier)
    blocks = _mixed(41)
    keys = list(blocks)
    async with tier.connect("alice", same_host=False) as c:
        answer = await c.put_blocks(blocks)
        assert answer == {"blocks": len(keys), "nbytes": sum(a.nbytes for a in blocks.values())}
        out = [np.zeros_like(a) for a in blocks.values()]
        assert await c.get_blocks(keys[::-1], out[::-1]) == [True] * len(keys)
        for k, o in zip(keys, out, strict=True):
            np.testing.assert_array_equal(o, blocks[k], err_msg=k)
        assert await c.remove_blocks(keys) == len(keys)
    assert await wait_free(tier, start) == start


async def test_a_ucx_batch_with_one_bad_hash_stores_nothing(tier: DaemonProc) -> None:
    """One checksum wrong among 244 blocks sent over UCX: VERIFY_FAILED
    naming it, no key of the batch stored, nothing left held."""
    start = await pool_free(tier)
    blocks = _mixed(42)
    keys, datas = list(blocks), list(blocks.values())
    sums = [checksum(a) for a in datas]
    bad = 117
    sums[bad] ^= 1
    async with tier.connect("alice", same_host=False) as c:
        before = (await c.stats())["limits"]["buffers"]["held"]
        req = P.BlockPut(keys=keys, sizes=P.pack_u64([a.nbytes for a in datas]),
                         checksums=P.pack_u64(sums))
        with pytest.raises(rpcbuf.VerifyFailed) as err:
            await c._paths.run("", HOST, _transfer(req, datas))
        assert err.value.details["items"] == [bad]
        assert await c.blocks_exist(keys) == [False] * len(keys)
        assert (await c.stats())["limits"]["buffers"]["held"] == before
    assert await wait_free(tier, start) == start


async def test_a_client_gone_mid_batch_leaves_no_key_and_nothing_held(
        tier: DaemonProc) -> None:
    """A client sends half of a 64-block put's messages over UCX and
    vanishes (its endpoint and control connection torn down): no key of
    the batch is ever visible, and the daemon holds none of its pending
    blocks once the session is gone (nothing pinned: the pool is whole)."""
    start = await pool_free(tier)
    blocks = _blocks(64, 256 << 10, 43)
    keys, datas = list(blocks), list(blocks.values())
    async with tier.connect("alice", same_host=False) as c:
        before = (await c.stats())["limits"]["buffers"]["held"]
        writer = await tier.connect("alice", same_host=False)
        try:
            ep = await writer._paths.ucx.endpoint()
            conn = writer._conn
            req_id = conn.next_id()
            conn.submit(req_id, P.BlockPut(keys=keys, sizes=P.pack_u64([a.nbytes for a in datas]),
                                           checksums=P.pack_u64([checksum(a) for a in datas])))
            sent = [asyncio.ensure_future(ep.send(a, run_tag(req_id, i)))
                    for i, a in enumerate(datas[:32])]
            for _ in range(100):  # the daemon holds the 64 pending blocks, waiting for the rest
                if (await c.stats())["limits"]["buffers"]["held"] >= before + 64:
                    break
                await asyncio.sleep(0.05)
            assert (await c.stats())["limits"]["buffers"]["held"] >= before + 64
            assert await c.blocks_exist(keys) == [False] * 64
        finally:
            writer.abort()
            await asyncio.gather(*sent, return_exceptions=True)
            await writer.close()
        for _ in range(100):
            if (await c.stats())["limits"]["buffers"]["held"] == before:
                break
            await asyncio.sleep(0.05)
        assert (await c.stats())["limits"]["buffers"]["held"] == before
        assert await c.blocks_exist(keys) == [False] * 64
    assert await wait_free(tier, start) == start


async def test_an_idle_client_does_not_poll_ucx(tier: DaemonProc,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a UCX block get (or put) has ended and nothing is in flight, the
    client's progress engine arms the worker and sleeps on its fd: a few
    progress drains, not a loop spinning beside the daemon (it spun 10 ms
    after every transfer, and on a loaded 2-core machine the client's and the
    daemon's spinning made a 4 KiB hit take 8-14 ms; dataplane/progress.py)."""
    calls = [0]
    drain = progress.drain

    def counted(*args: Any) -> bool:
        calls[0] += 1
        return drain(*args)

    monkeypatch.setattr(progress, "drain", counted)
    a = np.arange(4096, dtype=np.uint8)
    out = np.zeros_like(a)
    async with tier.connect("alice", same_host=False) as c:
        for i in range(5):
            await c.put_blocks({f"idle/{i}": a})
            assert await c.get_blocks([f"idle/{i}"], [out]) == [True]
            calls[0] = 0
            await asyncio.sleep(0.05)  # idle: nothing of ours in flight
            assert calls[0] <= 3, f"{calls[0]} progress drains while idle"
        await c.remove_blocks([f"idle/{i}" for i in range(5)])


# -- same host, in place (issue 40 item 3) -----------------------------------------------


async def test_in_place_puts_and_gets_are_byte_exact(tier: DaemonProc) -> None:
    """Same host: a put copies straight into its slots and a get straight out
    of them (the session's own mappings of its segments, no staging copy);
    odd sizes, a batch and a key read twice all come back byte for byte."""
    start = await pool_free(tier)
    rng = np.random.default_rng(7)
    sizes = [1, 4095, 4097, 65537, 256 << 10, 2 * MiB + 3]
    blocks = {f"ip/{i}": rng.integers(0, 256, n, dtype=np.uint8) for i, n in enumerate(sizes)}
    async with tier.connect("alice", same_host=True) as c:
        segs = c._blocks.segments
        assert segs is not None
        async def no_staging(*args: Any, **kw: Any) -> Any:
            raise AssertionError("a block moved through the staging area")

        c._paths.run = no_staging  # type: ignore[method-assign]
        await c.put_blocks(blocks)
        assert len(segs) >= 1  # the put went through the session's mappings
        keys = [*blocks, "ip/2"]
        out = [np.zeros(blocks[k].nbytes, np.uint8) for k in keys]
        assert await c.get_blocks(keys, out) == [True] * len(keys)
        for k, o in zip(keys, out, strict=True):
            np.testing.assert_array_equal(o, blocks[k])
        batch = {f"ipb/{i}": _numbered(i, 256 << 10) for i in range(64)}
        await c.put_blocks(batch)
        outs = [np.empty(256 << 10, np.uint8) for _ in batch]
        assert await c.get_blocks(list(batch), outs) == [True] * 64
        assert all(np.array_equal(o, _numbered(i, 256 << 10)) for i, o in enumerate(outs))
        await c.remove_blocks(list(blocks) + list(batch))
    assert "map_segment" in tier.log() and "unmap_segment" in tier.log()
    assert await wait_free(tier, start) == start


def _mapped_kib(addr: int) -> int:
    """Rss of this process's mapping at ``addr`` (pages it has mapped), KiB."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(f"{addr:x}-"):
            return next(int(x.split()[1]) for x in lines[i + 1:] if x.startswith("Rss:"))
    raise AssertionError(f"no mapping at {addr:#x}")


async def test_a_session_maps_its_segments_pages_ahead_of_its_copies(tier: DaemonProc) -> None:
    """Issue 40's profile: a same-host put's copy into pages this process
    had never touched took a fault per 4 KiB page (a 2 MiB put 1.49 ms,
    0.74 ms with the pages mapped; 16 MiB 10.9 against 3.9).  A session
    now maps every page of a segment it is handed, in a thread, off the
    put's path."""
    async with tier.connect("alice", same_host=True) as c:
        segs = c._blocks.segments
        assert segs is not None
        await c.put_blocks({"pf/0": np.ones(4096, np.uint8)})  # one page written here
        ((addr, size, _),) = segs._maps.values()
        for _ in range(200):
            if _mapped_kib(addr) == size >> 10:
                break
            await asyncio.sleep(0.05)
        assert _mapped_kib(addr) == size >> 10, (_mapped_kib(addr), size >> 10)
        out = np.zeros(4096, np.uint8)
        assert await c.get_blocks(["pf/0"], [out]) == [True] and out.all()
        await c.remove_blocks(["pf/0"])


async def test_a_get_over_more_segments_than_one_answer_maps_still_reads(
        daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """A same-host get whose blocks lie in more than 32 segments new to its
    session (``MAX_NEW_MAPS``: one answer hands at most 32) was refused
    BAD_REQUEST (reason ``segments``), where a put of as many takes the
    staging area.  It reads them all now, in place, in halves that each map
    their own.  (33 full segments: 2.1 GB.)"""
    d = daemon_factory("--device", "cpu:3GiB", "--quota", "big:3GiB:-")
    block = 4 * MiB
    keys: list[str] = []
    async with d.connect("big", same_host=True) as c:
        for seg in range(33):  # a put of 64 MiB fills one full-size segment
            batch = {f"s{seg}/{i}": _numbered(seg * 16 + i, block) for i in range(16)}
            await c.put_blocks(batch)
            keys.append(f"s{seg}/0")
        assert (await c.stats())["blocks"]["segments"] >= 33
    async with d.connect("big", same_host=True) as c:  # none mapped in this session yet
        assert c._blocks.segments is not None

        async def no_staging(*args: Any, **kw: Any) -> Any:
            raise AssertionError("a block moved through the staging area")

        c._paths.run = no_staging  # type: ignore[method-assign]  # in place, in halves
        out = [np.empty(block, np.uint8) for _ in keys]
        assert await c.get_blocks(keys, out) == [True] * len(keys)
        assert all(np.array_equal(o, _numbered(seg * 16, block)) for seg, o in enumerate(out))
        assert await c.get_blocks(keys[:2], out[:2]) == [True, True]  # and in place again


async def test_a_small_block_of_a_network_session_rides_in_its_frames(
        tier: DaemonProc) -> None:
    """Issue 40's profile of the UCX rows: a 4 KiB hit was three loopback
    sends (request, answer, UCX message) and a progress poll each side,
    where a small read of a buffer rides in its answer.  A block of at
    most ``inline_max`` bytes now does the same, put and get; bigger
    ones, and batches, still go over UCX."""
    async with tier.connect("alice", same_host=False) as c:
        assert c.hello["block_inline"] is True
        ucx = c._paths.ucx
        moved: list[str] = []
        send, receive = ucx.send, ucx.receive

        async def counted_send(t: Any) -> Any:
            moved.append("send")
            return await send(t)

        async def counted_receive(t: Any) -> Any:
            moved.append("receive")
            return await receive(t)

        ucx.send, ucx.receive = counted_send, counted_receive  # type: ignore[method-assign]
        small = _numbered(5, 4096)
        await c.put_blocks({"in/small": small})
        out = np.zeros(4096, np.uint8)
        assert await c.get_blocks(["in/small"], [out]) == [True]
        np.testing.assert_array_equal(out, small)
        assert moved == []  # no UCX message either way
        big = _numbered(6, 256 << 10)
        await c.put_blocks({"in/big": big})
        back = np.zeros(256 << 10, np.uint8)
        assert await c.get_blocks(["in/big"], [back]) == [True]
        np.testing.assert_array_equal(back, big)
        assert moved == ["send", "receive"]  # past inline_max: UCX
        with pytest.raises(rpcbuf.BadRequest, match="travel in a frame"):  # asked all the same
            await c._call(P.BlockGet(keys=["in/big"], sizes=P.pack_u64([256 << 10]),
                                     path="inline"))
        assert await c.ping() > 0
        await c.remove_blocks(["in/small", "in/big"])


async def test_in_place_get_works_without_the_path_and_over_ucx(tier: DaemonProc,
                                                                monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``RPCBUF_SAME_HOST=0`` (and ``same_host=False``): no mappings, the
    UCX path moves the blocks as before; the in-place ops are refused
    (BAD_REQUEST, reason not_same_host) on a session without the path."""
    monkeypatch.setenv("RPCBUF_SAME_HOST", "0")
    data = _numbered(3, 2 * MiB)
    async with tier.connect("alice") as c:
        assert not c.same_host and c._blocks.segments is None
        await c.put_blocks({"ucx/1": data})
        out = np.empty(2 * MiB, np.uint8)
        assert await c.get_blocks(["ucx/1"], [out]) == [True]
        np.testing.assert_array_equal(out, data)
        with pytest.raises(rpcbuf.BadRequest) as err:
            await c._call(P.BlockPlace(keys=["x"], sizes=P.pack_u64([16])))
        assert err.value.details.get("reason") == "not_same_host"
        with pytest.raises(rpcbuf.BadRequest):
            await c._call(P.BlockLocate(keys=["ucx/1"], sizes=P.pack_u64([2 * MiB])))
        await c.remove_blocks(["ucx/1"])


async def test_an_in_place_hash_mismatch_stores_nothing(tier: DaemonProc) -> None:
    """The daemon hashes what lies in the slots at commit: a checksum that
    does not match is VERIFY_FAILED, the key keeps its old block, and the
    pending slots go back (the next put takes them again)."""
    start = await pool_free(tier)
    async with tier.connect("alice", same_host=True) as c:
        await c.put_blocks({"k": np.full(16, 5, np.uint8)})
        data = _numbered(1, 64 << 10)
        placed = await c._call(P.BlockPlace(keys=["k", "j"],
                                            sizes=P.pack_u64([data.nbytes, 16])))
        slots = await c._blocks.segments.views(placed, [data.nbytes, 16], 10)  # type: ignore[union-attr]
        slots[0][:] = data
        slots[1][:] = data[:16]
        del slots
        buffers = (await c.stats())["limits"]["buffers"]["held"]
        with pytest.raises(rpcbuf.VerifyFailed):
            await c._call(P.BlockCommit(lease=placed["lease"], checksums=P.pack_u64(
                [checksum(data), checksum(data[:16]) ^ 1])))
        assert await c.blocks_exist(["k", "j"]) == [True, False]
        assert (await c.get_block("k")).tolist() == [5] * 16  # type: ignore[union-attr]
        assert (await c.stats())["limits"]["buffers"]["held"] == buffers - 2  # pending slots went
        with pytest.raises(rpcbuf.NotFound):  # the lease is gone with them
            await c._call(P.BlockCommit(lease=placed["lease"], checksums=P.pack_u64([0, 0])))
        again = await c._call(P.BlockPlace(keys=["k", "j"],
                                           sizes=P.pack_u64([data.nbytes, 16])))
        assert again["offsets"] == placed["offsets"]  # the same slots, reused
        await c._call(P.BlockCommit(lease=again["lease"], checksums=P.pack_u64([]),
                                    abort=True))
        await c.remove_blocks(["k"])
    assert await wait_free(tier, start) == start


KILLED = """
import asyncio, json, os, signal, sys
import numpy as np
import rpcbuf
from rpcbuf.control.wire import protocol as P
async def main():
    async with rpcbuf.connect(sys.argv[1], token=sys.argv[2], same_host=True) as c:
        n = 64 << 10
        placed = await c._call(P.BlockPlace(keys=["dead/0", "dead/1"], sizes=P.pack_u64([n, n])))
        slots = await c._blocks.segments.views(placed, [n, n], 10)
        for s in slots:
            s[:] = 7  # copied, not committed
        print(json.dumps({"offsets": P.unpack_u64(placed["offsets"]).tolist(),
                          "segments": [placed["segments"][w] for w in
                                       P.unpack_u64(placed["which"]).tolist()]}), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
asyncio.run(main())
"""


async def test_a_client_killed_between_copy_and_commit_leaves_no_key(
        tier: DaemonProc) -> None:
    """A same-host put whose client copied its blocks in and was killed
    before committing: no key, and its pending slots go back with its
    session (the next put of the same sizes takes the very same slots)."""
    import json
    import subprocess
    import sys

    start = await pool_free(tier)
    async with tier.connect("alice", same_host=True) as c:
        await c.put_blocks({"keep": np.full(64 << 10, 1, np.uint8)})  # the segment stays
        buffers = (await c.stats())["limits"]["buffers"]["held"]
        env = {**os.environ, "PYTHONPATH": "src", "UCX_WARN_UNUSED_ENV_VARS": "n"}
        p = subprocess.run([sys.executable, "-c", KILLED, tier.addr, tier.token("alice")],
                           capture_output=True, text=True, env=env, timeout=60)
        assert p.returncode == -9, p.stderr
        killed = json.loads(p.stdout)
        for _ in range(100):  # the daemon sees the session end
            if (await c.stats())["limits"]["buffers"]["held"] == buffers:
                break
            await asyncio.sleep(0.05)
        assert (await c.stats())["limits"]["buffers"]["held"] == buffers
        assert await c.blocks_exist(["dead/0", "dead/1"]) == [False, False]
        assert await c.list_blocks() == (["keep"], False)
        n = 64 << 10
        placed = await c._call(P.BlockPlace(keys=["new/0", "new/1"], sizes=P.pack_u64([n, n])))
        got = {"offsets": P.unpack_u64(placed["offsets"]).tolist(),
               "segments": [placed["segments"][w] for w in
                            P.unpack_u64(placed["which"]).tolist()]}
        assert sorted(zip(got["segments"], got["offsets"], strict=True)) == \
            sorted(zip(killed["segments"], killed["offsets"], strict=True))  # its slots, reused
        await c._call(P.BlockCommit(lease=placed["lease"], checksums=P.pack_u64([]),
                                    abort=True))
        await c.remove_blocks(["keep"])
    assert await wait_free(tier, start) == start


async def test_no_tenant_ever_maps_another_tenants_segment(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    """Only the owning tenant's sessions are handed its segments: alice's and
    bob's in-place puts and gets map disjoint memfds, each session only
    its own tenant's; bob cannot locate, attach, commit or unpin anything
    of alice's (her key is his miss; her lease is not his session's), and
    a segment's handle is handed once per session."""
    d = daemon_factory("--device", "cpu:64MiB", "--transfer-timeout", "30s")
    size = 64 << 10
    async with d.connect("alice", same_host=True) as a, d.connect("alice", same_host=True) as a2, \
            d.connect("bob", same_host=True) as b:
        await a.put_blocks({f"a/{i}": np.full(size, 0xAA, np.uint8) for i in range(8)})
        await b.put_blocks({f"b/{i}": np.full(size, 0xBB, np.uint8) for i in range(8)})
        out = [np.empty(size, np.uint8) for _ in range(8)]
        assert await a2.get_blocks([f"a/{i}" for i in range(8)], out) == [True] * 8
        assert all((o == 0xAA).all() for o in out)
        ina = set(a._blocks.segments.inodes.values())  # type: ignore[union-attr]
        ina2 = set(a2._blocks.segments.inodes.values())  # type: ignore[union-attr]
        inb = set(b._blocks.segments.inodes.values())  # type: ignore[union-attr]
        assert ina and inb and ina2 == ina and not ina & inb
        with pytest.raises(rpcbuf.NotFound):
            await b._call(P.BlockLocate(keys=["a/0"], sizes=P.pack_u64([size])))
        with pytest.raises(rpcbuf.NotFound):
            await b.attach_block("a/0")
        placed = await a._call(P.BlockPlace(keys=["a/x"], sizes=P.pack_u64([size])))
        assert placed["maps"] == []  # her segment was handed to this session already
        with pytest.raises(rpcbuf.NotFound):  # a lease is its session's
            await b._call(P.BlockCommit(lease=placed["lease"], checksums=P.pack_u64([0])))
        with pytest.raises(rpcbuf.NotFound):
            await b._call(P.BlockUnpin(lease=placed["lease"]))
        await a._call(P.BlockCommit(lease=placed["lease"], checksums=P.pack_u64([]), abort=True))
        assert set(b._blocks.segments.inodes.values()) == inb  # type: ignore[union-attr]
        assert await b.blocks_exist(["a/x", "a/0"]) == [False, False]
    log = d.log()
    assert "map_segment" in log


async def test_a_located_block_is_pinned_until_unpinned(tier: DaemonProc) -> None:
    """A get in place pins its blocks while the client copies: a remove
    and new puts meanwhile never reuse the slot, whose bytes stay until the
    unpin (then the slot is free again)."""
    start = await pool_free(tier)
    size = 64 << 10
    async with tier.connect("alice", same_host=True) as c, \
            tier.connect("alice", same_host=True) as w:
        await c.put_blocks({"p": np.full(size, 9, np.uint8)})
        located = await c._call(P.BlockLocate(keys=["p"], sizes=P.pack_u64([size])))
        (view,) = await c._blocks.segments.views(located, [size], 10)  # type: ignore[union-attr]
        await w.remove_blocks(["p"])
        await w.put_blocks({f"q/{i}": np.full(size, 1, np.uint8) for i in range(16)})
        assert (view == 9).all(), "a pinned block's slot was reused"
        del view
        await c._call(P.BlockUnpin(lease=located["lease"]))
        with pytest.raises(rpcbuf.NotFound):
            await c._call(P.BlockUnpin(lease=located["lease"]))
        await w.remove_blocks([f"q/{i}" for i in range(16)])
    assert await wait_free(tier, start) == start
