"""Re-loads that trust the daemon's own checksums, and every writer that must
break that trust (``control/daemon/content/index.py``, ``dedupops.py``).

A tensor the daemon hashed when it landed is placed again (in place, or
copied under a new name) without hashing it again, as long as nothing wrote
its bytes since.  Each writer below changes one tensor's bytes in the source
buffer, before and after the source was indexed; a re-load must then send
that tensor (never place the changed bytes with the old checksum), place
the others without hashing, and read back exactly the model.  The daemon's
per-tenant counters ``dedup_bytes_hashed`` / ``dedup_bytes_trusted``
(``stats()``) say what it hashed and what it placed on trust.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc
from models import cached_model
from rpcbuf.control.daemon.content.index import WRITE_LOG

pytestmark = pytest.mark.both_paths

N, SIZE = 6, 4096  # float32 tensors of 16 KiB, one of them ("t2") is overwritten
VICTIM = "t2"


def model(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"t{i}": rng.standard_normal(SIZE, dtype=np.float32) for i in range(N)}


async def counters(ctx: rpcbuf.RpcContext) -> tuple[int, int]:
    st = await ctx.stats()
    return int(st.get("dedup_bytes_hashed", 0)), int(st.get("dedup_bytes_trusted", 0))


async def upload(ctx: rpcbuf.RpcContext, tensors: dict[str, np.ndarray],
                 room: int = 1 << 16) -> tuple[str, dict[str, int], dict[str, int]]:
    """A buffer with ``tensors`` stored back to back (and ``room`` bytes after
    them for writes that touch no tensor): its id, the layout
    ``store_tensors_dedup`` chose, and what that call answered."""
    size = rpcbuf.calculate_buffer_size(tensors, headroom=0) + room
    bid = await ctx.request_buffer(size)
    got = await ctx.store_tensors_dedup(bid, tensors)
    meta = await ctx.get_buffer_meta(bid)
    return bid, {n: int(e["offset"]) for n, e in meta["tensors"].items()}, got


async def index_now(ctx: rpcbuf.RpcContext) -> None:
    """Any dedup query indexes what the tenant stored since the last one."""
    scratch = await ctx.request_buffer(4096)
    await ctx.store_tensors_dedup(scratch, {"probe": np.arange(16, dtype=np.uint8)})
    await ctx.release_buffer(scratch)


Writer = Callable[[rpcbuf.RpcContext, str, int], Awaitable[None]]


async def w_store(ctx: rpcbuf.RpcContext, bid: str, at: int) -> None:
    await ctx.store_tensor(bid, np.full(64, 7, np.uint8), offset=at + 128)


async def w_batch(ctx: rpcbuf.RpcContext, bid: str, at: int) -> None:
    await ctx.store_batch(bid, [(at + 8, np.ones(8, np.uint8))])


async def w_tensors(ctx: rpcbuf.RpcContext, bid: str, at: int) -> None:
    await ctx.store_tensors(bid, {"other": np.full(SIZE, 3.0, np.float32)}, offset=at)


async def w_clear(ctx: rpcbuf.RpcContext, bid: str, at: int) -> None:
    await ctx.clear_buffer(bid, 0x5A, offset=at + 4, nbytes=1)


async def w_copy(ctx: rpcbuf.RpcContext, bid: str, at: int) -> None:
    src = await ctx.request_buffer(4096)
    await ctx.clear_buffer(src, 0xEE)
    await ctx.copy_buffer(src, 0, bid, at + 1000, 32)
    await ctx.release_buffer(src)


async def w_f16(ctx: rpcbuf.RpcContext, bid: str, at: int) -> None:
    await ctx.store_tensor(bid, np.full(64, 2.5, np.float32), offset=at, wire_dtype="float16")


async def w_dedup(ctx: rpcbuf.RpcContext, bid: str, at: int) -> None:
    """A dedup placement over the tensor: other content (held in another
    buffer) copied into its range by the daemon."""
    other = {"o": np.full(SIZE, 9.0, np.float32)}
    src, _, _ = await upload(ctx, other)
    await index_now(ctx)
    got = await ctx.store_tensors_dedup(bid, other, offsets={"o": at})
    assert got["placed"] == 1  # the daemon itself wrote it
    await ctx.release_buffer(src)


WRITERS: dict[str, Writer] = {"store_tensor": w_store, "store_batch": w_batch,
                              "store_tensors": w_tensors, "clear_buffer": w_clear,
                              "copy_buffer": w_copy, "wire_f16": w_f16, "dedup_store": w_dedup}


async def test_reload_in_place_and_under_a_new_name_hashes_nothing(
        ctx: rpcbuf.RpcContext) -> None:
    m = model()
    total = sum(a.nbytes for a in m.values())
    a, layout, _ = await upload(ctx, m)
    h0, t0 = await counters(ctx)
    again = await ctx.store_tensors_dedup(a, m, offsets=layout)  # the same buffer: in place
    assert again["sent"] == 0 and again["placed"] == N
    b, _, copied = await upload(ctx, m)  # a new buffer: copied on trust
    assert copied["sent"] == 0
    h1, t1 = await counters(ctx)
    assert h1 == h0, "a re-load of unwritten bytes hashed them again"
    assert t1 - t0 == total
    for bid in (a, b):
        back = await ctx.load_tensors(bid)  # checksums verified on the way back
        for name, arr in m.items():
            np.testing.assert_array_equal(back[name], arr)
        await ctx.release_buffer(bid)


@pytest.mark.parametrize("indexed", [False, True], ids=["deferred", "indexed"])
@pytest.mark.parametrize("writer", list(WRITERS))
async def test_a_write_into_the_source_is_never_trusted(ctx: rpcbuf.RpcContext, writer: str,
                                                        indexed: bool) -> None:
    m = model(seed=1)
    a, layout, _ = await upload(ctx, m)
    if indexed:
        await index_now(ctx)
    await WRITERS[writer](ctx, a, layout[VICTIM])
    b, _, got = await upload(ctx, m)  # under a new name: the changed tensor travels
    assert got["sent"] == 1 and got["bytes_sent"] == m[VICTIM].nbytes, got
    back = await ctx.load_tensors(b)
    for name, arr in m.items():
        np.testing.assert_array_equal(back[name], arr)
    await ctx.release_buffer(b)
    # The source itself, re-loaded in its own layout (no other copy left): the
    # changed tensor is sent again, the others stay where they are.
    again = await ctx.store_tensors_dedup(a, m, offsets=layout)
    assert again["sent"] == 1 and again["placed"] == N - 1, again
    back = await ctx.load_tensors(a, list(m))
    for name, arr in m.items():
        np.testing.assert_array_equal(back[name], arr)
    await ctx.release_buffer(a)


async def test_a_new_name_sends_exactly_the_changed_tensor(ctx: rpcbuf.RpcContext) -> None:
    m = model(seed=2)
    a, layout, _ = await upload(ctx, m)
    await w_clear(ctx, a, layout[VICTIM])
    size = rpcbuf.calculate_buffer_size(m, headroom=0)
    b = await ctx.request_buffer(size)
    h0, _ = await counters(ctx)
    got = await ctx.store_tensors_dedup(b, m)
    assert got["sent"] == 1 and got["bytes_sent"] == m[VICTIM].nbytes
    assert (await counters(ctx))[0] == h0  # the others were placed on trust
    for bid in (a, b):
        await ctx.release_buffer(bid)


async def test_a_full_write_log_makes_the_daemon_hash_again(ctx: rpcbuf.RpcContext) -> None:
    """More writes into the source (none touching a tensor) than its write log
    keeps: nothing is proved, so the daemon hashes the tensors once more (and
    finds them intact); with one of those writes over a tensor, that tensor
    is sent."""
    for hit in (False, True):
        m = model(seed=3 + hit)
        a, layout, _ = await upload(ctx, m)
        end = max(layout.values()) + SIZE * 4
        for k in range(WRITE_LOG + 1):
            at = layout[VICTIM] if hit and k == 0 else end + 64 * k
            await ctx.store_tensor(a, np.full(8, k, np.uint8), offset=at)
        h0, _ = await counters(ctx)
        b, _, got = await upload(ctx, m)
        assert (await counters(ctx))[0] > h0
        assert got["sent"] == (1 if hit else 0), got
        back = await ctx.load_tensors(b)
        for name, arr in m.items():
            np.testing.assert_array_equal(back[name], arr)
        await ctx.release_buffer(b)
        again = await ctx.store_tensors_dedup(a, m, offsets=layout)
        assert again["sent"] == (1 if hit else 0)
        await ctx.release_buffer(a)


async def test_a_swap_inside_one_buffer_verifies_what_it_overwrote(
        ctx: rpcbuf.RpcContext) -> None:
    """Two tensors of one size swapped in place by one dedup placement: the
    first copy overwrites the second one's source, so that one is hashed after
    it lands, found wrong, and sent; never placed on trust."""
    rng = np.random.default_rng(5)
    x, y = (rng.standard_normal(SIZE, dtype=np.float32) for _ in range(2))
    a, layout, _ = await upload(ctx, {"x": x, "y": y})
    await index_now(ctx)
    got = await ctx.store_tensors_dedup(a, {"p": y, "q": x},
                                        offsets={"p": layout["x"], "q": layout["y"]})
    assert got["placed"] + got["sent"] == 2 and got["sent"] >= 1
    back = await ctx.load_tensors(a, ["p", "q"])
    np.testing.assert_array_equal(back["p"], y)
    np.testing.assert_array_equal(back["q"], x)
    await ctx.release_buffer(a)


async def test_load_model_reloads_send_nothing_hash_nothing_until_a_write(
        clean_pool: DaemonProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors, path = cached_model(tmp_path, monkeypatch)
    async with rpcbuf.Cluster.connect(clean_pool.addr, clean_pool.token("reload")) as cluster:
        ctx = cluster[clean_pool.addr]

        async def load(name: str) -> rpcbuf.LoadResult:
            return await rpcbuf.load_model(cluster, path, name=name, progress=False)

        first = await load("m")
        assert first.bytes_sent == first.bytes_total
        h0, _ = await counters(ctx)
        for name in ("m", "m2"):  # same name (in place), new name (copied)
            res = await load(name)
            assert res.bytes_sent == 0
        assert (await counters(ctx))[0] == h0
        # one tensor of m's buffer written behind the loader's back
        m_buf = next(b for b in await ctx.list_buffers() if b["name"] == "m/slot0")
        entry = m_buf["tensors"]["model.layers.1.mlp.up_proj.weight"]
        await ctx.clear_buffer(str(m_buf["buffer_id"]), 0, offset=entry["offset"], nbytes=2)
        await rpcbuf.unload_model(cluster, "m2")
        third = await load("m3")  # m3 copies from m, whose tensor changed: it travels
        assert third.bytes_sent == entry["nbytes"]
        fixed = await load("m")  # m gets it back from m3, which holds it now
        assert fixed.bytes_sent == 0
        for name in ("m", "m3"):
            buf = next(b for b in await ctx.list_buffers() if b["name"] == f"{name}/slot0")
            back = await ctx.load_tensors(str(buf["buffer_id"]))
            for n, arr in tensors.items():
                np.testing.assert_array_equal(back[n].view(np.uint8), arr.view(np.uint8))
            await rpcbuf.unload_model(cluster, name)
