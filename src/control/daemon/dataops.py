"""The session's data operations: store, read, their batched forms, and the
daemon-local clear and copy.

Every operation follows the same steps, so one path serves them all:

1. validate (buffer, ranges, manifest) — a refused store drains its payload
   with 1-byte receives, one per run (see ``runs.plan_runs``), so the
   sender never hangs and nothing is parked here;
2. pin the buffer (a release meanwhile frees the memory only afterwards);
3. lock the byte range it touches in the buffer (stores exclusive, reads
   shared: overlapping stores never interleave, a read never sees half a
   store, disjoint transfers run in parallel);
4. move the bytes under the transfer deadline: over UCX, one message per
   run, straight into or out of the arena slice; or, on a same-host session
   whose request carries the client's addresses (``addr``/``addrs``), copied
   by the daemon itself between the client's memory and the arena slice
   (``dataplane/cma.py``: process_vm_readv/writev, no socket);
5. verify, record the manifest, log, unlock, unpin.

A plain ``store``/``read`` is a batch of one run with tag = request id.

Pins by construction: an async handler never looks a buffer up itself; it
gets a ``Held`` from the session, whose ``get`` pins the buffer in the same
step as the lookup, and the session unpins everything the request held when
it is answered.  So no handler can hold a buffer across an ``await`` without
a pin (a released buffer keeps its memory until then), and a buffer whose
memory went back already cannot be pinned (``Registry.pin``).  Only
synchronous code (the quick ops) uses the plain lookup
``_get``; ``tests/test_pins.py`` checks that no ``async def`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from control.daemon import manifest as M
from control.wire import protocol as P
from control.wire.errors import (
    BadRequest,
    ConnectionLost,
    NotFound,
    OutOfRange,
    RpcBufError,
    VerifyFailed,
)
from control.wire.gpuops import check_wire_f16
from control.wire.runs import plan_runs, run_tag
from control.wire.units import THREAD_BYTES
from dataplane.arena import copy_between
from dataplane.cma import CmaError, Peer
from dataplane.devops import fill, range_checksum, scratch, widen_f16
from dataplane.ucx import DataEndpoint, TransferError, Truncated, transfer_all

if TYPE_CHECKING:
    from control.daemon.registry import Buffer, Registry
    from control.daemon.server import Daemon

log = logging.getLogger("rpcbuf.daemon")
CMA_INLINE = THREAD_BYTES  # same-host stores from this size hash each part as it lands
# The event loop blocks (GIL released) at most this long for a same-host copy
# of at most CMA_WAIT_BYTES to end on its copy thread, instead of a loop round
# trip (see copypool.CopyPool.wait); it never runs one itself.
CMA_WAIT, CMA_WAIT_BYTES = 300e-6, 256 << 10
Run = tuple[int, int, int, int]  # offset in buffer, nbytes, first item, stop item


class Held:
    """The buffers one async request uses: each pinned as it is looked up,
    all unpinned when the request ends (``release``, called by the session)."""

    __slots__ = ("_bufs", "_registry", "_tenant")

    def __init__(self, registry: Registry, tenant: str) -> None:
        self._registry = registry
        self._tenant = tenant
        self._bufs: list[Buffer] = []

    def get(self, buffer_id: str) -> Buffer:
        """The tenant's buffer, pinned until the request ends; NOT_FOUND."""
        buf = self._registry.get(self._tenant, buffer_id)
        self._registry.pin(buf)
        self._bufs.append(buf)
        return buf

    def keep(self, buf: Buffer) -> bool:
        """Pin a buffer found another way (the dedup index); False when it
        was released already (then it must not be used)."""
        if buf.released:
            return False
        self._registry.pin(buf)
        self._bufs.append(buf)
        return True

    def release(self) -> None:
        bufs, self._bufs = self._bufs, []
        for buf in reversed(bufs):
            self._registry.unpin(buf)


class DataOps:
    """Mixin for ``Session``: the operations that move or touch buffer bytes."""

    daemon: Daemon
    registry: Registry
    ep: DataEndpoint | None
    cma: Peer | None  # same-host sessions: the client process we copy from and to
    cma_stop: threading.Event  # set when the session closes: copies stop within a chunk
    tenant: str | None
    peer_gone: Callable[[], bool]
    session_id: str
    send: Callable[[dict[str, Any]], None]
    _get: Callable[[str], Buffer]
    _log: Callable[..., None]
    _count: Callable[[str, int], None]
    abort: Callable[[str], None]

    # -- shared steps -------------------------------------------------------------

    async def _index_stored(self, buf: Buffer, manifest: dict[str, dict[str, Any]]) -> None:
        """Hook for recorded manifest entries; ``DedupOps`` indexes them."""

    def _endpoint(self) -> DataEndpoint:
        if self.ep is None:
            raise BadRequest("no data endpoint is bound to this session")
        return self.ep

    def _path(self, addressed: bool) -> DataEndpoint | None:
        """The request's data path: the UCX endpoint, or None for the
        same-host path (the request carries the client's addresses)."""
        if not addressed:
            return self._endpoint()
        if self.cma is None:
            raise BadRequest("addresses are for same-host sessions only",
                             {"reason": "not_same_host"})
        return None

    @staticmethod
    def _host_base(buf: Buffer) -> int:
        """The address of ``buf``'s first byte, for same-host copies."""
        base = getattr(buf.pool.arena, "address", None)
        if base is None:
            raise BadRequest(f"same-host copies serve host buffers; {buf.buffer_id} is on "
                             f"{buf.pool.key}: use the UCX path", {"reason": "device_memory"})
        return int(base) + buf.offset

    async def _cma(self, write: bool, local: np.ndarray | list[int],
                   remote: np.ndarray | list[int], sizes: np.ndarray | list[int],
                   total: int, landed: Any = None) -> None:
        """A same-host copy (``write``: arena -> client), small or big, on the
        daemon's copy threads (``copypool``: bounded, fair between tenants),
        never on the event loop: the client chooses what backs its memory, and
        pages that never arrive (FUSE, userfaultfd) block the copy for good.
        Under the transfer deadline: past it the session is aborted, the copy
        stops at its next chunk (``cancelled``), and a copy stuck inside one
        system call is written off (its thread replaced).  A task cancelled
        meanwhile still waits for its copy: until the copy returns it may write
        into the arena range this task holds, so the range must stay locked
        and pinned (a copy that never returns keeps it so)."""
        self._cma_allowed()
        peer = self.cma
        assert peer is not None
        stop, timeout = self.cma_stop, self.daemon.limits.transfer_timeout
        ends = time.monotonic() + timeout

        def cancelled() -> bool:
            return stop.is_set() or time.monotonic() > ends

        pool = self.daemon.copies
        job = pool.submit(self.tenant or "", peer.write if write else peer.read,
                          local, remote, sizes, cancelled, landed)
        if total <= CMA_WAIT_BYTES and pool.wait(job, CMA_WAIT):  # a small copy, done
            error = job.future.exception()
            if isinstance(error, CmaError):
                raise self._cma_error(error) from error
            if error is not None:
                raise error
            return
        stuck = asyncio.get_running_loop().call_later(timeout, pool.written_off, job)
        try:
            await self._transfer([asyncio.shield(job.future)])
        except CmaError as exc:
            raise self._cma_error(exc) from exc
        finally:
            stuck.cancel()
            if not job.future.done() and not pool.cancel(job):
                await _outlast(job.future, lambda: self.daemon.stopped)

    def _cma_allowed(self) -> None:
        """No copy starts once the session is closing or its client has
        closed the connection (a request may have waited for its range lock
        for long; the client keeps its arrays only for a while after that)."""
        if self.cma_stop.is_set() or self.peer_gone():
            raise ConnectionLost("the session is closing")

    def _cma_error(self, exc: CmaError) -> RpcBufError:
        """EFAULT: the client named memory it does not have (BAD_REQUEST, the
        session goes on; part of the range may have been copied).  Anything
        else (the process exited, changed owner, or we were stopped): the
        session ends."""
        if exc.errno == errno.EFAULT:
            return BadRequest("an address range is not mapped (or not writable) in the "
                              "client's memory; part of the range may have been copied",
                              {"reason": "bad_address"})
        self.abort(f"same-host copy failed: {exc.strerror}")
        return ConnectionLost(f"same-host copy failed: {exc.strerror}")

    @staticmethod
    def _check_range(buf: Buffer, offset: int, nbytes: int) -> None:
        if offset > buf.size or nbytes > buf.size - offset:
            raise OutOfRange(
                f"[{offset}, {offset + nbytes}) is outside buffer of {buf.size} bytes",
                {"offset": offset, "nbytes": nbytes, "size": buf.size},
            )

    @staticmethod
    def _check_items(buf: Buffer, offsets: np.ndarray, sizes: np.ndarray,
                     disjoint: bool = True) -> None:
        if len(offsets) == 0:
            return
        if (offsets > P.MAX_INT).any() or (sizes > P.MAX_INT).any():
            raise BadRequest("offsets and sizes must be below 2**63")
        ends = offsets + sizes  # no overflow: both < 2**63
        if (ends > buf.size).any():
            i = int(np.argmax(ends > buf.size))
            raise OutOfRange(
                f"item {i} [{offsets[i]}, {ends[i]}) is outside buffer of {buf.size} bytes",
                {"item": i, "offset": int(offsets[i]), "nbytes": int(sizes[i]), "size": buf.size},
            )
        if disjoint and (offsets[1:] < ends[:-1]).any():
            raise BadRequest("batch items must be sorted by offset and must not overlap")
        # Bounded work: a batch moves at most its buffer's size (overlapping
        # reads count each time).  No overflow: each end is <= buf.size < 2**63
        # and there are at most MAX_ITEMS items.
        total = int(sizes.sum())
        if total > buf.size:
            raise BadRequest(f"a batch may move at most its buffer's {buf.size} bytes; these "
                             f"items add up to {total}", {"nbytes": total, "size": buf.size})

    @contextlib.asynccontextmanager
    async def _holding(self, buf: Buffer, ranges: list[tuple[int, int]],
                       exclusive: bool, forget: bool = True) -> AsyncIterator[None]:
        """Pin ``buf`` and lock ``ranges`` of it for the duration.  An exclusive
        lock drops the dedup index's entries of ``ranges`` (``forget=False``:
        the caller drops what it writes itself).  A buffer released since it
        was looked up (or while we wait for the lock) is NOT_FOUND: its memory
        is only pinned, and the work would be lost."""
        if buf.released:
            raise NotFound(f"no buffer {buf.buffer_id!r}")
        self.registry.pin(buf)
        try:
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[None] = loop.create_future()

            def ready() -> None:
                if not fut.done():
                    fut.set_result(None)

            grant = buf.locks.acquire(ranges, exclusive, ready)
            try:
                if not grant.granted:
                    await fut
                    if buf.released:  # released while we waited: its memory is only pinned
                        raise NotFound(f"no buffer {buf.buffer_id!r}")
                if exclusive and forget:  # these bytes are about to change: dedup must not use them
                    self.daemon.content.forget(buf, ranges)
                yield
            finally:
                buf.locks.release(grant)
        finally:
            self.registry.unpin(buf)

    @contextlib.asynccontextmanager
    async def _holding_all(self, dst: Buffer, dst_ranges: list[tuple[int, int]],
                           sources: list[tuple[Buffer, tuple[int, int]]],
                           forget: bool = True) -> AsyncIterator[None]:
        """Lock ``dst_ranges`` of ``dst`` exclusively and each source range
        shared: one grant per buffer (a source inside ``dst`` joins its
        exclusive grant), taken in buffer-id order so that crossing copies
        cannot deadlock.  Every buffer is pinned first, before any await, so
        none is freed while we wait for another's lock."""
        ranges: dict[str, tuple[Buffer, list[tuple[int, int]]]] = {
            dst.buffer_id: (dst, list(dst_ranges))}
        for b, rng in sources:
            ranges.setdefault(b.buffer_id, (b, []))[1].append(rng)
        bufs = [b for b, _ in ranges.values()]
        for b in bufs:
            self.registry.pin(b)
        try:
            async with contextlib.AsyncExitStack() as stack:
                for bid in sorted(ranges):
                    b, rngs = ranges[bid]
                    await stack.enter_async_context(
                        self._holding(b, rngs, exclusive=b is dst, forget=forget))
                yield
        finally:
            for b in bufs:
                self.registry.unpin(b)

    async def _transfer(self, coros: Sequence[Awaitable[None]]) -> None:
        """Run transfers (UCX requests, same-host copy threads) under the
        transfer deadline and wait for *all* of them, even when one fails:
        each may still touch memory until it ends.  Past the deadline the
        session is aborted (its endpoint with it)."""
        await transfer_all(coros, self.daemon.limits.transfer_timeout, self._transfer_expired)

    def _transfer_expired(self) -> None:
        log.warning("session %s: transfer deadline passed; aborting", self.session_id)
        self.abort("transfer deadline passed")

    async def _drain(self, ep: DataEndpoint, req_id: int, nruns: int) -> None:
        """Swallow a refused store's payload (UCX truncates it) without parking it."""
        scratch = [np.zeros(1, dtype=np.uint8) for _ in range(nruns)]
        with contextlib.suppress(TransferError):
            await self._transfer([ep.recv(b, run_tag(req_id, i)) for i, b in enumerate(scratch)])

    async def _receive(self, ep: DataEndpoint, req_id: int, buf: Buffer,
                       runs: list[Run]) -> None:
        """Each run straight into its arena span."""
        arena = buf.pool.arena
        await self._receive_into(ep, [(arena.view(buf.offset + off, n), run_tag(req_id, i))
                                      for i, (off, n, _, _) in enumerate(runs) if n])

    async def _receive_into(self, ep: DataEndpoint, targets: list[tuple[Any, Any]]) -> None:
        """Receive each ``(buffer, tag)``; a payload larger than its buffer is
        BAD_REQUEST, a broken transfer CONNECTION_LOST."""
        try:
            await self._transfer([ep.recv(target, tag) for target, tag in targets])
        except Truncated as exc:
            raise BadRequest("payload is larger than announced") from exc
        except TransferError as exc:
            raise ConnectionLost(f"store transfer failed: {exc}") from exc

    async def _send_runs(self, ep: DataEndpoint, req_id: int, buf: Buffer,
                         runs: list[Run]) -> bool:
        arena = buf.pool.arena
        try:
            await self._transfer([ep.send(arena.view(buf.offset + off, n), run_tag(req_id, i))
                                  for i, (off, n, _, _) in enumerate(runs) if n])
        except TransferError as exc:
            log.warning("read transfer to session %s failed: %s", self.session_id, exc)
            return False
        return True

    # -- store ----------------------------------------------------------------------

    def _store_check(self, req: P.Store, same_host: bool,
                     get: Callable[[str], Buffer]) -> tuple[Buffer, int]:
        """Validate a store; returns its buffer (looked up by ``get``) and
        (same host) the address its bytes land at."""
        buf = get(req.buffer_id)
        self._check_range(buf, req.offset, req.nbytes)
        if req.verify == "checksum" and req.checksum is None:
            raise BadRequest("verify='checksum' needs the client's checksum")
        if req.wire_dtype is not None:
            check_wire_f16(buf.pool.arena, buf.offset, req.offset, req.nbytes)
        return buf, (self._host_base(buf) + req.offset if same_host else 0)

    def _stored(self, req: P.Store, buf: Buffer) -> dict[str, Any]:
        """After the bytes landed (range still locked): verify, count, log."""
        result: dict[str, Any] = {"nbytes": req.nbytes}
        if req.checksum is not None or req.verify:
            kind = req.checksum_kind or "xxh3"
            got = range_checksum(buf.pool.arena, buf.offset + req.offset, req.nbytes, kind)
            result["checksum"] = got
            result["checksum_kind"] = kind
            if req.verify == "checksum" and got != req.checksum:
                self._count("verify_failures", 1)
                raise VerifyFailed("checksum of received bytes does not match",
                                   {"expected": req.checksum, "got": got, "kind": kind})
        self._count("bytes_stored", req.nbytes)
        self._log("store", buf, req.offset, req.nbytes,
                  note=f"wire={req.wire_dtype}" if req.wire_dtype else "")
        return result

    async def _store(self, req_id: int, req: P.Store, held: Held) -> dict[str, Any]:
        ep = self._path(req.addr is not None)
        try:
            buf, dst = self._store_check(req, ep is None, held.get)
        except RpcBufError:
            if req.nbytes and ep is not None:
                await self._drain(ep, req_id, 1)
            raise
        span = (req.offset, req.offset + req.nbytes)
        async with self._holding(buf, [span], exclusive=True):
            if req.wire_dtype is not None:
                await self._receive_f16(ep, req_id, buf, req.offset, req.nbytes, req.addr)
            elif ep is None:
                assert req.addr is not None
                await self._cma(False, [dst], [req.addr], [req.nbytes], req.nbytes)
            else:
                await self._receive(ep, req_id, buf, [(req.offset, req.nbytes, 0, 1)])
            return self._stored(req, buf)

    async def _receive_f16(self, ep: DataEndpoint | None, req_id: int, buf: Buffer,
                           offset: int, nbytes: int, addr: int | None) -> None:
        """A wire-fp16 store: receive nbytes/2 bytes of float16 into scratch
        memory of the arena's kind (``ep`` None: copy them from ``addr`` in
        the client), then widen them into the float32 slice."""
        if not nbytes:
            return
        arena = buf.pool.arena
        wire = scratch(arena, nbytes // 2)
        if ep is None:
            assert addr is not None and isinstance(wire, np.ndarray)  # host arenas only
            await self._cma(False, [wire.ctypes.data], [addr], [nbytes // 2], nbytes // 2)
        else:
            await self._receive_into(ep, [(wire, run_tag(req_id, 0))])
        await _maybe_in_thread(nbytes, widen_f16, arena, buf.offset + offset, wire)

    async def _store_batch(self, req_id: int, req: P.StoreBatch, held: Held) -> dict[str, Any]:
        ep = self._path(req.addrs is not None)
        offsets, sizes = P.unpack_u64(req.offsets), P.unpack_u64(req.sizes)
        if len(offsets) != len(sizes):
            if ep is None:
                raise BadRequest("offsets and sizes differ in length")
            # We cannot know which messages the client sent: end the session,
            # which aborts the endpoint and with it any payload in flight.
            self.abort("store_batch with offsets and sizes of different lengths")
            raise BadRequest("offsets and sizes differ in length")
        runs = plan_runs(offsets, sizes) if ep is not None else []
        try:
            addrs = self._addrs(req.addrs, len(offsets))
            buf = held.get(req.buffer_id)
            self._check_items(buf, offsets, sizes)
            sums = self._batch_checksums(req, len(offsets))
            cols = M.check(req, sizes)
            if cols is not None:  # refused now if the merged manifest would not fit
                M.plan_record(self.registry, buf, cols.names, offsets, sizes)
            if req.manifest_version is not None and req.manifest_version != buf.manifest_version:
                raise BadRequest("the buffer's manifest changed since it was read",
                                 {"reason": "manifest_changed",
                                  "manifest_version": buf.manifest_version})
            base = self._host_base(buf) if ep is None else 0
        except RpcBufError:
            if ep is not None:
                await self._drain(ep, req_id, len(runs))
            raise
        nbytes = int(sizes.sum())
        hull = _hull(offsets, sizes)
        async with self._holding(buf, [hull], exclusive=True):
            verify = sums is not None and req.verify == "checksum"
            # What landed, hashed by us: compared with the client's checksums,
            # and what the manifest records (never a checksum we did not see match).
            hashing = verify or cols is not None
            got: list[int] | None = None
            manifest: dict[str, dict[str, Any]] | None = None
            at = offsets + np.uint64(buf.offset)  # in the arena
            if ep is None and hashing and nbytes >= CMA_INLINE:
                # A big same-host batch: each part is hashed (and its entries
                # made) as soon as it has landed, while the rest still copies.
                assert addrs is not None and self.cma is not None
                landing = M.Landing(buf.pool.arena, at, sizes, cols, offsets)
                await self._cma(False, offsets + np.uint64(base), addrs, sizes, nbytes, landing)
                got, manifest = landing.sums, landing.entries()
            elif ep is None:
                assert addrs is not None
                await self._cma(False, offsets + np.uint64(base), addrs, sizes, nbytes)
            else:
                await self._receive(ep, req_id, buf, runs)
            if hashing and got is None:
                got = await M.landed_checksums(buf.pool.arena, at, sizes, nbytes)
            if verify:
                assert sums is not None and got is not None
                bad = np.flatnonzero(np.asarray(got, dtype=np.uint64) != sums)
                if len(bad):
                    self._count("verify_failures", 1)
                    raise VerifyFailed(f"{len(bad)} of {len(offsets)} items do not match "
                                       "their checksums", {"items": bad[:20].tolist()})
            result: dict[str, Any] = {}
            if cols is not None and cols.names:
                assert got is not None
                if manifest is None:
                    manifest = cols.entries(offsets, sizes, got)
                result["dropped"] = self._record(buf, manifest, hull, end=hull[1])
                await self._index_stored(buf, manifest)  # a dedup source from now on
                result["manifest_version"] = buf.manifest_version
                result["checksums"] = P.pack_u64(got)
        self._count("bytes_stored", nbytes)
        self._log("store_batch", buf, hull[0], nbytes, note=f"items={len(offsets)} "
                  f"messages={sum(1 for r in runs if r[1])}")
        return {"nbytes": nbytes, "items": len(offsets), "messages": len(runs), **result}

    @staticmethod
    def _addrs(packed: bytes | None, n: int) -> np.ndarray | None:
        if packed is None:
            return None
        addrs = P.unpack_u64(packed)
        if len(addrs) != n:
            raise BadRequest(f"{len(addrs)} addresses for {n} items")
        return addrs

    @staticmethod
    def _batch_checksums(req: P.StoreBatch, n: int) -> np.ndarray | None:
        if req.checksums is None:
            if req.verify == "checksum":
                raise BadRequest("verify='checksum' needs the client's checksums")
            return None
        sums = P.unpack_u64(req.checksums)
        if len(sums) != n:
            raise BadRequest(f"{len(sums)} checksums for {n} items")
        return sums

    @staticmethod
    def _manifest(req: P.StoreBatch | P.DedupStore, offsets: np.ndarray, sizes: np.ndarray,
                  sums: np.ndarray | None) -> dict[str, dict[str, Any]]:
        """The batch's manifest entries, checked (see ``manifest.check``),
        with ``sums`` as their checksums (None: not known yet)."""
        cols = M.check(req, sizes)
        if cols is None:
            return {}
        return cols.entries(offsets, sizes, [None] * len(offsets) if sums is None
                            else sums.tolist())

    def _record(self, buf: Buffer, manifest: dict[str, dict[str, Any]],
                hull: tuple[int, int], end: int | None = None) -> list[str]:
        """Merge into the buffer's manifest (see ``manifest.record``); returns
        the names dropped because other tensors overwrote their bytes."""
        return M.record(self.registry, buf, manifest, hull, end)

    # -- read -----------------------------------------------------------------------

    def _read_check(self, req: P.Read, same_host: bool,
                    get: Callable[[str], Buffer]) -> tuple[Buffer, int]:
        """Validate a read; returns its buffer (looked up by ``get``) and
        (same host) the address its bytes come from."""
        buf = get(req.buffer_id)
        self._check_range(buf, req.offset, req.nbytes)
        return buf, (self._host_base(buf) + req.offset if same_host else 0)

    def _was_read(self, req: P.Read, buf: Buffer) -> dict[str, Any]:
        self._count("bytes_read", req.nbytes)
        self._log("read", buf, req.offset, req.nbytes)
        return {"nbytes": req.nbytes}

    async def _read(self, req_id: int, req: P.Read, held: Held) -> dict[str, Any] | None:
        ep = self._path(req.addr is not None)
        buf, src = self._read_check(req, ep is None, held.get)
        span = (req.offset, req.offset + req.nbytes)
        if ep is None:  # same host: copy into the client, then answer
            assert req.addr is not None
            async with self._holding(buf, [span], exclusive=False):
                await self._cma(True, [src], [req.addr], [req.nbytes], req.nbytes)
            return self._was_read(req, buf)
        async with self._holding(buf, [span], exclusive=False):
            # The answer goes first: the client posts its receive when it sees it.
            self.send(P.ok_response(req_id, {"nbytes": req.nbytes}))
            if not await self._send_runs(ep, req_id, buf, [(req.offset, req.nbytes, 0, 1)]):
                return None
        self._was_read(req, buf)
        return None

    async def _read_batch(self, req_id: int, req: P.ReadBatch, held: Held) -> dict[str, Any] | None:
        offsets, sizes = P.unpack_u64(req.offsets), P.unpack_u64(req.sizes)
        if len(offsets) != len(sizes):
            raise BadRequest("offsets and sizes differ in length")
        addrs = self._addrs(req.addrs, len(offsets))
        buf = held.get(req.buffer_id)
        self._check_items(buf, offsets, sizes, disjoint=False)  # reads may overlap
        ep = self._path(req.addrs is not None)
        nbytes = int(sizes.sum())
        hull = _hull(offsets, sizes)
        if ep is None:  # same host: copy into the client, then answer
            assert addrs is not None
            base = self._host_base(buf)
            async with self._holding(buf, [hull], exclusive=False):
                await self._cma(True, offsets + np.uint64(base), addrs, sizes, nbytes)
            self._count("bytes_read", nbytes)
            self._log("read_batch", buf, hull[0], nbytes, note=f"items={len(offsets)}")
            return {"nbytes": nbytes, "messages": 0}
        runs = plan_runs(offsets, sizes)
        async with self._holding(buf, [hull], exclusive=False):
            self.send(P.ok_response(req_id, {"nbytes": nbytes, "messages": len(runs)}))
            if not await self._send_runs(ep, req_id, buf, runs):
                return None
        self._count("bytes_read", nbytes)
        self._log("read_batch", buf, hull[0], nbytes, note=f"items={len(offsets)}")
        return None

    # -- on the daemon, no network ----------------------------------------------------

    async def _clear(self, req_id: int, req: P.ClearBuffer, held: Held) -> dict[str, Any]:
        buf = held.get(req.buffer_id)
        if req.value > 255:
            raise BadRequest(f"value must be a byte (0..255), got {req.value}")
        nbytes = buf.size - req.offset if req.nbytes is None else req.nbytes
        self._check_range(buf, req.offset, max(nbytes, 0))
        async with self._holding(buf, [(req.offset, req.offset + nbytes)], exclusive=True):
            view = buf.pool.arena.view(buf.offset + req.offset, nbytes)
            await _maybe_in_thread(nbytes, fill, buf.pool.arena, view, req.value)
        self._log("clear", buf, req.offset, nbytes, note=f"value={req.value}")
        return {"nbytes": nbytes}

    async def _copy(self, req_id: int, req: P.CopyBuffer, held: Held) -> dict[str, Any]:
        src, dst = held.get(req.src_id), held.get(req.dst_id)
        self._check_range(src, req.src_offset, req.nbytes)
        self._check_range(dst, req.dst_offset, req.nbytes)
        s_rng = (req.src_offset, req.src_offset + req.nbytes)
        d_rng = (req.dst_offset, req.dst_offset + req.nbytes)

        def do_copy() -> None:
            copy_between(src.pool.arena, src.offset + req.src_offset,
                         dst.pool.arena, dst.offset + req.dst_offset, req.nbytes)

        async with self._holding_all(dst, [d_rng], [(src, s_rng)]):
            await _maybe_in_thread(req.nbytes, do_copy)
        self._log("copy", dst, req.dst_offset, req.nbytes,
                  note=f"from {src.buffer_id}+{req.src_offset}")
        return {"nbytes": req.nbytes}


async def _outlast(fut: asyncio.Future[Any], stopping: Callable[[], bool]) -> None:
    """Wait until ``fut`` is done, whatever cancels us meanwhile (then
    re-raise that): memory it may still write into must stay held.  Only a
    daemon that has stopped serving gives up (nothing is allocated any more,
    and a copy stuck for good must not keep the process from exiting)."""
    cancelled = False
    while not fut.done() and not stopping():
        try:
            await asyncio.wait([fut])
        except asyncio.CancelledError:
            if stopping():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


async def _maybe_in_thread(nbytes: int, fn: Callable[..., Any], *args: Any) -> None:
    """Big memory sweeps run in a worker thread (NumPy drops the GIL) so the
    event loop keeps serving everyone else."""
    if nbytes >= THREAD_BYTES:
        await asyncio.to_thread(fn, *args)
    else:
        fn(*args)



def _hull(offsets: np.ndarray, sizes: np.ndarray) -> tuple[int, int]:
    """The smallest range covering every item (what a batch locks)."""
    if not len(offsets):
        return (0, 0)
    return int(offsets.min()), int((offsets + sizes).max())

