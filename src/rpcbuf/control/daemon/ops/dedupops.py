"""Content-hash dedup on the daemon: place tensors this tenant already holds.

``dedup_store`` carries manifest items with each one's xxh3-128 and
xxh3-64.  Each item whose content the tenant holds (a live buffer's index
entry, or the disk cache) is put in place locally and only then recorded;
the answer names the items placed, the client sends the rest.  An item
that fails verification is simply not placed.

What is trusted (why a re-load needs no hashing):

- an item still indexed at its very place once the locks are held: every
  writer forgets its range before its first byte moves, so an indexed entry
  is exactly what was hashed;
- a copy from an indexed source this op does not overwrite: the source is
  locked shared, and the copy is in-process; it gets the source's checksums;
- everything else (a source this op overwrote, bytes in place but no longer
  indexed, the disk cache) is hashed after it landed and placed only if it
  matches.

Locks are the pipeline's: the destination hull exclusive, each source range
shared, in buffer-id order; every buffer pinned before the first await.
``stored`` makes what ``store_batch`` recorded a dedup source (and, with
``--cache-dir``, writes it to the disk cache in the background).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from rpcbuf.control.daemon.accounting.registry import Buffer
from rpcbuf.control.daemon.content.index import Location, current
from rpcbuf.control.daemon.data.pipeline import (
    Call,
    Held,
    Ops,
    Pipeline,
    Plan,
    check_items,
    unlock,
)
from rpcbuf.control.daemon.ops import manifest as M
from rpcbuf.control.daemon.ops.mapops import seal
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, NotFound, UnsupportedDevice
from rpcbuf.dataplane.arena import copy_between, host_memory
from rpcbuf.dataplane.checksum import digest128, digests


class DedupHandlers:
    """The ``dedup_store`` op and the store-side indexing of one session."""

    def __init__(self, ops: Ops, pipeline: Pipeline) -> None:
        self._ops, self._pipe = ops, pipeline
        self._content = ops.content

    async def dedup_store(self, call: Call, req: P.DedupStore) -> dict[str, Any]:
        tenant = self._ops.owner
        buf = call.held.get(req.buffer_id)  # pinned before the first await
        await self._index_deferred(tenant, call.held)
        offsets, sizes = P.unpack_u64(req.offsets), P.unpack_u64(req.sizes)
        sums, words = P.unpack_u64(req.checksums), P.unpack_u64(req.hashes)
        n = len(offsets)
        if not (len(sizes) == len(sums) == n and len(words) == 2 * n):
            raise BadRequest(f"dedup_store: {n} offsets, {len(sizes)} sizes, {len(sums)} "
                             f"checksums and {len(words) // 2} hashes do not match")
        check_items(buf, offsets, sizes)
        cols = M.check(req, sizes)
        entries = {} if cols is None else cols.entries(offsets, sizes, sums.tolist())
        keys = [int(lo) | int(hi) << 64 for lo, hi in zip(words[0::2].tolist(),
                                                              words[1::2].tolist(), strict=True)]
        index, cache = self._content, self._content.cache
        plan: list[tuple[int, Location | None]] = []  # (item, source or None = disk cache)
        for i, (size, csum, digest) in enumerate(zip(sizes.tolist(), sums.tolist(), keys,
                                                     strict=True)):
            loc = index.lookup(tenant, digest, size, csum, (buf, int(offsets[i])))
            if loc is not None:
                plan.append((i, loc))
            elif cache is not None and cache.has(tenant, digest, size):
                plan.append((i, None))
        if not plan:  # nothing held: audited as what it touched, no bytes placed
            self._ops.audit("dedup_store", buf, int(offsets.min()) if n else 0, 0,
                            note=f"items={n} placed=0")
            return {"placed": P.pack_u64([]), "nbytes": 0, "copied": 0, "in_place": 0,
                    "from_cache": 0, "bytes_hashed": 0, "bytes_trusted": 0}
        hull = (int(offsets.min()), int((offsets + sizes).max()))
        sources = [(loc.buf, (loc.offset, loc.offset + loc.nbytes))
                   for _, loc in plan if loc is not None]
        arena, base = buf.pool.arena, buf.offset
        kept: set[int] = set()
        done: list[int] = []
        how = {"copied": 0, "in_place": 0, "from_cache": 0}
        hashed = [0, 0]  # bytes hashed to check a placement, bytes placed on trust

        host = M.host_arena(arena)
        trusted: set[int] = set()  # copies from sources this op leaves untouched

        def check(i: int, off: int, size: int, want: int) -> bool:
            """What landed at ``off`` has the item's checksum (and on host
            memory its xxh3-128 too, from the same pass)."""
            if not host:
                return bool(arena.checksum(base + off, size) == want)
            got = digests(arena.view(base + off, size))
            return got == (keys[i], want)

        def place() -> None:
            for i, loc in plan:
                off, size, want = int(offsets[i]), int(sizes[i]), int(sums[i])
                if i in kept:
                    done.append(i)
                    how["in_place"] += 1
                    continue
                if loc is None:
                    assert cache is not None
                    ok = cache.read_into(tenant, keys[i], want, arena.view(base + off, size))
                    hashed[0] += size  # the file's own hashes and the checksum, checked
                    kind = "from_cache"
                else:
                    same = loc.buf is buf and loc.offset == off
                    if not same:
                        copy_between(loc.buf.pool.arena, loc.buf.offset + loc.offset,
                                     arena, base + off, size)
                    if i in trusted:
                        ok = True
                        hashed[1] += size
                    else:
                        ok = check(i, off, size, want)
                        hashed[0] += size
                    kind = "in_place" if same else "copied"
                if ok:
                    done.append(i)
                    how[kind] += 1

        async def move() -> None:
            # Tensors already in place, still indexed (so unwritten since they were
            # hashed), need no work; everything else gets written: drop the index
            # entries it covers (before a byte moves), then copy.  A source still
            # indexed after that is untouched by this op and locked shared: its
            # copy is what was hashed (trusted); the others are hashed as they land.
            kept.update(i for i, loc in plan
                        if loc is not None and index.in_place(loc, buf, int(offsets[i])))
            index.forget(buf, [(int(offsets[i]), int(offsets[i] + sizes[i]))
                               for i, _ in plan if i not in kept])
            trusted.update(i for i, loc in plan if loc is not None and i not in kept
                           and index.holds(loc))
            moved = int(sum(int(sizes[i]) for i, _ in plan if i not in kept))
            if moved:  # a clone gets memory of its own before it is written
                await self._pipe.own(buf)
            await self._pipe.in_thread(moved, place)

        async def after() -> dict[str, Any]:
            if done:
                M.record(self._ops.registry, buf,
                         {req.names[i]: entries[req.names[i]] for i in done}, hull)
                for i in done:
                    loc_new = index.add(buf, int(offsets[i]), int(sizes[i]), keys[i],
                                        int(sums[i]))
                    if loc_new is not None:
                        index.keep_on_disk(self._ops.registry, self._ops.sweeps, loc_new)
            job.nbytes = int(sum(int(sizes[i]) for i in done))
            job.note = (f"items={n} placed={len(done)} copied={how['copied']} "
                        f"in_place={how['in_place']} from_cache={how['from_cache']} "
                        f"hashed={hashed[0]} trusted={hashed[1]}")
            self._ops.count("dedup_bytes_hashed", hashed[0])
            self._ops.count("dedup_bytes_trusted", hashed[1])
            return {"placed": P.pack_u64(done), "nbytes": job.nbytes, **how,
                    "bytes_hashed": hashed[0], "bytes_trusted": hashed[1]}

        job = Plan("dedup_store", buf, [hull], exclusive=True, sources=sources, forget=False,
                   move=move, after=after, nbytes=0, counter="bytes_deduped")
        return await self._pipe.run(call, job)

    async def clone(self, call: Call, req: P.CloneBuffer) -> dict[str, Any]:
        """``clone_buffer``: a new buffer with the source's size, bytes and manifest,
        mapping the source's memory (no copy); the source locked shared meanwhile,
        its index entries the clone's too.  Either gets memory of its own before
        its first write.  Host buffers only; OUT_OF_MEMORY when no block is free
        now (no waiting); quota and names as ``request_buffer``."""
        src = call.held.get(req.src_id)  # pinned before the first await
        if req.ttl is not None and req.ttl <= 0:
            raise BadRequest("ttl must be positive")
        if host_memory(src.pool.arena) is None:  # only host memory shares (Clones.share)
            raise UnsupportedDevice(f"buffers on {src.pool.key} cannot be cloned; "
                                    "request one and copy_buffer")
        await self._index_deferred(self._ops.owner, call.held)
        registry = self._ops.registry
        grants = await self._pipe.lock(call.held, src, [(0, src.alloc_size)], False,
                                       forget=False)
        try:
            if src.released:
                raise NotFound(f"no buffer {src.buffer_id!r}")
            seal(src)  # never share a memfd its owner writes
            new = registry.clone(src, name=req.name, ttl=req.ttl,
                                 session_id=self._ops.session_id)
            if new is None:
                raise registry.out_of_memory(src.pool, src.size)
            try:
                registry.charge_entries(new, len(src.tensors))
            except BaseException:
                registry.release(new)  # over quota with its manifest: as if never made
                raise
            new.tensors = {k: dict(v) for k, v in src.tensors.items()}
            new.tensors_end, new.trusted = src.tensors_end, src.trusted
            new.written = True  # the source's bytes: never taken for zeros (mapops)
            new.manifest_version = 1 if new.tensors else 0
            self._content.clone(src, new)
        finally:
            unlock(grants)
        if new.expires_at is not None:
            self._ops.schedule_expiry()
        self._ops.audit("clone_buffer", new, 0, new.size, note=f"from {src.buffer_id}")
        return new.meta()

    async def index_pending(self, held: Held) -> None:
        """Index what this session's tenant stored since its last dedup query
        (a node-local load looks for tensors already in place, too)."""
        await self._index_deferred(self._ops.owner, held)

    async def _index_deferred(self, tenant: str, held: Held) -> None:
        """Index what ``tenant`` stored since its last dedup query: what the index
        can prove unwritten goes in at once, the rest is hashed again under a
        shared lock and indexed only where it still matches.  Every buffer is
        pinned before the first await."""
        again = [(b, m) for b, m in self._content.index_deferred(tenant) if held.keep(b)]
        for buf, manifest in again:
            entries = current(buf, manifest)
            if not entries or buf.released:
                continue
            spans = [(e["offset"], e["offset"] + e["nbytes"]) for e in entries.values()]
            grants = await self._pipe.lock(held, buf, spans, exclusive=False, forget=False)
            try:
                live = current(buf, entries)
                arena = buf.pool.arena
                offs = np.array([buf.offset + e["offset"] for e in live.values()], np.int64)
                sizes = np.array([e["nbytes"] for e in live.values()], np.int64)
                self._ops.count("dedup_bytes_hashed", int(sizes.sum()))
                if M.host_arena(arena):
                    now, digs = await self._pipe.in_thread(int(sizes.sum()), M.range_digests,
                                                           arena, offs, sizes)
                    same = [(n, d) for (n, e), c, d in zip(live.items(), now, digs,
                                                           strict=True) if c == e["checksum"]]
                    await self._index_now(buf, {n: live[n] for n, _ in same},
                                          [d for _, d in same])
                else:
                    now = arena.checksums(offs, sizes)
                    await self._index_now(buf, {n: e for (n, e), c in zip(
                        live.items(), now, strict=True) if c == e["checksum"]})
            finally:
                unlock(grants)

    async def stored(self, buf: Buffer, manifest: dict[str, dict[str, Any]],
                     keys: list[int] | None = None) -> None:
        """Called by ``store_batch``, range still locked: without a disk cache the
        indexing waits for the tenant's next dedup query; with one, it is indexed
        and written behind at once."""
        if self._content.cache is None:
            self._content.defer(buf, manifest, keys)
            return
        await self._index_now(buf, manifest, keys)

    async def _index_now(self, buf: Buffer, manifest: dict[str, dict[str, Any]],
                         keys: list[int] | None = None) -> None:
        """Index freshly recorded manifest entries by the xxh3-128 of their bytes
        (called with their range locked): ``keys`` (their xxh3-128, aligned with the
        entries) when the caller hashed them, else hashed here."""
        items = [(e["offset"], e["nbytes"], e["checksum"]) for e in manifest.values()]
        keep = [i for i, (_, n, c) in enumerate(items) if c is not None and n > 0]
        if not keep:
            return
        arena, base = buf.pool.arena, buf.offset
        if keys is None:
            def hash_all() -> list[int]:
                return [digest128(arena.view(base + items[i][0], items[i][1])) for i in keep]

            got = await self._pipe.in_thread(sum(items[i][1] for i in keep), hash_all)
        else:
            got = [keys[i] for i in keep]
        index = self._content
        for i, d in zip(keep, got, strict=True):
            o, n, c = items[i]
            loc = index.add(buf, o, n, d, c)
            if loc is not None:
                index.keep_on_disk(self._ops.registry, self._ops.sweeps, loc)
