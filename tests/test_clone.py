"""``clone_buffer``: a second buffer over the same memory (no copy), each
given memory of its own before its first write, whoever writes it and
however many writers at once; and ``load_model`` under a new name cloning a
buffer that holds the model already.  Real daemons, real bytes over both
data paths."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rpcbuf
from conftest import DaemonProc
from models import cached_model, write_safetensors
from rpcbuf.control.wire import protocol as P
from test_reload import WRITERS, model, upload

pytestmark = pytest.mark.both_paths

MIB = 1 << 20


def memfd_inodes(d: DaemonProc) -> list[str]:
    """The inode of every ``rpcbuf-buffer`` memfd mapping in the daemon."""
    out = []
    with open(f"/proc/{d.proc.pid}/maps") as f:
        for line in f:
            if "memfd:rpcbuf-buffer" in line:
                out.append(line.split()[4])
    return out


def fd_inodes(d: DaemonProc) -> set[str]:
    """The inodes of the daemon's open memfds."""
    out = set()
    for fd in os.listdir(f"/proc/{d.proc.pid}/fd"):
        try:
            link = os.readlink(f"/proc/{d.proc.pid}/fd/{fd}")
            if link.startswith("/memfd:rpcbuf-buffer"):
                out.add(str(os.stat(f"/proc/{d.proc.pid}/fd/{fd}").st_ino))
        except OSError:
            pass  # closed meanwhile
    return out


async def test_a_clone_has_the_bytes_and_manifest_in_the_same_pages(
        ctx: rpcbuf.RpcContext, clean_pool: DaemonProc) -> None:
    m = model()
    a, layout, _ = await upload(ctx, m)
    before = memfd_inodes(clean_pool)
    b = await ctx.clone_buffer(a, name="copy-of-a")
    after = memfd_inodes(clean_pool)
    assert len(set(after)) == len(set(before))  # no new memfd: the clone maps a's
    assert len(after) == len(before) + 1
    ma, mb = await ctx.get_buffer_meta(a), await ctx.get_buffer_meta(b)
    assert mb["name"] == "copy-of-a" and mb["size"] == ma["size"]
    assert mb["tensors"] == ma["tensors"] and mb["tensors_end"] == ma["tensors_end"]
    back = await ctx.load_tensors(b)  # checksums verified on the way back
    for n, arr in m.items():
        np.testing.assert_array_equal(back[n], arr)
    # and a dedup re-load of the clone finds everything in place: nothing sent, nothing copied
    again = await ctx.store_tensors_dedup(b, m, offsets=layout)
    assert again["sent"] == 0 and again["placed"] == len(m)
    assert len(set(memfd_inodes(clean_pool))) == len(set(before))  # still shared
    for bid in (a, b):
        await ctx.release_buffer(bid)


@pytest.mark.parametrize("into", ["clone", "source"])
@pytest.mark.parametrize("writer", list(WRITERS))
async def test_a_write_into_either_leaves_the_other_as_it_was(
        ctx: rpcbuf.RpcContext, writer: str, into: str) -> None:
    m = model()
    a, layout, _ = await upload(ctx, m)
    b = await ctx.clone_buffer(a)
    target, other = (b, a) if into == "clone" else (a, b)
    await WRITERS[writer](ctx, target, layout["t2"])
    untouched = await ctx.load_tensors(other)  # checksums verified
    for n, arr in m.items():
        np.testing.assert_array_equal(untouched[n], arr)
    size = (await ctx.get_buffer_meta(a))["size"]
    changed = np.frombuffer(await ctx.read_buffer(target, 0, size), np.uint8)
    same = np.frombuffer(await ctx.read_buffer(other, 0, size), np.uint8)
    assert not np.array_equal(changed, same), "the write landed nowhere"
    for bid in (a, b):
        await ctx.release_buffer(bid)


async def test_many_writers_at_once_share_one_copy(ctx: rpcbuf.RpcContext,
                                                   clean_pool: DaemonProc) -> None:
    a = await ctx.request_buffer(16 * MIB)
    await ctx.clear_buffer(a, 0x11)
    b = await ctx.clone_buffer(a)
    chunks = [np.full(MIB, i + 1, np.uint8) for i in range(16)]
    await asyncio.gather(*(ctx.store_tensor(b, c, offset=i * MIB) for i, c in enumerate(chunks)))
    got = np.frombuffer(await ctx.read_buffer(b, 0, 16 * MIB), np.uint8).reshape(16, MIB)
    for i in range(16):
        assert (got[i] == i + 1).all(), f"chunk {i} lost"
    assert (np.frombuffer(await ctx.read_buffer(a, 0, 16 * MIB), np.uint8) == 0x11).all()
    inodes = memfd_inodes(clean_pool)
    assert len(inodes) == len(set(inodes))  # each maps its own memfd now
    for bid in (a, b):
        await ctx.release_buffer(bid)


@pytest.mark.parametrize("first", ["source", "clone"])
async def test_either_may_go_first_and_nothing_leaks(clean_pool: DaemonProc, first: str) -> None:
    async with clean_pool.connect("alice") as ctx:
        a = await ctx.request_buffer(4 * MIB)
        await ctx.clear_buffer(a, 0x42)
        before = Counter(memfd_inodes(clean_pool))
        b = await ctx.clone_buffer(a, ttl=60)
        grew = Counter(memfd_inodes(clean_pool)) - before
        assert len(grew) == 1 and sum(grew.values()) == 1  # one more mapping of one memfd
        (shared,) = grew
        assert before[shared] == 1 and shared in fd_inodes(clean_pool)  # a's own
        gone, kept = (a, b) if first == "source" else (b, a)
        await ctx.release_buffer(gone)
        assert (np.frombuffer(await ctx.read_buffer(kept, 0, 4 * MIB), np.uint8) == 0x42).all()
        await ctx.store_tensor(kept, np.zeros(8, np.uint8))  # writes fine alone, too
        assert (np.frombuffer(await ctx.read_buffer(kept, 0, 16), np.uint8)[8:] == 0x42).all()
        await ctx.release_buffer(kept)
        if first == "source":  # the clone got memory of its own: a's memfd is gone
            assert shared not in fd_inodes(clean_pool)
            assert shared not in memfd_inodes(clean_pool)


async def test_an_attached_clone_keeps_its_bytes_when_the_source_is_written(
        ctx: rpcbuf.RpcContext) -> None:
    if not ctx.same_host:
        pytest.skip("attach needs the same-host path")
    a = await ctx.request_buffer(MIB)
    await ctx.clear_buffer(a, 5)
    b = await ctx.clone_buffer(a)
    async with ctx.attach(b) as view:
        await ctx.clear_buffer(a, 6)  # the source gets its own memory first
        assert (view.array(0, MIB) == 5).all()
        with pytest.raises(rpcbuf.Busy):
            await ctx.clear_buffer(b, 7)
    assert (np.frombuffer(await ctx.read_buffer(a, 0, MIB), np.uint8) == 6).all()
    for bid in (a, b):
        await ctx.release_buffer(bid)


async def test_bad_clones_are_refused_and_leave_nothing(daemon_factory) -> None:  # type: ignore[no-untyped-def]
    d = daemon_factory("--device", "cpu:16MiB", "--quota", "carol:10MiB:4")
    # (on the network path: a same-host session's staging area counts against the quota)
    async with d.connect("carol", same_host=False) as c, d.connect("dave") as other:
        a = await c.request_buffer(4 * MIB, name="a")
        with pytest.raises(rpcbuf.NotFound):
            await other.clone_buffer(a)  # another tenant's buffer: not there for it
        with pytest.raises(rpcbuf.NotFound):
            await c.clone_buffer("b-nope")
        with pytest.raises(rpcbuf.BadRequest):
            await c.clone_buffer(a, name="a")  # a name taken
        with pytest.raises(rpcbuf.BadRequest):
            await c.clone_buffer(a, ttl=0)
        with pytest.raises(rpcbuf.BadRequest):
            await c._call(P.CloneBuffer(src_id=7, name=None, ttl=None))  # type: ignore[arg-type]
        b = await c.clone_buffer(a, name="b")
        with pytest.raises(rpcbuf.QuotaExceeded):
            await c.clone_buffer(a, name="c")  # 12 MiB: past carol's 10
        await c.release_buffer(b)
        fillers = [await other.request_buffer(8 * MIB), await other.request_buffer(4 * MIB)]
        with pytest.raises(rpcbuf.OutOfMemory):
            await c.clone_buffer(a, name="c")  # no block free: no waiting
        names = sorted(x["name"] or "" for x in await c.list_buffers())
        assert names == ["a"]  # the refused ones left no buffer, no name
        await other.release_buffer(fillers[1])
        c2 = await c.clone_buffer(a, name="c")  # the name is free again
        await c.release_buffer(c2)


async def test_load_model_under_a_new_name_clones(
        clean_pool: DaemonProc, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tensors, path = cached_model(tmp_path, monkeypatch)
    async with rpcbuf.Cluster.connect(clean_pool.addr, clean_pool.token("clone")) as cluster:
        ctx = cluster[clean_pool.addr]

        async def load(name: str, **kw: Any) -> rpcbuf.LoadResult:
            return await rpcbuf.load_model(cluster, path, name=name, progress=False, **kw)

        first = await load("m")
        assert first.bytes_sent == first.bytes_total and not first.buffers[0]["cloned"]
        inodes = set(memfd_inodes(clean_pool))
        second = await load("m2")
        assert second.bytes_sent == 0 and second.buffers[0]["cloned"]
        assert set(memfd_inodes(clean_pool)) == inodes  # no new memory
        again = await load("m2")  # a re-load of the clone, in place: still shared
        assert again.bytes_sent == 0 and set(memfd_inodes(clean_pool)) == inodes
        plain = await load("m3", hash_cache=False)  # the file hashed first, then cloned
        assert plain.bytes_sent == 0 and plain.buffers[0]["cloned"]
        # the same names, shapes and layout, other bytes (a fine-tune): never a clone
        other = {n: (a + 1).astype(a.dtype) for n, a in tensors.items()}
        other_path = write_safetensors(tmp_path / "tuned.safetensors", other)
        for cache in (True, False):
            tuned = await rpcbuf.load_model(cluster, other_path, name=f"tuned{cache}",
                                            progress=False, hash_cache=cache)
            assert not tuned.buffers[0]["cloned"] and tuned.bytes_sent == tuned.bytes_total
            buf = next(b for b in await ctx.list_buffers() if b["name"] == f"tuned{cache}/slot0")
            back = await ctx.load_tensors(str(buf["buffer_id"]))
            for n, arr in other.items():
                np.testing.assert_array_equal(back[n].view(np.uint8), arr.view(np.uint8))
            await rpcbuf.unload_model(cluster, f"tuned{cache}")
        # a write into m after the clone: m2 keeps the model
        m_buf = next(b for b in await ctx.list_buffers() if b["name"] == "m/slot0")
        entry = m_buf["tensors"]["model.layers.1.mlp.up_proj.weight"]
        await ctx.clear_buffer(str(m_buf["buffer_id"]), 0, offset=entry["offset"], nbytes=2)
        for name in ("m2", "m3"):
            buf = next(b for b in await ctx.list_buffers() if b["name"] == f"{name}/slot0")
            back = await ctx.load_tensors(str(buf["buffer_id"]))
            for n, arr in tensors.items():
                np.testing.assert_array_equal(back[n].view(np.uint8), arr.view(np.uint8))
        for name in ("m", "m2", "m3"):
            await rpcbuf.unload_model(cluster, name)


async def test_a_clone_of_a_buffer_the_index_forgot_still_reloads_in_place(
        ctx: rpcbuf.RpcContext, clean_pool: DaemonProc) -> None:
    """More live copies of a tensor than the index keeps places for
    (``MAX_LOCATIONS``): the oldest buffer's entries go, and a clone of it
    has none. A dedup re-load of that clone still finds every tensor in
    place (it maps the source's memory at the same offsets) instead of
    copying it from another copy, which would give it memory of its own."""
    from rpcbuf.control.daemon.content.index import MAX_LOCATIONS

    m = model()
    a, layout, _ = await upload(ctx, m)
    await ctx.store_tensors_dedup(await ctx.clone_buffer(a), m, offsets=layout)  # indexes a
    others = [await ctx.clone_buffer(a) for _ in range(MAX_LOCATIONS)]  # a's places go
    c = await ctx.clone_buffer(a)
    inodes = Counter(memfd_inodes(clean_pool))
    again = await ctx.store_tensors_dedup(c, m, offsets=layout)
    assert again["sent"] == 0 and again["placed"] == len(m)
    assert Counter(memfd_inodes(clean_pool)) == inodes  # no copy: c still maps a's memfd
    back = await ctx.load_tensors(c)
    for n, arr in m.items():
        np.testing.assert_array_equal(back[n], arr)
    for bid in (a, c, *others):
        await ctx.release_buffer(bid)
