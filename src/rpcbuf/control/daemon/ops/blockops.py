"""The block ops of a session: put and get of keyed blocks over the session's
data path (one message or staging run per block, straight into or out of
the blocks' arena slices), and the quick lookup, remove and list.

Every bound is checked before any work.  ``put`` is two-phase: pending
slots of the tenant's segments (evicting its least recently used blocks,
a slice at a time), pinned, locked, zeroed or backed (``_prepare``); the
bytes land, every block is hashed and compared with the client's
checksums, and only then does ``commit`` make them the keys' blocks, all at
once.  A put that fails anywhere hands its slots back (no reader saw them);
a refused one drains what the client sent.

``get`` names each key once (else one request could send a block 4,096
times) and is all or nothing: a key with no block of the expected size is
NOT_FOUND (``details.missing``) before anything is locked or sent; its
blocks are pinned and read under shared locks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from rpcbuf.control.daemon.accounting import prefault
from rpcbuf.control.daemon.accounting.backing import zero_on_demand
from rpcbuf.control.daemon.accounting.registry import Buffer, Pool
from rpcbuf.control.daemon.content.blocks import Block, BlockStore
from rpcbuf.control.daemon.data.paths import Region, TransferItems
from rpcbuf.control.daemon.data.pipeline import Call, Ops, Pipeline, Plan
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, NotFound, RpcBufError, VerifyFailed

MAX_MISSING = 4096  # indices a NOT_FOUND names (a request has at most MAX_BLOCK_KEYS)
ALLOCATE_SLICE = 256  # blocks a put allocates between two turns of the event loop


class BlockHandlers:
    """The block ops of one session (``ops``) on the node's ``blocks``."""

    def __init__(self, ops: Ops, pipeline: Pipeline, blocks: BlockStore,
                 attach: Callable[[Call, Buffer], Awaitable[dict[str, Any]]]) -> None:
        self._ops, self._pipe, self._blocks = ops, pipeline, blocks
        self._attach = attach  # AttachOps.attach_buffer: the one attach path

    # -- put ------------------------------------------------------------------------------

    async def put(self, call: Call, req: P.BlockPut) -> dict[str, Any]:
        path = self._ops.path(req)
        keys, sizes = req.keys, P.unpack_u64(req.sizes).tolist()
        n = len(keys)
        if len(sizes) != n:
            if not path.addressed:
                # Which messages did the client send?  End the session: the
                # endpoint's abort takes whatever payload is in flight.
                self._ops.abort("block_put with keys and sizes of different lengths")
            raise BadRequest(f"{n} keys and {len(sizes)} sizes")
        # What the client sent, as the pipeline sees a batch: one run per block.
        sent = _each_alone([0] * n, sizes, req.stage)
        try:
            sums, pool = self._check_put(req, sizes)
            path.admit(sent)  # a bad stage, or too much for a small slot
            bufs = await self._allocate(call, pool, sizes)
        except RpcBufError:
            await path.drain(call.req_id, sent)
            raise
        try:
            await self._prepare(bufs)
        except BaseException:
            self._blocks.discard(bufs)
            raise
        items = _each_alone([b.offset for b in bufs], sizes, req.stage)

        async def move() -> None:
            await path.receive(call.req_id, Region(pool.arena), items)

        return await self.commit_put(call, pool, keys, bufs, sizes, sums, req.metas, req.ttl,
                                     move, f"blocks={n}")

    async def commit_put(self, call: Call, pool: Pool, keys: list[str], bufs: list[Buffer],
                         sizes: list[int], sums: np.ndarray, metas: list[bytes] | None,
                         ttl: float | None, move: Callable[[], Awaitable[None]],
                         note: str) -> dict[str, Any]:
        """A put's end, over the wire or in place, as one pipeline plan: ``move``
        lands the bytes, every block is hashed and compared with the client's
        checksums, and only then do the keys name them, all at once.  Any failure
        hands the pending blocks back (no reader saw them)."""
        n, nbytes = len(bufs), sum(sizes)
        leased = False

        async def land() -> None:
            await move()
            got = await self._pipe.in_thread(nbytes, pool.arena.checksums,
                                             [b.offset for b in bufs], sizes)
            bad = np.flatnonzero(np.asarray(got, dtype=np.uint64) != sums)
            if len(bad):
                self._ops.count("verify_failures", 1)
                raise VerifyFailed(f"{len(bad)} of {n} blocks do not match their checksums; "
                                   "none was stored", {"items": bad[:20].tolist()})

        async def commit() -> dict[str, Any]:
            nonlocal leased
            leased = self._blocks.commit(self._ops.owner, keys, bufs, sizes,
                                         [int(s) for s in sums],
                                         None if metas is None else list(metas), ttl)
            return {"blocks": n, "nbytes": nbytes}

        try:
            answer = await self._pipe.run(call, Plan(
                "block_put", bufs[0], [(0, bufs[0].alloc_size)], exclusive=True, more=bufs[1:],
                forget=False, move=land, after=commit, nbytes=nbytes, counter="bytes_stored",
                note=note))
        finally:
            self._blocks.discard(bufs)  # those not committed
        if leased:
            self._ops.schedule_expiry()
        return answer

    async def _prepare(self, bufs: list[Buffer]) -> None:
        """Before a byte lands: a segment on a kept block not zeroed yet is zeroed
        now, by this tenant, and waited for (the zeroer must not overwrite what
        lands); a new segment's pages are backed."""
        sweeps = self._ops.sweeps
        zeroing, fresh = self._blocks.to_prepare(bufs)
        for seg in zeroing:
            zero_on_demand(seg, sweeps)
        for seg in fresh:
            await prefault.populate(seg.pool.arena, seg.offset, seg.alloc_size, sweeps,
                                    seg.tenant)
        for seg in zeroing:
            if seg.zeroed is not None:
                await asyncio.wait([seg.zeroed])

    async def _allocate(self, call: Call, pool: Pool, sizes: list[int]) -> list[Buffer]:
        """The put's pending buffers, ``ALLOCATE_SLICE`` at a time with the loop let
        go between slices (a slice may make a segment or evict).  All or none; a
        batch that could never fit is refused first (nothing evicted).  Each
        buffer is pinned as it is made, before the next await."""
        owner = self._ops.owner
        self._blocks.admit(owner, pool, sizes)
        bufs: list[Buffer] = []
        try:
            for i in range(0, len(sizes), ALLOCATE_SLICE):
                if i:
                    await asyncio.sleep(0)  # pending buffers: in no key map, nobody's to take
                got = self._blocks.allocate_admitted(owner, pool, sizes[i:i + ALLOCATE_SLICE])
                for buf in got:
                    call.held.keep(buf)
                bufs += got
        except BaseException:
            self._blocks.discard(bufs)
            raise
        return bufs

    def _check_put(self, req: P.BlockPut, sizes: list[int]) -> tuple[np.ndarray, Pool]:
        """The put's bounds, before anything is allocated: BAD_REQUEST,
        UNSUPPORTED_DEVICE."""
        n = len(req.keys)
        if len(set(req.keys)) != n:
            raise BadRequest("a block_put names each key once")
        if min(sizes) <= 0:
            raise BadRequest("every block holds at least one byte")
        sums = P.unpack_u64(req.checksums)
        if len(sums) != n:
            raise BadRequest(f"{len(sums)} checksums for {n} blocks")
        if req.metas is not None and len(req.metas) != n:
            raise BadRequest(f"{len(req.metas)} metas for {n} blocks")
        if req.ttl is not None and req.ttl <= 0:
            raise BadRequest("ttl must be positive")
        pool = self._ops.registry.pool_for(req.device_type, req.device)
        if pool.arena.address is None:
            raise BadRequest(f"blocks live in host memory; {pool.key} is device memory",
                             {"reason": "device_memory"})
        return sums, pool

    # -- get ------------------------------------------------------------------------------

    async def get(self, call: Call, req: P.BlockGet) -> dict[str, Any]:
        path = self._ops.path(req)
        keys, sizes = req.keys, P.unpack_u64(req.sizes).tolist()
        n = len(keys)
        if len(sizes) != n:
            raise BadRequest(f"{n} keys and {len(sizes)} sizes")
        if len(set(keys)) != n:
            # Bounded work: a get sends each block once, so one request moves
            # at most the bytes the tenant holds (the client reads a key
            # named twice once and copies it: ``client/blockops.py``).
            raise BadRequest("a block_get names each key once")
        tenant = self._ops.owner
        # Not used yet (the LRU order stays) until the request is admitted:
        # a refusal leaves no trace.
        found = [self._blocks.lookup(tenant, k, touch=False) for k in keys]
        blocks = [b for i, b in enumerate(found) if b is not None and b.nbytes == sizes[i]]
        if len(blocks) < n:
            missing = [i for i, b in enumerate(found) if b is None or b.nbytes != sizes[i]]
            self._blocks.count(tenant, "misses", len(missing))
            raise NotFound(f"{len(missing)} of {n} blocks are not here (or of another size)",
                           {"missing": missing[:MAX_MISSING],
                            "sizes": [_size(found[i]) for i in missing[:MAX_MISSING]]})
        first = blocks[0].buf
        if any(b.buf.pool is not first.pool for b in blocks):
            raise BadRequest("the blocks of one block_get live on one device")
        path.check(first)
        offsets = [b.buf.offset for b in blocks]
        items = _each_alone(offsets, sizes, req.stage)
        nbytes = items.nbytes
        path.admit(items)  # a bad stage, or too much for a small slot
        for b in blocks:  # pinned now, before the first await
            call.held.keep(b.buf)
        self._blocks.touch(tenant, blocks)
        self._blocks.count(tenant, "hits", n)
        answer = {"blocks": n, "nbytes": nbytes}

        def move() -> Any:
            return path.send(call.req_id, Region(first.pool.arena), items)

        async def carried() -> dict[str, Any]:  # inline: the bytes themselves
            return {**answer, **path.carried()}

        return await self._pipe.run(call, Plan(
            "block_get", first, [(0, blocks[0].nbytes)], exclusive=False, move=move,
            sources=[(b.buf, (0, b.nbytes)) for b in blocks[1:]], nbytes=nbytes,
            counter="bytes_read", after=carried, early=answer if path.answer_first else None,
            note=f"blocks={n}"))

    # -- in place -------------------------------------------------------------------------

    async def attach(self, call: Call, req: P.BlockAttach) -> dict[str, Any]:
        """A same-host reader maps the block read-only (``attachops``): a hit
        served in place.  NOT_FOUND for a miss (counted as one)."""
        if not 0 < len(req.key) <= P.MAX_BLOCK_KEY:
            raise BadRequest(f"key must be 1 to {P.MAX_BLOCK_KEY} characters")
        tenant = self._ops.owner
        block = self._blocks.lookup(tenant, req.key, touch=False)
        if block is None:
            self._blocks.count(tenant, "misses", 1)
            raise NotFound("no block of that key", {"missing": [0]})
        call.held.keep(block.buf)  # pinned now, before the first await
        answer = await self._attach(call, block.buf)  # a refusal here leaves no trace
        self._blocks.touch(tenant, [block])
        self._blocks.count(tenant, "hits", 1)
        return {**answer, "size": block.nbytes, "meta": block.meta}

    # -- quick ops ------------------------------------------------------------------------

    def lookup(self, req: P.BlockLookup) -> dict[str, Any]:
        tenant = self._ops.owner
        found = [self._blocks.lookup(tenant, k) for k in req.keys]
        out: dict[str, Any] = {"sizes": [None if b is None else b.nbytes for b in found]}
        if req.meta:
            out["metas"] = [None if b is None else b.meta for b in found]
            out["expires_at"] = [None if b is None else b.expires_at for b in found]
        return out

    def remove(self, req: P.BlockRemove) -> dict[str, Any]:
        return {"removed": self._blocks.remove(self._ops.owner, req.keys)}

    def list(self, req: P.BlockList) -> dict[str, Any]:
        if not 0 < req.limit <= P.MAX_BLOCK_KEYS:
            raise BadRequest(f"limit must be 1 to {P.MAX_BLOCK_KEYS}, got {req.limit}")
        keys, more = self._blocks.keys(self._ops.owner, req.prefix, req.start_after, req.limit)
        return {"keys": keys, "more": more}


def _each_alone(offsets: list[int], sizes: list[int], stage: int | None) -> TransferItems:
    """Blocks as a batch's items, each its own run (one UCX message, tag
    ``run_tag(id, i)``): blocks never coalesce, even when their slices touch
    in the arena (the client cannot know where they lie)."""
    runs = [(o, s, i, i + 1) for i, (o, s) in enumerate(zip(offsets, sizes, strict=True))]
    return TransferItems(offsets, sizes, sum(sizes), stage, runs)


def _size(block: Block | None) -> int | None:
    return None if block is None else block.nbytes
