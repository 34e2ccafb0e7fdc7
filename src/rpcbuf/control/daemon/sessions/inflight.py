"""A session's ops: composed, started at once, answered once, finished once.

``SessionOps`` is what the op objects see of their session (its tenant, its
data paths, audit and counters: ``pipeline.Ops``), the table of which op
serves each request, and the ops that went on as tasks (the session reads
no more past ``max_inflight`` of them).  Each op is answered through
``reply`` once, with what it returns or raises, unless it answered first (a
UCX read answers before its bytes move; a failure after that is only
recorded), and ends in ``finish``: metrics, and its audit records with the
result code.

**The start** (``start``).  An op's coroutine takes its first step at once,
in the loop turn that dispatched it and in a copy of the current context (as
a task would), and becomes a task only if it waits.  Most ops never wait (a
4 KiB same-host store locks a free range, copies one slot and answers in its
first step): no task and no loop round.  And ops take their locks in the
order they arrived, since each one's first step runs when it is dispatched.
On Python 3.12+ this is ``Task(..., eager_start=True)``.  On 3.11 the first
step is ``coro.send(None)`` here; a coroutine that waited goes on in a task
over ``_rest``, a generator that first waits on what the step yielded (as
the task would have) and then delegates to the coroutine by ``yield from``.
``_rest`` is primed before the task gets it, so a cancel that comes before
the task's first step lands inside it and reaches the coroutine where it
waits.  On 3.11 a first step runs with no current task: nothing in it may
need one (``asyncio.timeout`` does; 3.11's ``asyncio.wait_for`` does not).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import os
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Coroutine, Generator
from typing import Any

from rpcbuf.control.daemon.accounting.registry import Buffer, Pool
from rpcbuf.control.daemon.data.handles import HandleChannel, same_process
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
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import (
    AuthFailed,
    BadRequest,
    ConnectionLost,
    QuotaExceeded,
    RpcBufError,
)
from rpcbuf.dataplane import staging
from rpcbuf.dataplane.ucx import NONCE_BYTES, DataEndpoint

log = logging.getLogger("rpcbuf.daemon")
EAGER = sys.version_info >= (3, 12)
ABORT_GRACE = 2.0  # seconds for transfers to end after their endpoint is aborted
Result = dict[str, Any] | RpcBufError
_FRAMED = (P.Store, P.BlockPut)  # the stores whose bytes may ride in their frame (data)


def start(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run ``coro`` up to its first wait: ``None`` if it finished there
    (what it raised is raised here), else the task that runs the rest."""
    if EAGER:
        task: asyncio.Task[None] = asyncio.Task(  # type: ignore[call-arg]
            coro, loop=asyncio.get_running_loop(), eager_start=True)
        if task.done():
            task.result()  # retrieved (and raised, if it failed)
            return None
        return task
    ctx = contextvars.copy_context()
    try:
        waits_on = ctx.run(coro.send, None)
    except StopIteration:
        return None
    rest = _rest(coro, waits_on)
    next(rest)  # primed: see the module's docstring
    return asyncio.get_running_loop().create_task(rest, context=ctx)


@types.coroutine
def _rest(coro: Coroutine[Any, Any, None], waits_on: Any) -> Generator[Any, Any, None]:
    primed = False
    while True:
        try:
            if not primed:
                primed = True
                yield  # start() primes it here: a cancel before the task's first step lands in
            yield waits_on  # the task waits on it as it would have (its cancel cancels it)
        except GeneratorExit:  # closed, never finished: so is the op
            coro.close()
            raise
        except BaseException as exc:
            if isinstance(waits_on, asyncio.Future):
                waits_on.cancel()
            try:
                waits_on = coro.throw(exc)
            except StopIteration:
                return
            continue
        return (yield from coro)


class SessionOps:
    """One session's ops, and what they see of it.  ``reply(req_id,
    result)`` is the session's one answer path, ``abort(why)`` ends it, and
    ``freed()`` is told when a task ends."""

    def __init__(self, daemon: Node, session_id: str, reply: Callable[[int, Result], None],
                 abort: Callable[[str], None], freed: Callable[[], None]) -> None:
        self.daemon = daemon
        self.sweeps = daemon.sweeps
        self.registry = daemon.registry
        self.content = daemon.content
        self.session_id = session_id
        self.tenant: str | None = None  # set by the hello
        self.ep: DataEndpoint | None = None
        self.ucx: UcxPath | None = None  # once the client's data endpoint is bound
        self.same_host: StagedPath | None = None  # once the handle channel is bound
        self.handles: HandleChannel | None = None
        self.handles_nonce: bytes | None = None  # while a granted handle channel is awaited
        self.staging_charge: Pool | None = None  # where the staging area is charged
        self._sock: Any = None  # the session's own socket (a same-host grant's)
        self.copy_stop = threading.Event()  # set when the session closes: copies stop
        self.tasks: dict[int, asyncio.Task[None]] = {}
        # Stores whose UCX payload may wait unexpected (receives not posted):
        # req_id -> time.monotonic() at dispatch (see may_claim).
        self.unposted: dict[int, float] = {}
        self.transfers: set[asyncio.Task[None]] = set()
        self._reply, self._abort, self._freed = reply, abort, freed
        pipeline = Pipeline(self)
        dedup = DedupHandlers(self, pipeline)
        data = DataOps(self, pipeline, dedup)
        files = FileOps(self, pipeline, daemon, self.copy_stop, dedup)
        control = ControlOps(self, daemon)
        self.attachments = attach = AttachOps(self, pipeline)
        blocks = BlockHandlers(self, pipeline, daemon.blocks, attach.attach_buffer)
        self.in_place = in_place = InPlace(self, daemon.blocks, blocks, attach)
        self.write_grants = grants = WriteGrants(self, pipeline)
        # request -> (handler, may wait): the quick ops answer inline, the
        # others are coroutines (``start``).
        self.table: dict[type, tuple[Callable[..., Any], bool]] = {
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

    @property
    def owner(self) -> str:
        """The session's tenant (ops run only after hello)."""
        tenant = self.tenant
        assert tenant is not None
        return tenant

    @property
    def closing(self) -> bool:
        return self.copy_stop.is_set()

    # -- the same-host path -----------------------------------------------------------

    def grant_same_host(self, sock: Any, unix: bool) -> str:
        """Grant the same-host path to a Unix socket session: the client's
        second connection binds its handle channel with ``handles_nonce``.
        The staging area is the tenant's memory: a tenant whose quota cannot
        spare it gets the network path.  Nothing of the client's is trusted:
        the daemon only hands out handles and copies its own memory.
        Returns why not ("" if granted)."""
        if not unix:
            return "the same-host path needs the daemon's Unix socket"
        pool = self.registry.host_pool()
        if pool is not None:
            try:
                self.registry.charge(self.owner, pool, staging.SIZE)
            except QuotaExceeded as exc:
                return f"no room in this tenant's quota for its staging area: {exc}"
            self.staging_charge = pool
        self._sock = sock
        self.handles_nonce = os.urandom(NONCE_BYTES)
        self.daemon.by_handles_nonce[self.handles_nonce] = self
        return ""

    @staticmethod
    def bind_handles(daemon: Node, nonce: bytes, sock: Any) -> None:
        """``sock`` (a second connection's, which ends now) is the handle
        channel of the session granted ``nonce``.  Raises AUTH_FAILED for a
        nonce no open session waits on, or a connection from another process."""
        owner: SessionOps | None = daemon.by_handles_nonce.get(nonce)
        if owner is None or owner.closing or owner.handles is not None:
            raise AuthFailed("no session waits for this handle channel")
        if not same_process(sock, owner._sock):
            raise AuthFailed("the handle channel must come from the session's own process")
        daemon.by_handles_nonce.pop(nonce, None)
        owner.handles_nonce = None
        owner._take_handles(sock.dup())

    def _take_handles(self, sock: socket.socket) -> None:
        """Send the staging area through the channel; the same-host path is on."""
        try:
            channel = HandleChannel(sock)
        except OSError as exc:
            sock.close()
            log.warning("session %s: no staging area: %s", self.session_id, exc)
            return
        self.handles = channel
        limits = self.daemon.limits
        self.same_host = StagedPath(
            channel.staging, self.daemon.copies, self.owner, timeout=limits.transfer_timeout,
            stop=self.copy_stop, expired=self.transfer_expired,
            stopped=lambda: self.daemon.stopped)
        task = asyncio.get_running_loop().create_task(self._send_staging(channel))
        self.transfers.add(task)
        task.add_done_callback(self.transfers.discard)
        log.debug("session %s bound its handle channel", self.session_id)

    async def _send_staging(self, channel: HandleChannel) -> None:
        try:
            await channel.start()
        except (OSError, TimeoutError) as exc:
            log.warning("session %s: sending the staging area failed: %s", self.session_id,
                        exc)
            self.abort("the handle channel failed")

    # -- running ops ----------------------------------------------------------------

    def start(self, req_id: int, req: P.Request, handler: Callable[..., Any],
              op: logs.OpRecord) -> None:
        """Run an op that may wait: to its end if nothing waits, else on as a task."""
        held = Held(self.registry, self.owner)  # what the handler looks up stays pinned
        call = Call(req_id, held, self._reply)
        if self.ep is not None and P.sends_over_ucx(req):
            self.unposted[req_id] = time.monotonic()
        task = start(self._run(call, handler(call, req), op))
        if task is None:
            return  # answered and finished in its first step
        self.tasks[req_id] = task
        if not isinstance(req, P.RequestBuffer):
            self.transfers.add(task)

    async def _run(self, call: Call, coro: Any, op: logs.OpRecord) -> None:
        # (Its audit records land on ``op``: the dispatch set logs.CURRENT,
        # and the op runs in a copy of that context.)
        req_id = call.req_id
        result: Result
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
            self.finish(op, error)
            task = self.tasks.pop(req_id, None)
            self.unposted.pop(req_id, None)
            if task is not None:  # (None: it ended in its first step, never a task)
                self.transfers.discard(task)
                self._freed()

    def finish(self, op: logs.OpRecord, error: RpcBufError | None) -> None:
        """Every request ends here: count it, time it, and write its audit
        records with the result code."""
        code = "OK" if error is None else error.code
        self.daemon.metrics.observe(op.op, code, op.started)
        logs.finish(op, code, None if error is None else error.message)

    def may_claim(self, since: float) -> bool:
        """Whether an unexpected UCX message older than ``since`` (monotonic)
        may be a payload of ours: a store dispatched before then has not
        posted its receives, or reading is paused at ``max_inflight`` with
        frames undecoded."""
        return len(self.tasks) >= self.daemon.limits.max_inflight or \
            min(self.unposted.values(), default=math.inf) < since

    # -- what the ops see (pipeline.Ops) ------------------------------------------------

    def path(self, req: P.DataRequest) -> DataPath:
        """The data path the request names.  Raises BAD_REQUEST for a path
        this session lacks, or a staging slot or frame bytes off their path."""
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

    def bind(self, ep: DataEndpoint) -> None:
        self.ep = ep
        self.ucx = UcxPath(ep, self.daemon.limits.transfer_timeout, self.transfer_expired,
                           self._posted)
        log.debug("session %s bound its data endpoint", self.session_id)

    def _posted(self, req_id: int) -> None:
        self.unposted.pop(req_id, None)

    def transfer_expired(self) -> None:
        log.warning("session %s: transfer deadline passed; aborting", self.session_id)
        self.abort("transfer deadline passed")

    def abort(self, why: str) -> None:
        self._abort(why)

    def schedule_expiry(self) -> None:
        self.daemon.schedule_expiry()

    def audit(self, op: str, buf: Buffer, offset: int = 0, nbytes: int | None = None,
              note: str = "") -> None:
        """Audit a memory op: written with the request's result code when it
        is answered, at once outside a request."""
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
        mine = self.daemon.tenant_counters.setdefault(self.owner, {})
        mine[key] = mine.get(key, 0) + n

    # -- the end ------------------------------------------------------------------------

    async def close(self) -> None:
        """Abort the data endpoint (UCX cancels what is posted: nothing writes
        into memory after it), stop the copies, end the tasks, then let go of
        what the session held."""
        self.copy_stop.set()  # same-host ring copies stop within a chunk
        ep, self.ep, self.ucx = self.ep, None, None
        if ep is not None:
            ep.abort()
        for task in self.tasks.values():
            if task not in self.transfers:
                task.cancel()
        pending = list(self.tasks.values())
        if pending:
            _, stuck = await asyncio.wait(pending, timeout=ABORT_GRACE)
            if stuck and ep is not None:
                # ucxx sometimes never completes a receive it had matched
                # (seen when a client was killed mid-store): cancel the tasks.
                log.warning("session %s: %d transfers missed the endpoint abort; "
                            "cancelling them", self.session_id, len(stuck))
                for task in stuck:
                    task.cancel()
                _, stuck = await asyncio.wait(stuck, timeout=ABORT_GRACE)
            if stuck:  # their buffers stay pinned rather than risk a use-after-free
                log.error("session %s: %d transfers did not end", self.session_id, len(stuck))
        self.in_place.close()  # before the attachments: a lease's pins, then the handles
        self.write_grants.close()
        self.attachments.detach_all()
        if self.handles is not None:
            self.handles.close()
        if self.handles_nonce is not None:
            self.daemon.by_handles_nonce.pop(self.handles_nonce, None)
        if self.staging_charge is not None:
            self.registry.uncharge(self.owner, self.staging_charge, staging.SIZE)
            self.staging_charge = None
        for buf in self.registry.session_closed(self.session_id):
            self.audit("release", buf, note="session closed")
