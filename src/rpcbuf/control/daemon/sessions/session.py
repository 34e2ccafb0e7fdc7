"""One ``Session`` per control connection: its one dispatch table, its one
answer path, its hello (``greeting.py``, with the same-host path), and its
end; its requests arrive through its ``Intake`` (``intake.py``: reading,
decoding, back-pressure, and the start of each op).

Requests are parsed by the sans-I/O protocol and dispatched through one
table: the quick ops (``controlops``) are answered inline, in this loop;
``store``, ``read`` and the other data ops (``dataops``, ``dedupops``, the
node-local ``load_file`` of ``fileops``, run by the one data pipeline,
``pipeline``), and ``request_buffer``, are coroutines started at once
(``intake.start``): one that waits for nothing is answered in that first step,
one that waits goes on as a task, so one connection carries many requests
at once and answers leave in any order.  Every answer frame leaves through
``_reply``, once per request (a UCX read answers before its bytes move,
through ``Call.answer_first``; its task then adds no second answer), and
every request ends in ``_finish``: that one place counts and times it for
the metrics (``metrics.py``) and writes its audit records with the result
code (``logs.py``).

The ops are composed, not mixed in: each is an object that sees this
session through a small Protocol (``pipeline.Ops``, ``controlops.ControlOwner``)
and the daemon through ``node.Node``.

Data paths (``paths.py``): the UCX endpoint the client binds after hello
(``UcxPath``), and on a Unix socket session that asked for it at hello, once
its client bound the session's handle channel (``handles.py``: a second
connection from the same process), the same-host path (``StagedPath``, over
the staging area that channel delivered) and attachments (``attachops``).

A session that goes away aborts its UCX endpoint first (UCX cancels what is
posted), stops its same-host copies, waits for its transfers, closes its
attachments and handle channel, and only then releases its session-scoped
buffers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from rpcbuf.control.daemon.accounting.registry import Buffer, Pool
from rpcbuf.control.daemon.data.handles import HandleChannel
from rpcbuf.control.daemon.data.paths import DataPath, InlinePath, StagedPath, UcxPath
from rpcbuf.control.daemon.data.pipeline import Call, Held, Pipeline
from rpcbuf.control.daemon.observe import logs
from rpcbuf.control.daemon.ops.attachops import AttachOps
from rpcbuf.control.daemon.ops.blockops import BlockHandlers
from rpcbuf.control.daemon.ops.controlops import ControlOps
from rpcbuf.control.daemon.ops.dataops import DataOps
from rpcbuf.control.daemon.ops.dedupops import DedupHandlers
from rpcbuf.control.daemon.ops.fileops import FileOps
from rpcbuf.control.daemon.ops.inplace import InPlace
from rpcbuf.control.daemon.ops.mapops import WriteGrants
from rpcbuf.control.daemon.ops.node import Node
from rpcbuf.control.daemon.sessions import greeting, hello
from rpcbuf.control.daemon.sessions.intake import Intake, start
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.auth import Grant
from rpcbuf.control.wire.errors import (
    AuthFailed,
    BadRequest,
    ConnectionLost,
    QuotaExceeded,
    RpcBufError,
    ShuttingDown,
    TokenExpired,
)
from rpcbuf.dataplane import staging
from rpcbuf.dataplane.ucx import NONCE_BYTES, DataEndpoint

log = logging.getLogger("rpcbuf.daemon")
ABORT_GRACE = 2.0  # seconds for transfers to end after their endpoint is aborted
END_GRACE = 2.0  # seconds a session ended by us (Session.end) waits for the client to go
_FRAMED = (P.Store, P.BlockPut)  # the stores whose bytes may ride in their frame (data)


class Session:
    """One control connection: its tenant, its data paths, its requests."""

    def __init__(self, daemon: Node, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.daemon = daemon
        self.registry = daemon.registry
        self.content = daemon.content
        self.reader = reader
        self.writer = writer
        self.session_id = "s-" + secrets.token_urlsafe(12)
        self.nonce = os.urandom(NONCE_BYTES)
        self.tenant: str | None = None
        self.grant: Grant | None = None  # the hello's token: whose, until when, which key
        self.challenged: greeting.Challenged | None = None  # answered, awaiting hello
        # When the token expires, in time.perf_counter()'s terms (what dispatch
        # compares against: one float compare per request); -inf once ended.
        self.token_deadline = math.inf
        self.token_timer: asyncio.TimerHandle | None = None
        self._ended: RpcBufError | None = None  # why we ended it (end): no more answers
        self.ep: DataEndpoint | None = None
        self.ucx: UcxPath | None = None  # once the client's data endpoint is bound
        self.same_host: StagedPath | None = None  # once the handle channel is bound
        self.handles: HandleChannel | None = None
        self.handles_nonce: bytes | None = None  # while a granted handle channel is awaited
        self.staging_charge: Pool | None = None  # where the staging area is charged
        self.slot_charged = False  # its tenant is charged its session (greeting.take_slot)
        self.copy_stop = threading.Event()  # set when the session closes: copies stop
        self.peer = writer.get_extra_info("peername")
        self.unix = writer.get_extra_info("socket").family == socket.AF_UNIX
        self.peer_pid = hello.peer_pid(writer) if self.unix else None
        self.tasks: dict[int, asyncio.Task[None]] = {}
        # Stores whose UCX payload may be waiting unexpected (their receives not
        # posted yet): req_id -> time.monotonic() at dispatch.  The janitor
        # (``Daemon._claimable``) spares old unexpected messages while one is
        # older than its sentinel, or while the reader is paused (frames not
        # yet dispatched may have sent payloads already).
        self.unposted: dict[int, float] = {}
        self.transfers: set[asyncio.Task[None]] = set()
        self._closed = False
        self.intake = Intake(self)  # the requests as they arrive, with back-pressure
        self._out: list[bytes] | None = None  # answers waiting for the end of this loop turn
        # The ops, composed: each sees this session through a small Protocol.
        pipeline = Pipeline(self)
        dedup = DedupHandlers(self, pipeline)
        data = DataOps(self, pipeline, dedup)
        files = FileOps(self, pipeline, daemon, self.copy_stop, dedup)
        self.control = control = ControlOps(self, daemon)
        self.attachments = attach = AttachOps(self, pipeline)
        blocks = BlockHandlers(self, pipeline, daemon.blocks, attach.attach_buffer)
        self.in_place = in_place = InPlace(self, daemon.blocks, blocks, attach)
        self.write_grants = grants = WriteGrants(self, pipeline)
        # The one dispatch table: op -> (handler, may wait).  Quick ops answer
        # inline; ops that may wait (memory, locks, transfers) are coroutines,
        # started at once and made tasks only if they do wait (``intake.start``).
        self._ops: dict[type, tuple[Callable[..., Any], bool]] = {
            P.GetBufferMeta: (control.meta, False),
            P.OpenBuffer: (control.open, False),
            P.Release: (control.release, False),
            P.Renew: (control.renew, False),
            P.ListDevices: (control.list_devices, False),
            P.ListBuffers: (control.list_buffers, False),
            P.Stats: (control.stats, False),
            P.Ping: (control.ping, False),
            P.RequestBuffer: (control.request, True),
            P.Store: (data.store, True),
            P.Read: (data.read, True),
            P.StoreBatch: (data.store_batch, True),
            P.ReadBatch: (data.read_batch, True),
            P.ClearBuffer: (data.clear, True),
            P.CopyBuffer: (data.copy, True),
            P.DedupStore: (dedup.dedup_store, True),
            P.CloneBuffer: (dedup.clone, True),
            P.Attach: (attach.attach, True),
            P.Detach: (attach.detach, False),
            P.LoadFile: (files.load_file, True),
            P.BlockPut: (blocks.put, True),
            P.BlockGet: (blocks.get, True),
            P.BlockLookup: (blocks.lookup, False),
            P.BlockRemove: (blocks.remove, False),
            P.BlockList: (blocks.list, False),
            P.BlockAttach: (blocks.attach, True),
            P.BlockPlace: (in_place.place, True),
            P.BlockCommit: (in_place.commit, True),
            P.BlockLocate: (in_place.locate, True),
            P.BlockUnpin: (in_place.unpin, False),
            P.MapBuffer: (grants.map, True),
            P.UnmapBuffer: (grants.unmap, False),
        }

    def abort(self, why: str) -> None:
        """End the session hard: abort the data endpoint (UCX cancels what is
        posted on it) and drop the connection; ``close`` then cleans up."""
        log.warning("session %s aborted: %s", self.session_id, why)
        if self.ep is not None:
            self.ep.abort()
        with contextlib.suppress(Exception):
            self.writer.close()

    def end(self, why: RpcBufError) -> None:
        """End the session from our side (its token expired, its key was
        revoked), telling the client why in a connection-level error frame.
        The frame goes out and our half of the connection closes; the client
        then closes its half, which ends ``run`` and ``close`` cleans up.
        (Closing outright with the client's requests unread would reset the
        connection, which can destroy the frame.)  Meanwhile every request is
        refused, unanswered; after END_GRACE the session is aborted whatever
        the client does."""
        if self._closed or self._ended is not None:
            return
        log.info("session %s tenant=%s ended: %s", self.session_id, self.tenant, why)
        self.send(P.error_response(None, why))
        self.flush()
        self._ended = why
        self.token_deadline = -math.inf  # _dispatch refuses every request from now on
        with contextlib.suppress(Exception):
            if self.writer.can_write_eof():
                self.writer.write_eof()
        asyncio.get_running_loop().call_later(END_GRACE, self._hang_up)

    def _hang_up(self) -> None:
        if not self._closed:
            self.abort(f"the client stayed {END_GRACE:.0f}s after the session ended")

    def token_ran_out(self) -> None:
        self.token_timer = None
        self.end(self._why_over())

    def _why_over(self) -> RpcBufError:
        """The error for a request after the session's token expired (or
        after ``end``): a fresh one each time, an exception is raised once."""
        if self._ended is not None:
            return type(self._ended)(self._ended.message, self._ended.details)
        expired = None if self.grant is None else self.grant.expires_at
        return TokenExpired("this session's token expired; connect again with a new token",
                            {"expired_at": expired})

    def bind(self, ep: DataEndpoint) -> None:
        if self._closed:
            ep.abort()
            return
        self.ep = ep
        self.ucx = UcxPath(ep, self.daemon.limits.transfer_timeout, self.transfer_expired,
                           self._posted)
        log.debug("session %s bound its data endpoint", self.session_id)

    # -- what the ops see (pipeline.Ops, controlops.ControlOwner) -----------------------

    @property
    def owner(self) -> str:
        """The session's tenant (ops run only after hello)."""
        tenant = self.tenant
        assert tenant is not None
        return tenant

    def path(self, req: P.DataRequest) -> DataPath:
        """The data path the request names (``path``): the same-host path,
        its own frames (``Store.data``, an inline read's answer), or the UCX
        endpoint.  Raises BAD_REQUEST for a path this session lacks, or a
        staging slot or frame bytes given off their path."""
        name = req.path
        if (req.stage is not None) != (name == "staged"):
            raise BadRequest(f"{req.op}: a staging slot (stage) goes with path 'staged', "
                             "and only with it")
        data = req.data if isinstance(req, _FRAMED) else None
        if (data is not None) != (name == "inline" and isinstance(req, _FRAMED)):
            raise BadRequest(f"{req.op}: the bytes in the frame (data) go with path "
                             "'inline', and a store on that path carries them")
        if name == "inline":
            return InlinePath(data)
        if name == "ucx":
            if self.ucx is None:
                raise BadRequest("no data endpoint is bound to this session")
            return self.ucx
        if self.same_host is None:
            raise BadRequest("staging slots are for same-host sessions only",
                             {"reason": "not_same_host"})
        return self.same_host

    def transfer_expired(self) -> None:
        log.warning("session %s: transfer deadline passed; aborting", self.session_id)
        self.abort("transfer deadline passed")

    # -- I/O --------------------------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        if self._closed or self._ended is not None or self.writer.is_closing():
            return
        try:
            frame = P.encode_frame(message, self.daemon.limits.max_frame)
        except P.FrameError as exc:
            frame = P.encode_frame(P.error_response(message.get("id"), BadRequest(str(exc))))
        out = self._out
        if out is None:  # the first answer of a loop turn leaves at once (latency) ...
            self.writer.write(frame)
            self._out = []
            asyncio.get_running_loop().call_soon(self.flush)
        else:  # ... the others (a pipelined burst) together, in one write, at its end
            out.append(frame)

    def flush(self) -> None:
        out, self._out = self._out, None
        if out and not self.writer.is_closing():
            self.writer.write(b"".join(out))

    async def run(self) -> None:
        """Serve the connection until it ends (``intake.py``)."""
        await self.intake.run()

    @property
    def closed(self) -> bool:
        return self._closed

    def evict(self) -> None:
        """Dropped to make room for newer unauthenticated connections (see
        admission.py): say why, then close; ``close`` cleans up."""
        self.daemon.metrics.refused("max_unauthenticated")
        log.warning("closing %s: no hello yet, and newer connections need the room",
                    self.peer or f"pid {self.peer_pid}")
        self.send(P.error_response(None, QuotaExceeded(
            "too many connections have not said hello yet; this one waited longest",
            {"limit": "max_unauthenticated"})))
        with contextlib.suppress(Exception):
            self.writer.close()

    def dispatch(self, msg: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            req_id, req = P.parse_request(msg)
        except P.RequestError as exc:
            self.send(P.error_response(exc.req_id, exc.error))
            self.daemon.metrics.observe("invalid", exc.error.code, started)
            return
        op = logs.OpRecord(req.op, self.tenant, self.session_id, started, req)
        if req_id in self.tasks:
            self._answer(req_id, op, BadRequest(f"request id {req_id} is in flight"))
            return
        token = logs.CURRENT.set(op)  # what _log records attaches to this request
        try:
            if isinstance(req, P.Hello):
                self._answer(req_id, op, greeting.hello(self, req))
                return
            if isinstance(req, P.Challenge):
                self._answer(req_id, op, greeting.challenge(self, req))
                return
            if isinstance(req, P.BindHandles):
                greeting.bind_handles(self, req)  # answers nothing: the channel carries records
                return
            if self.tenant is None:
                raise AuthFailed("say hello first")
            if started >= self.token_deadline:  # a session does not outlive its token
                raise self._why_over()
            if self.daemon.shutting_down:
                raise ShuttingDown("daemon is stopping; no new requests")
            handler, may_wait = self._ops[type(req)]
            if may_wait:
                self._start(req_id, req, handler, op)
            else:
                self._answer(req_id, op, handler(req))
        except RpcBufError as exc:
            self._answer(req_id, op, exc)
        finally:
            logs.CURRENT.reset(token)

    def _answer(self, req_id: int, op: logs.OpRecord,
                result: dict[str, Any] | RpcBufError) -> None:
        """Answer a request and finish it (the quick ops, inline)."""
        self._reply(req_id, result)
        self._finish(op, result if isinstance(result, RpcBufError) else None)

    def _reply(self, req_id: int, result: dict[str, Any] | RpcBufError) -> None:
        """The one answer path: every request's answer frame leaves here,
        once (a task's ``Call.answer_first`` comes here too)."""
        if isinstance(result, RpcBufError):
            self.send(P.error_response(req_id, result))
        else:
            self.send(P.ok_response(req_id, result))

    def _finish(self, op: logs.OpRecord, error: RpcBufError | None) -> None:
        """Every request ends here, answered inline or by its task: count it,
        time it, and write its audit records with the result code."""
        code = "OK" if error is None else error.code
        self.daemon.metrics.observe(op.op, code, op.started)
        logs.finish(op, code, None if error is None else error.message)

    def _posted(self, req_id: int) -> None:
        self.unposted.pop(req_id, None)

    def may_claim(self, since: float) -> bool:
        """Whether an unexpected UCX message older than ``since`` (monotonic)
        may be a payload of ours: a store dispatched before then has not
        posted its receives, or the reader is paused with frames undecoded
        (``intake.paused`` before hello; after it the pump pauses reading at
        ``max_inflight`` tasks and sets no flag, so that is the test)."""
        return self.intake.paused or len(self.tasks) >= self.daemon.limits.max_inflight or \
            min(self.unposted.values(), default=math.inf) < since

    def _start(self, req_id: int, req: P.Request, handler: Callable[..., Any],
               op: logs.OpRecord) -> None:
        """Run an op that may wait: at once, to its end if nothing waits
        (answered in this loop turn, no task), else on as a task (``intake.start``)."""
        assert self.tenant is not None
        held = Held(self.registry, self.tenant)  # what the handler looks up stays pinned
        call = Call(req_id, held, self._reply)
        if self.ep is not None and P.sends_over_ucx(req):
            self.unposted[req_id] = time.monotonic()
        task = start(self._run_op(call, handler(call, req), op))
        if task is None:
            return  # answered and finished in its first step
        self.tasks[req_id] = task
        if not isinstance(req, P.RequestBuffer):
            self.transfers.add(task)

    async def _run_op(self, call: Call, coro: Any, op: logs.OpRecord) -> None:
        """An op's request, answered once: with what the op returns or
        raises, unless the op answered first (a UCX read: then a failure of
        its transfer is only recorded)."""
        # (Its audit records land on ``op``: dispatch set logs.CURRENT, and the
        # op runs in a copy of that context, eagerly or as a task.)
        req_id = call.req_id
        result: dict[str, Any] | RpcBufError
        error: RpcBufError | None = None
        try:
            result = await coro
        except RpcBufError as exc:
            result = error = exc
        except asyncio.CancelledError:
            result = error = ConnectionLost("request cancelled")
        except Exception as exc:  # a bug: answer, log, keep serving everyone else
            log.exception("request %d failed", req_id)
            result = error = RpcBufError(f"internal error: {exc}")
        try:
            if not call.answered:
                self._reply(req_id, result)
        finally:
            call.held.release()
            self._finish(op, error)
            task = self.tasks.pop(req_id, None)
            self.unposted.pop(req_id, None)
            if task is not None:  # (None: it ended in its first step, never a task)
                self.transfers.discard(task)
                self.intake.slot_freed()

    async def close(self, why: str) -> None:
        """Abort the data endpoint, wait for transfers, release session buffers."""
        if self._closed:
            return
        self._closed = True
        if self.token_timer is not None:
            self.token_timer.cancel()
        self.copy_stop.set()  # same-host ring copies stop within a chunk
        ep, self.ep, self.ucx = self.ep, None, None
        if ep is not None:
            ep.abort()  # UCX cancels posted requests: nothing writes into memory after this
        for task in self.tasks.values():
            if task not in self.transfers:
                task.cancel()
        pending = list(self.tasks.values())
        if pending:
            _, stuck = await asyncio.wait(pending, timeout=ABORT_GRACE)
            if stuck and ep is not None:
                # The endpoint is closed (abort waits for UCX to close it), so
                # UCX no longer touches their memory, but ucxx sometimes never
                # completes a receive it had already matched (seen once when a
                # client was killed mid-store): cancel the waiting tasks.
                log.warning("session %s: %d transfers missed the endpoint abort; "
                            "cancelling them", self.session_id, len(stuck))
                for task in stuck:
                    task.cancel()
                _, stuck = await asyncio.wait(stuck, timeout=ABORT_GRACE)
            if stuck:  # keep their buffers pinned rather than risk a use-after-free
                log.error("session %s: %d transfers did not end", self.session_id, len(stuck))
        try:
            self.in_place.close()  # before the attachments: a lease's pins, then the handles
            self.write_grants.close()
            self.attachments.detach_all()
            if self.handles is not None:
                self.handles.close()
            if self.handles_nonce is not None:
                self.daemon.by_handles_nonce.pop(self.handles_nonce, None)
            if self.staging_charge is not None and self.tenant is not None:
                self.registry.uncharge(self.tenant, self.staging_charge, staging.SIZE)
                self.staging_charge = None
            for buf in self.registry.session_closed(self.session_id):
                self.audit("release", buf, note="session closed")
        finally:  # a cleanup that raised must not keep the tenant's slot and frame bytes
            self.intake.close()  # its half-received frame, and that charge, go
            if self.slot_charged and self.tenant is not None:
                self.slot_charged = False
                self.daemon.charges.refund(self.tenant, "sessions")
        self.daemon.schedule_expiry()
        self.flush()  # answers of this loop turn (a connection-level error frame) go first
        with contextlib.suppress(Exception):
            self.writer.close()
        if self.tenant is None:  # a probe (doctor's "is anything listening?"), a scanner
            peer = self.peer
            where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 \
                else f"pid {self.peer_pid}"
            log.info("connection %s from %s closed before saying hello: %s", self.session_id,
                     where, why)
        else:
            log.info("session %s tenant=%s closed: %s", self.session_id, self.tenant, why)

    # -- ops --------------------------------------------------------------------

    def schedule_expiry(self) -> None:
        self.daemon.schedule_expiry()

    def audit(self, op: str, buf: Buffer, offset: int = 0, nbytes: int | None = None,
              note: str = "") -> None:
        """Audit a memory op: written with its result code and duration when the
        request is answered (see ``logs``), at once outside a request."""
        entry: dict[str, Any] = {
            "op": op, "tenant": buf.tenant, "session": self.session_id,
            "buffer": buf.buffer_id, "device": buf.pool.key, "offset": offset,
            "bytes": buf.alloc_size if nbytes is None else nbytes}
        if note:
            entry["note"] = note
        logs.record(entry)

    def count(self, key: str, n: int) -> None:
        """Count ``n`` into the node's counter ``key`` and this tenant's."""
        counters = self.daemon.counters
        counters[key] = counters.get(key, 0) + n
        assert self.tenant is not None
        mine = self.daemon.tenant_counters.get(self.tenant)
        if mine is None:
            mine = self.daemon.tenant_counters[self.tenant] = {}
        mine[key] = mine.get(key, 0) + n
