"""Same-host block puts and gets in place: the client copies straight into its
pending slots and out of its blocks, through its own mapping of its
tenant's segments; the daemon moves no byte.

A put is ``block_place`` (pending slots held for the session under a
lease) then ``block_commit`` (hash what the client copied, off the loop,
and commit only if every hash matches); a mismatch, an ``abort`` or the
session's end hands the slots back, so a put stays all or nothing.  A get
is ``block_locate``: all or nothing, its blocks pinned under a lease until
``block_unpin`` or the session's end.  Segments leave only to their own
tenant (``AttachOps.hand_segments``).  At most ``MAX_LEASES`` per session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rpcbuf.control.daemon.accounting.registry import Buffer, Pool
from rpcbuf.control.daemon.content.blocks import BlockStore
from rpcbuf.control.daemon.data.pipeline import Call, Ops
from rpcbuf.control.daemon.ops.attachops import AttachOps
from rpcbuf.control.daemon.ops.blockops import MAX_MISSING, BlockHandlers
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, NotFound, QuotaExceeded

MAX_LEASES = 64  # leases a session holds at once (a client has one per call in flight)


@dataclass
class Lease:
    put: bool  # pending slots of a put (else: blocks pinned for a get)
    bufs: list[Buffer]
    keys: list[str]
    sizes: list[int]
    pool: Pool


class InPlace:
    """One session's in-place puts and gets, and their leases."""

    def __init__(self, ops: Ops, blocks: BlockStore, block_ops: BlockHandlers,
                 segments: AttachOps) -> None:
        self._ops, self._blocks, self._bops, self._segs = ops, blocks, block_ops, segments
        self._leases: dict[int, Lease] = {}
        self._next = 0

    async def place(self, call: Call, req: P.BlockPlace) -> dict[str, Any]:
        self._segs.check_same_host()
        keys, sizes = req.keys, P.unpack_u64(req.sizes).tolist()
        n = len(keys)
        if len(sizes) != n:
            raise BadRequest(f"{n} keys and {len(sizes)} sizes")
        if len(set(keys)) != n:
            raise BadRequest("a block_place names each key once")
        if min(sizes) <= 0:
            raise BadRequest("every block holds at least one byte")
        pool = self._ops.registry.pool_for(req.device_type, req.device)
        if pool.arena.address is None:
            raise BadRequest(f"blocks live in host memory; {pool.key} is device memory",
                             {"reason": "device_memory"})
        self._room()
        bufs = await self._bops._allocate(call, pool, sizes)  # pinned by the request
        registry, pinned = self._ops.registry, 0
        try:
            await self._bops._prepare(bufs)
            for buf in bufs:  # and by the lease, past this request
                registry.pin(buf)
                pinned += 1
            answer = await self._where(call, bufs)
        except BaseException:
            self._blocks.discard(bufs)
            for buf in bufs[:pinned]:
                registry.unpin(buf)
            raise
        return {**answer, "lease": self._lease(Lease(True, bufs, keys, sizes, pool))}

    async def commit(self, call: Call, req: P.BlockCommit) -> dict[str, Any]:
        lease = self._leases.get(req.lease) if type(req.lease) is int else None
        if lease is None or not lease.put:
            raise NotFound(f"this session holds no put lease {req.lease!r}")
        del self._leases[req.lease]
        bufs, sizes, n = lease.bufs, lease.sizes, len(lease.bufs)
        for buf in bufs:  # the request holds them too, as a put's (``BlockStore.commit``)
            call.held.keep(buf)
        try:
            if req.abort:
                return {"blocks": 0, "nbytes": 0}
            sums = P.unpack_u64(req.checksums)
            if len(sums) != n:
                raise BadRequest(f"{len(sums)} checksums for {n} blocks")
            if req.metas is not None and len(req.metas) != n:
                raise BadRequest(f"{len(req.metas)} metas for {n} blocks")
            if req.ttl is not None and req.ttl <= 0:
                raise BadRequest("ttl must be positive")

            async def there() -> None:  # the client copied them in already
                pass

            # The one way a put ends (hashed, compared, committed, counted, audited).
            return await self._bops.commit_put(call, lease.pool, lease.keys, bufs, sizes, sums,
                                               req.metas, req.ttl, there,
                                               f"blocks={n} in_place")
        finally:
            self._end(lease)

    async def locate(self, call: Call, req: P.BlockLocate) -> dict[str, Any]:
        self._segs.check_same_host()
        keys, sizes = req.keys, P.unpack_u64(req.sizes).tolist()
        n = len(keys)
        if len(sizes) != n:
            raise BadRequest(f"{n} keys and {len(sizes)} sizes")
        if len(set(keys)) != n:
            raise BadRequest("a block_locate names each key once")
        self._room()
        tenant = self._ops.owner
        found = [self._blocks.lookup(tenant, k, touch=False) for k in keys]
        blocks = [b for i, b in enumerate(found) if b is not None and b.nbytes == sizes[i]]
        if len(blocks) < n:
            missing = [i for i, b in enumerate(found) if b is None or b.nbytes != sizes[i]]
            self._blocks.count(tenant, "misses", len(missing))
            raise NotFound(f"{len(missing)} of {n} blocks are not here (or of another size)",
                           {"missing": missing[:MAX_MISSING],
                            "sizes": [None if found[i] is None else found[i].nbytes  # type: ignore[union-attr]
                                      for i in missing[:MAX_MISSING]]})
        bufs = [b.buf for b in blocks]
        for buf in bufs:  # pinned now, before the first await
            call.held.keep(buf)
        answer = await self._where(call, bufs)
        registry = self._ops.registry
        for buf in bufs:  # and by the lease, until the client has copied
            registry.pin(buf)
        self._blocks.touch(tenant, blocks)
        self._blocks.count(tenant, "hits", n)
        nbytes = sum(sizes)
        self._ops.count("bytes_read", nbytes)
        lease = self._lease(Lease(False, bufs, list(keys), sizes, bufs[0].pool))
        return {**answer, "lease": lease, "blocks": n, "nbytes": nbytes}

    def unpin(self, req: P.BlockUnpin) -> dict[str, Any]:
        lease = self._leases.get(req.lease) if type(req.lease) is int else None
        if lease is None or lease.put:
            raise NotFound(f"this session holds no get lease {req.lease!r}")
        del self._leases[req.lease]
        self._end(lease)
        return {}

    def close(self) -> None:
        """The session ends: a put's pending slots go back, a get's pins end."""
        leases, self._leases = self._leases, {}
        for lease in leases.values():
            self._end(lease)

    def _room(self) -> None:
        if len(self._leases) >= MAX_LEASES:
            raise QuotaExceeded(f"a session holds at most {MAX_LEASES} block leases",
                                {"limit": "block_leases"})

    def _lease(self, lease: Lease) -> int:
        self._next += 1
        self._leases[self._next] = lease
        return self._next

    def _end(self, lease: Lease) -> None:
        if lease.put:
            self._blocks.discard(lease.bufs)  # those not committed, freed at the last unpin
        registry = self._ops.registry
        for buf in lease.bufs:
            registry.unpin(buf)

    async def _where(self, call: Call, bufs: list[Buffer]) -> dict[str, Any]:
        """Where each block lies: its segment (handed to the session if it
        was not yet) and its offset in it."""
        segs = [b.segment for b in bufs]
        if any(s is None for s in segs):  # a bug: every block lies in a segment
            raise RuntimeError("a block outside any segment")
        ids, which, maps = await self._segs.hand_segments(call, segs)  # type: ignore[arg-type]
        offsets = [b.offset - s.offset for b, s in zip(bufs, segs, strict=True)]  # type: ignore[union-attr]
        return {"segments": ids, "which": P.pack_u64(which), "offsets": P.pack_u64(offsets),
                "maps": maps}
