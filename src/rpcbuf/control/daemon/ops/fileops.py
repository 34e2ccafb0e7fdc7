"""Node-local load: ``load_file`` reads a model file of the node's own
``--model-dir`` straight into a tenant's buffer, verifying every tensor.

1. the items are checked as a ``dedup_store``'s (sorted, disjoint, within
   the buffer, the manifest and the quota, inside the file's size);
2. the file is opened through ``ModelFiles`` (confined to the model
   directories: FORBIDDEN, NOT_FOUND), off the loop;
3. every item must be exactly one tensor of the file's own header, by name
   and byte range (VERIFY_FAILED naming the first that differs), so a
   tenant can only ask whether a whole tensor has a hash, never probe bytes;
4. the pipeline pins the buffer and locks the items' hull; items already in
   place (indexed there with the same hashes) are skipped, the rest read
   in file order and hashed as they land, under the transfer deadline;
5. only when every item matched are the entries recorded and indexed;
   otherwise every range written is zeroed again before the lock drops, and
   VERIFY_FAILED never says what the node's copy holds (not even its hash).

Every load, refusals too, is audited.  A read once started is waited for
to its end, even when the task is cancelled (it may still write).
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from rpcbuf.control.daemon.accounting.registry import Buffer
from rpcbuf.control.daemon.content.modeldirs import ModelFiles, OpenedFile
from rpcbuf.control.daemon.data.paths import outlast
from rpcbuf.control.daemon.data.pipeline import Call, Ops, Pipeline, Plan, check_items
from rpcbuf.control.daemon.ops import manifest as M
from rpcbuf.control.daemon.ops.dedupops import DedupHandlers
from rpcbuf.control.daemon.ops.node import Node
from rpcbuf.control.formats.modelheaders import Ranges
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import (
    BadRequest,
    ConnectionLost,
    Forbidden,
    RpcBufError,
    Timeout,
    VerifyFailed,
)
from rpcbuf.control.wire.manifest import Packed
from rpcbuf.dataplane.copypool import CopyJob
from rpcbuf.dataplane.devops import fill
from rpcbuf.dataplane.fileread import Item, Outcome, ReadStopped, read_ranges


class _Items:
    """A ``load_file`` request's items, checked (step 1)."""

    def __init__(self, req: P.LoadFile, buf: Buffer, ops: Ops) -> None:
        self.offsets, self.sizes = P.unpack_u64(req.offsets), P.unpack_u64(req.sizes)
        self.file_offsets = P.unpack_u64(req.file_offsets)
        sums, words = P.unpack_u64(req.checksums), P.unpack_u64(req.hashes)
        n = self.n = len(self.offsets)
        if not (len(self.sizes) == len(self.file_offsets) == len(sums) == n
                and len(words) == 2 * n):
            raise BadRequest(f"load_file: {n} offsets, {len(self.sizes)} sizes, "
                             f"{len(self.file_offsets)} file offsets, {len(sums)} checksums "
                             f"and {len(words) // 2} hashes do not match")
        check_items(buf, self.offsets, self.sizes)
        cols = M.check(req, self.sizes)
        assert cols is not None  # names are required
        self.cols: Packed = cols
        M.plan_record(ops.registry, buf, cols.names, self.offsets, self.sizes)
        if n:
            if (self.file_offsets > P.MAX_INT).any():
                raise BadRequest("load_file: file offsets must be below 2**63")
            ends = self.file_offsets + self.sizes  # no overflow: both < 2**63
            if int(ends.max()) > req.file_size:
                i = int(np.argmax(ends > req.file_size))
                raise BadRequest(f"load_file: tensor {cols.names[i]!r} ends at byte "
                                 f"{int(ends[i])}, past the file's {req.file_size} bytes")
        self.checksums = sums.tolist()
        self.digests = [int(lo) | int(hi) << 64 for lo, hi in
                        zip(words[0::2].tolist(), words[1::2].tolist(), strict=True)]
        self.nbytes = int(self.sizes.sum()) if n else 0
        self.hull = (int(self.offsets.min()), int((self.offsets + self.sizes).max())) \
            if n else (0, 0)
        self.file_order = np.argsort(self.file_offsets, kind="stable").tolist()

    def match(self, f: OpenedFile, layout: Ranges) -> None:
        """Step 3: every item is exactly one tensor of the node's copy."""
        names, fo, sz = self.cols.names, self.file_offsets, self.sizes
        for i in self.file_order:
            name, want = names[i], (int(fo[i]), int(fo[i] + sz[i]))
            got = layout.get(name)
            if got == want:
                continue
            # Not where the node's copy holds it, nor whether it has it:
            # that is the file's header, which the tenant may not read.
            raise VerifyFailed(f"{f.name}: tensor {name!r} differs on this node: the "
                               f"driver's copy has it at bytes [{want[0]}, {want[1]}), this "
                               "node's copy does not",
                               {"path": f.name, "tensor": name, "reason": "layout"})


class FileOps:
    """The ``load_file`` op of one session; ``stop`` is set when the session
    closes (reads stop at their next chunk)."""

    def __init__(self, ops: Ops, pipeline: Pipeline, node: Node, stop: threading.Event,
                 pending: DedupHandlers) -> None:
        self._ops, self._pipe, self._node, self._stop = ops, pipeline, node, stop
        self._pending = pending

    async def load_file(self, call: Call, req: P.LoadFile) -> dict[str, Any]:
        deadline = time.monotonic() + self._node.limits.transfer_timeout
        files = self._node.model_files
        if files is None:
            raise Forbidden("this node serves no model directories: node-local loads need "
                            "rpcbufd --model-dir DIR", {"reason": "no_model_dirs"})
        buf = call.held.get(req.buffer_id)  # pinned before the first await
        items = _Items(req, buf, self._ops)
        where = {"file": req.path}
        try:
            f, layout = await self._in_thread(files, files.prepare, req.path, req.file_size,
                                              deadline=deadline)
        except RpcBufError:
            self._audit(buf, items, where)
            raise
        where["real"] = f.real
        try:
            items.match(f, layout)
            await self._pending.index_pending(call.held)  # an upload's last batches, too
            return await self._load(call, buf, items, files, f, deadline, where)
        except RpcBufError:
            self._audit(buf, items, where)
            raise
        finally:
            os.close(f.fd)

    async def _load(self, call: Call, buf: Buffer, items: _Items, files: ModelFiles,
                    f: OpenedFile, deadline: float, where: dict[str, str]) -> dict[str, Any]:
        """Steps 4 and 5, under the pipeline's pin and lock."""
        index, tenant, arena = self._ops.content, self._ops.owner, buf.pool.arena
        offsets, sizes, names = items.offsets, items.sizes, items.cols.names
        kept: list[int] = []
        borrowed: set[int] = set()
        got = Outcome()

        async def move() -> None:
            for i in range(items.n):  # in place and unwritten since it was verified
                loc = index.lookup(tenant, items.digests[i], int(sizes[i]), items.checksums[i],
                                   (buf, int(offsets[i])))
                if loc is not None and index.in_place(loc, buf, int(offsets[i])):
                    kept.append(i)
                    if loc.buf is not buf:  # its clone's entry: index it here too
                        borrowed.add(i)
            keep = set(kept)
            todo = [i for i in items.file_order if i not in keep]
            index.forget(buf, [(int(offsets[i]), int(offsets[i] + sizes[i])) for i in todo])
            if not todo:  # all in place: no trip to a thread
                return
            await self._pipe.own(buf)  # a clone gets memory of its own before it is written
            reads = [Item(int(items.file_offsets[i]), int(sizes[i]), buf.offset + int(offsets[i]),
                          items.digests[i], items.checksums[i]) for i in todo]
            out, error = await self._in_thread(files, _read, f.fd, arena, reads, deadline,
                                               self._stopping, deadline=deadline)
            got.nbytes = out.nbytes
            if error is None and out.bad is None:
                return
            # Not all verified: every range written was zeroed again (in ``_read``);
            # entries whose bytes that overwrote no longer hold.
            M.drop_written(self._ops.registry, buf,
                           [(a - buf.offset, b - buf.offset) for a, b in out.written])
            raise self._failure(f, out, error, [names[i] for i in todo])

        async def after() -> dict[str, Any]:
            entries = items.cols.entries(offsets, sizes, items.checksums)
            result: dict[str, Any] = {"nbytes": items.nbytes, "items": items.n,
                                      "read": got.nbytes, "in_place": len(kept)}
            if items.n:
                M.record(self._ops.registry, buf, entries, items.hull)
                for i in range(items.n):
                    if sizes[i] and (i not in kept or i in borrowed):
                        loc = index.add(buf, int(offsets[i]), int(sizes[i]), items.digests[i],
                                        items.checksums[i])
                        if loc is not None:
                            index.keep_on_disk(self._ops.registry, self._ops.sweeps, loc)
            result["manifest_version"] = buf.manifest_version
            job.nbytes = got.nbytes
            job.note = _note(where, items.n, got.nbytes, len(kept))
            return result

        job = Plan("load_file", buf, [items.hull], exclusive=True, forget=False, move=move,
                   after=after, nbytes=0, counter="bytes_loaded_local",
                   offset=items.hull[0], note=_note(where, items.n, 0, 0))
        try:
            return await self._pipe.run(call, job)
        finally:
            where["read"] = str(got.nbytes)

    def _failure(self, f: OpenedFile, out: Outcome, error: BaseException | None,
                 names: list[str]) -> RpcBufError:
        if isinstance(error, ReadStopped):
            if self._stop.is_set() or self._node.stopped:
                return ConnectionLost("the session closed while its load was read")
            return Timeout(f"{f.name}: reading this node's copy took longer than "
                           f"{self._node.limits.transfer_timeout:g}s; nothing was recorded",
                           {"path": f.name})
        if error is not None:
            reason = getattr(error, "strerror", None) or str(error)
            return VerifyFailed(f"{f.name}: reading this node's copy failed: {reason}; "
                                "nothing was recorded", {"path": f.name, "reason": "read"})
        assert out.bad is not None
        self._ops.count("verify_failures", 1)
        name = names[out.bad]
        if out.ended_at is not None:
            return VerifyFailed(f"{f.name}: this node's copy ends inside tensor {name!r} (at "
                                f"byte {out.ended_at}); nothing was recorded",
                                {"path": f.name, "tensor": name, "reason": "size"})
        return VerifyFailed(f"{f.name}: tensor {name!r} differs on this node (its hash is not "
                            "the one the driver expects); nothing was recorded",
                            {"path": f.name, "tensor": name, "reason": "hash"})

    def _stopping(self) -> bool:
        return self._stop.is_set() or self._node.stopped

    async def _in_thread(self, files: ModelFiles, fn: Callable[..., Any], *args: Any,
                         deadline: float) -> Any:
        """``fn(*args)`` in a thread of ``files.pool``; waited for to its end once
        it started (see the module docstring), written off past ``deadline``
        (so a read stuck in the file system frees its place in the pool)."""
        if self._stopping():
            raise ConnectionLost("the session is closing")
        pool = files.pool
        job: CopyJob = pool.submit(self._ops.owner, fn, *args)
        stuck = asyncio.get_running_loop().call_later(
            max(0.0, deadline - time.monotonic()), pool.written_off, job)
        try:
            return await asyncio.shield(job.future)
        finally:
            stuck.cancel()
            if not job.future.done() and not pool.cancel(job):
                await outlast(job.future, lambda: self._node.stopped)

    def _audit(self, buf: Buffer, items: _Items, where: dict[str, str]) -> None:
        """The audit record of a load that failed after its buffer was found."""
        self._ops.audit("load_file", buf, items.hull[0], int(where.get("read", 0)),
                        _note(where, items.n, int(where.get("read", 0)), 0))


def _note(where: dict[str, str], n: int, read: int, in_place: int) -> str:
    real = where.get("real")
    shown = where["file"] if real is None or real == where["file"] else \
        f"{where['file']} ({real})"
    return f"file={shown} items={n} read={read} in_place={in_place}"


def _read(fd: int, arena: Any, reads: list[Item], deadline: float,
          stopping: Callable[[], bool]) -> tuple[Outcome, BaseException | None]:
    """In a pool thread: read and verify; on any failure zero what was written."""
    out, error = Outcome(), None
    try:
        read_ranges(fd, arena, reads, out, deadline=deadline, stopped=stopping)
    except (ReadStopped, OSError) as exc:
        error = exc
    if error is not None or out.bad is not None:
        for a, b in out.written:
            fill(arena, arena.view(a, b - a), 0)
    return out, error
