"""The data ops: store, read, their batched forms, wire-fp16 stores, and the
daemon-local clear and copy.  Each validates its request and says, as a
``Plan``, what to lock, how to move the bytes and what to check after; a
plain store or read is a batch of one item.  Validation (and the path's
``admit``) happens before anything is locked; a refused store drains what
the client already sent, so the sender never hangs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from rpcbuf.control.daemon.accounting.registry import Buffer
from rpcbuf.control.daemon.data.paths import DataPath, Region, Scratch, TransferItems
from rpcbuf.control.daemon.data.pipeline import (
    Call,
    Ops,
    Pipeline,
    Plan,
    check_items,
    check_range,
    hull,
)
from rpcbuf.control.daemon.ops import manifest as M
from rpcbuf.control.daemon.ops.dedupops import DedupHandlers
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, RpcBufError, VerifyFailed
from rpcbuf.control.wire.gpuops import check_wire_f16
from rpcbuf.control.wire.units import THREAD_BYTES
from rpcbuf.dataplane.arena import copy_between
from rpcbuf.dataplane.devops import fill, range_checksum, scratch, widen_f16

LANDING_MIN = THREAD_BYTES  # same-host stores from this size hash each part as it lands


class DataOps:
    """The data ops of one session (``ops``), run by ``pipeline``."""

    def __init__(self, ops: Ops, pipeline: Pipeline, indexer: DedupHandlers) -> None:
        self._ops, self._pipe, self._indexer = ops, pipeline, indexer

    # -- store ------------------------------------------------------------------------

    async def store(self, call: Call, req: P.Store) -> dict[str, Any]:
        path = self._ops.path(req)
        try:
            buf = call.held.get(req.buffer_id)
            check_range(buf, req.offset, req.nbytes)
            if req.verify == "checksum" and req.checksum is None:
                raise BadRequest("verify='checksum' needs the client's checksum")
            if req.wire_dtype is not None:
                check_wire_f16(buf.pool.arena, buf.offset, req.offset, req.nbytes)
            path.check(buf)
            # What the path can tell before anything is locked (a bad stage,
            # a frame's byte count): refused here, it leaves no trace.  A
            # wire-fp16 store's items land at the start of scratch memory.
            if req.wire_dtype is not None:
                items = TransferItems.one(0, req.nbytes // 2, req.stage)
            else:
                items = TransferItems.one(req.offset, req.nbytes, req.stage)
            path.admit(items)
        except RpcBufError:
            if req.nbytes:
                await path.drain(call.req_id, TransferItems.one(req.offset, req.nbytes))
            raise
        move: Callable[[], Any]
        if req.wire_dtype is not None:
            def move() -> Any:
                return self._receive_f16(path, call.req_id, buf, req, items)
        else:
            region = Region(buf.pool.arena, buf.offset)

            def move() -> Any:
                return path.receive(call.req_id, region, items)

        async def after() -> dict[str, Any]:
            """After the bytes landed (range still locked): verify."""
            result: dict[str, Any] = {"nbytes": req.nbytes}
            if req.checksum is not None or req.verify:
                kind = req.checksum_kind or "xxh3"
                got = await self._pipe.in_thread(req.nbytes, range_checksum, buf.pool.arena,
                                                 buf.offset + req.offset, req.nbytes, kind)
                if req.verify == "checksum":
                    assert req.checksum is not None  # checked before anything was locked
                    self._verify(np.array([req.checksum], np.uint64), [got], kind)
                result |= {"checksum": got, "checksum_kind": kind}
            return result

        return await self._pipe.run(call, Plan(
            "store", buf, [(req.offset, req.offset + req.nbytes)], exclusive=True, move=move,
            nbytes=req.nbytes, counter="bytes_stored", after=after,
            note=f"wire={req.wire_dtype}" if req.wire_dtype else ""))

    def _verify(self, want: np.ndarray, got: list[int], kind: str) -> None:
        """Every store's check of what landed (``got``, hashed by us) against
        the client's checksums: VERIFY_FAILED, counted, naming what differs
        (one item: both checksums; more: which items)."""
        bad = np.flatnonzero(np.asarray(got, dtype=np.uint64) != want)
        if not len(bad):
            return
        self._ops.count("verify_failures", 1)
        if len(want) == 1:
            raise VerifyFailed("checksum of received bytes does not match",
                               {"expected": int(want[0]), "got": int(got[0]), "kind": kind})
        raise VerifyFailed(f"{len(bad)} of {len(want)} items do not match their checksums",
                           {"items": bad[:20].tolist()})

    async def _receive_f16(self, path: DataPath, req_id: int, buf: Buffer, req: P.Store,
                           items: TransferItems) -> None:
        """A wire-fp16 store: receive nbytes/2 bytes of float16 into scratch
        memory of the arena's kind, then widen them into the float32 slice."""
        if not req.nbytes:
            return
        arena = buf.pool.arena
        wire = scratch(arena, items.nbytes)
        await path.receive(req_id, Region(Scratch(wire)), items)
        await self._pipe.in_thread(req.nbytes, widen_f16, arena, buf.offset + req.offset, wire)

    async def store_batch(self, call: Call, req: P.StoreBatch) -> dict[str, Any]:
        path = self._ops.path(req)
        offsets, sizes = P.unpack_u64(req.offsets), P.unpack_u64(req.sizes)
        if len(offsets) != len(sizes):
            if not path.addressed:
                # We cannot know which messages the client sent: end the session,
                # which aborts the endpoint and with it any payload in flight.
                self._ops.abort("store_batch with offsets and sizes of different lengths")
            raise BadRequest("offsets and sizes differ in length")
        items = TransferItems(offsets, sizes, 0, req.stage)
        try:
            buf = call.held.get(req.buffer_id)
            check_items(buf, offsets, sizes)
            sums = _batch_checksums(req, len(offsets))
            cols = M.check(req, sizes)
            if cols is not None:  # refused now if the merged manifest would not fit
                M.plan_record(self._ops.registry, buf, cols.names, offsets, sizes)
            if req.manifest_version is not None and req.manifest_version != buf.manifest_version:
                raise BadRequest("the buffer's manifest changed since it was read",
                                 {"reason": "manifest_changed",
                                  "manifest_version": buf.manifest_version})
            path.check(buf)
            nbytes = items.nbytes = int(sizes.sum())
            path.admit(items)
        except RpcBufError:
            await path.drain(call.req_id, items)
            raise
        span = hull(offsets, sizes)
        arena, region = buf.pool.arena, Region(buf.pool.arena, buf.offset)
        verify = sums is not None and req.verify == "checksum"
        # What landed, hashed by us: compared with the client's checksums, and
        # what the manifest records (never a checksum we did not see match).
        hashing = verify or cols is not None
        # Recorded entries become dedup sources: their xxh3-128 is taken in the
        # same pass as the checksum (host memory), so nothing reads them again.
        with_digests = cols is not None and bool(cols.names) and M.host_arena(arena)
        at = offsets + np.uint64(buf.offset)  # in the arena
        # A big same-host batch: each part is hashed (and its entries made)
        # as soon as it has landed, while the rest still copies.
        landing = M.Landing(arena, at, sizes, cols, offsets, with_digests) \
            if path.lands_in_parts and hashing and nbytes >= LANDING_MIN else None
        messages = path.messages(items)

        async def move() -> None:
            await path.receive(call.req_id, region, items, landing)

        async def after() -> dict[str, Any]:
            got: list[int] | None = None
            digests: list[int] | None = None
            manifest: dict[str, dict[str, Any]] | None = None
            if landing is not None:
                got, manifest, digests = landing.sums, landing.entries(), landing.digests
            elif with_digests:
                got, digests = await self._pipe.in_thread(nbytes, M.range_digests, arena, at,
                                                          sizes)
            elif hashing:
                got = await self._pipe.in_thread(nbytes, arena.checksums, at, sizes)
            if verify:
                assert sums is not None and got is not None
                self._verify(sums, got, "xxh3")
            result: dict[str, Any] = {"nbytes": nbytes, "items": len(offsets),
                                      "messages": messages}
            if cols is not None and cols.names:
                assert got is not None
                if manifest is None:
                    manifest = cols.entries(offsets, sizes, got)
                result["dropped"] = M.record(self._ops.registry, buf, manifest, span,
                                             end=span[1])
                await self._indexer.stored(buf, manifest, digests)  # a dedup source now
                result["manifest_version"] = buf.manifest_version
                result["checksums"] = P.pack_u64(got)
            return result

        return await self._pipe.run(call, Plan(
            "store_batch", buf, [span], exclusive=True, move=move, nbytes=nbytes,
            counter="bytes_stored", after=after,
            note=f"items={len(offsets)} messages={messages}"))

    # -- read -------------------------------------------------------------------------

    async def read(self, call: Call, req: P.Read) -> dict[str, Any]:
        path = self._ops.path(req)
        items = TransferItems.one(req.offset, req.nbytes, req.stage)
        path.admit(items)  # a bad stage or an over-long inline read, whatever the buffer
        buf = call.held.get(req.buffer_id)
        check_range(buf, req.offset, req.nbytes)
        path.check(buf)
        region = Region(buf.pool.arena, buf.offset)
        answer = {"nbytes": req.nbytes}

        def move() -> Any:
            return path.send(call.req_id, region, items)

        async def after() -> dict[str, Any]:
            return {**answer, **path.carried()}  # inline: the bytes themselves

        return await self._pipe.run(call, Plan(
            "read", buf, [(req.offset, req.offset + req.nbytes)], exclusive=False, move=move,
            nbytes=req.nbytes, counter="bytes_read", after=after,
            early=answer if path.answer_first else None))

    async def read_batch(self, call: Call, req: P.ReadBatch) -> dict[str, Any]:
        offsets, sizes = P.unpack_u64(req.offsets), P.unpack_u64(req.sizes)
        if len(offsets) != len(sizes):
            raise BadRequest("offsets and sizes differ in length")
        buf = call.held.get(req.buffer_id)
        check_items(buf, offsets, sizes, disjoint=False)  # reads may overlap
        path = self._ops.path(req)
        path.check(buf)
        items = TransferItems(offsets, sizes, int(sizes.sum()), req.stage)
        path.admit(items)
        region = Region(buf.pool.arena, buf.offset)
        answer = {"nbytes": items.nbytes, "messages": path.messages(items)}

        def move() -> Any:
            return path.send(call.req_id, region, items)

        return await self._pipe.run(call, Plan(
            "read_batch", buf, [hull(offsets, sizes)], exclusive=False, move=move,
            nbytes=items.nbytes, counter="bytes_read", answer=answer,
            early=answer if path.answer_first else None, note=f"items={len(offsets)}"))

    # -- on the daemon, no network --------------------------------------------------------

    async def clear(self, call: Call, req: P.ClearBuffer) -> dict[str, Any]:
        buf = call.held.get(req.buffer_id)
        if req.value > 255:
            raise BadRequest(f"value must be a byte (0..255), got {req.value}")
        nbytes = buf.size - req.offset if req.nbytes is None else req.nbytes
        check_range(buf, req.offset, max(nbytes, 0))
        arena = buf.pool.arena

        def move() -> Any:
            view = arena.view(buf.offset + req.offset, nbytes)
            return self._pipe.in_thread(nbytes, fill, arena, view, req.value)

        return await self._pipe.run(call, Plan(
            "clear", buf, [(req.offset, req.offset + nbytes)], exclusive=True, move=move,
            nbytes=nbytes, answer={"nbytes": nbytes}, note=f"value={req.value}"))

    async def copy(self, call: Call, req: P.CopyBuffer) -> dict[str, Any]:
        src, dst = call.held.get(req.src_id), call.held.get(req.dst_id)
        check_range(src, req.src_offset, req.nbytes)
        check_range(dst, req.dst_offset, req.nbytes)

        def do_copy() -> None:
            copy_between(src.pool.arena, src.offset + req.src_offset,
                         dst.pool.arena, dst.offset + req.dst_offset, req.nbytes)

        def move() -> Any:
            return self._pipe.in_thread(req.nbytes, do_copy)

        return await self._pipe.run(call, Plan(
            "copy", dst, [(req.dst_offset, req.dst_offset + req.nbytes)], exclusive=True,
            sources=[(src, (req.src_offset, req.src_offset + req.nbytes))], move=move,
            nbytes=req.nbytes, answer={"nbytes": req.nbytes},
            note=f"from {src.buffer_id}+{req.src_offset}"))


def _batch_checksums(req: P.StoreBatch, n: int) -> np.ndarray | None:
    if req.checksums is None:
        if req.verify == "checksum":
            raise BadRequest("verify='checksum' needs the client's checksums")
        return None
    sums = P.unpack_u64(req.checksums)
    if len(sums) != n:
        raise BadRequest(f"{len(sums)} checksums for {n} items")
    return sums
