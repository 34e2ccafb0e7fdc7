"""One ``Session`` per control connection: an ``asyncio.Protocol`` that owns
the bytes in, the frames, the hello, dispatch, the answers and the end; its
ops are its ``SessionOps`` (``inflight``).

- Frames are decoded in ``data_received`` itself, with no reading task to
  wake.  Before hello a frame is at most
  ``HELLO_MAX_FRAME``, frames are parsed one at a time (what follows a hello
  is parsed under the limit after it), and hello is due ``hello_timeout``
  after accept (a TLS handshake included).
- Back-pressure: past ``max_inflight`` ops in flight, ``PUMP_FRAMES`` frames
  this loop turn, or answers piling up unread (``pause_writing``), reading
  pauses and what came waits in the decoder.
- A half-sent frame is its tenant's: the decoder's bytes past ``UNCHARGED``
  are charged (``frame_bytes``) before they are taken in, QUOTA_EXCEEDED
  ending the session; and it must arrive whole within ``frame_timeout`` of
  its first byte, unless we paused reading.  Both go at ``close``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Callable
from typing import Any

from rpcbuf.control.daemon.observe import logs
from rpcbuf.control.daemon.ops.node import Node
from rpcbuf.control.daemon.sessions import greeting
from rpcbuf.control.daemon.sessions.inflight import Result, SessionOps
from rpcbuf.control.daemon.sessions.intake import Handshaking, source
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.auth import Grant
from rpcbuf.control.wire.errors import (
    AuthFailed,
    BadRequest,
    QuotaExceeded,
    RpcBufError,
    ShuttingDown,
    Timeout,
    TokenExpired,
)
from rpcbuf.dataplane.ucx import NONCE_BYTES, DataEndpoint

log = logging.getLogger("rpcbuf.daemon")
END_GRACE = 2.0  # seconds a session we ended (or refused) waits for the client to go
PUMP_FRAMES = 64  # frames one session dispatches per loop turn (then the others' turn)
UNCHARGED = 1 << 16  # bytes of a session's frames in the decoder not charged to its tenant


class Session(asyncio.Protocol):
    """One control connection: its tenant, its hello, its requests."""

    def __init__(self, daemon: Node, handshaking: Handshaking | None = None) -> None:
        self.daemon = daemon
        self.transport: Any = None  # an asyncio (or uvloop) transport
        self._handshaking = handshaking  # a TLS connection's, counted from accept
        self.session_id = "s-" + secrets.token_urlsafe(12)
        self.nonce = os.urandom(NONCE_BYTES)  # binds the client's UCX endpoint
        self.peer: Any = None
        self.unix = False
        self.peer_pid: int | None = None
        self.grant: Grant | None = None  # the hello's token: whose, until when, which key
        self.challenged: greeting.Challenged | None = None
        # When the token expires, in time.perf_counter()'s terms; -inf once ended.
        self.token_deadline = math.inf
        self.token_timer: asyncio.TimerHandle | None = None
        self._hello_timer: asyncio.TimerHandle | None = None
        self._ended: RpcBufError | None = None  # why we ended it (end): no more answers
        self.slot_charged = False  # its tenant is charged its session ("sessions")
        self.ops: SessionOps  # made in connection_made (none for a handshake that fails)
        self._closed = False
        self._closer: asyncio.Task[None] | None = None
        self._out: list[bytes] | None = None  # answers waiting for the end of this loop turn
        self._decoder = P.FrameDecoder(P.HELLO_MAX_FRAME, " before hello")
        self._charged = 0  # bytes the decoder holds, charged to the tenant ("frame_bytes")
        self._frame_timer: asyncio.TimerHandle | None = None  # the frame now arriving
        self._held = False  # we paused reading
        self._writes_held = False  # the transport's buffer is past its high-water mark

    @property
    def tenant(self) -> str | None:
        return self.ops.tenant

    def bind(self, ep: DataEndpoint) -> None:
        if self._closed:
            ep.abort()
        else:
            self.ops.bind(ep)

    # -- asyncio.Protocol --------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        """One of the unauthenticated now (at their bound the oldest goes)."""
        self.transport = transport
        sock = transport.get_extra_info("socket")
        self.peer = transport.get_extra_info("peername")
        self.unix = sock is not None and sock.family == socket.AF_UNIX
        self.peer_pid = greeting.peer_pid(sock) if self.unix else None
        d, loop = self.daemon, asyncio.get_running_loop()
        if d.shutting_down:
            self._refuse(ShuttingDown("daemon is stopping"), "shutting_down")
            return
        self.ops = SessionOps(d, self.session_id, self._reply, self.abort, self._slot_freed)
        hello_by = loop.time() + d.limits.hello_timeout
        shaking = self._handshaking
        if shaking is not None:  # the session takes its handshake's place
            shaking.done = True
            d.unauthenticated.discard(shaking)
            hello_by = min(hello_by, shaking.accepted + d.limits.hello_timeout)
        self._hello_timer = loop.call_at(hello_by, self._no_hello)
        for old in d.unauthenticated.add(self, source(sock, self.peer)):
            old.evict()
        d.sessions[self.session_id] = self
        d.by_nonce[self.nonce] = self
        d.counters["sessions_total"] += 1

    def data_received(self, data: bytes) -> None:
        if not self._closed:
            self._pump(data)

    def eof_received(self) -> bool:
        self._lost()
        return False  # the transport closes: a half-closed client is gone

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost()

    def pause_writing(self) -> None:
        self._writes_held = True  # answers pile up unread: the pump reads no more

    def resume_writing(self) -> None:
        self._writes_held = False
        asyncio.get_running_loop().call_soon(self._pump)

    def _lost(self) -> None:
        if self._closer is None:
            self._closer = asyncio.get_running_loop().create_task(  # not in an op's context:
                self.close("connection closed"), context=contextvars.Context())  # its audits

    # -- bytes in ----------------------------------------------------------------

    def _pump(self, data: bytes = b"") -> None:
        """Decode and dispatch what came while this turn has room; reading
        pauses until a task ends, the next turn, or ``resume_writing``."""
        if self._closed or self.transport.is_closing():
            return
        decoder, limit = self._decoder, self.daemon.limits.max_inflight
        progressed = blocked = False
        try:
            if data and self.tenant is not None:  # charged before it is taken in
                self._hold(decoder.pending + len(data))
            budget = PUMP_FRAMES
            while not self._closed and not self.transport.is_closing():
                room = min(limit - len(self.ops.tasks), budget)
                if room <= 0 or self._writes_held:
                    blocked = True
                    break
                ask = room if self.tenant is not None else 1  # before hello: one at a time
                msgs = decoder.feed(data, ask)
                data = b""
                budget -= len(msgs)
                progressed = progressed or bool(msgs)
                for msg in msgs:
                    self.dispatch(msg)
                if decoder.error is not None:
                    raise decoder.error
                if len(msgs) < ask:
                    break
            if data:
                decoder.feed(data, 0)  # kept, unparsed, for later
            if self._closed:
                return
            if not blocked:
                self._resume()
            else:
                self._pause()
                if budget <= 0 and len(self.ops.tasks) < limit:  # the turn is over
                    asyncio.get_running_loop().call_soon(self._pump)
            if self.tenant is not None:
                self._hold(decoder.pending)
                self._frame_deadline(progressed)
        except (P.FrameError, QuotaExceeded) as exc:
            self._fail(exc)
        except Exception:  # a bug: this session ends, everyone else is served
            log.exception("session %s: reading its requests failed", self.session_id)
            self.abort("internal error")

    def _pause(self) -> None:
        if not self._held:
            self._held = True
            self.transport.pause_reading()

    def _resume(self) -> None:
        if self._held:
            self._held = False
            self.transport.resume_reading()

    def _slot_freed(self) -> None:
        if len(self.ops.tasks) == self.daemon.limits.max_inflight - 1:
            asyncio.get_running_loop().call_soon(self._pump)

    def _hold(self, nbytes: int) -> None:
        """Charge the tenant for the decoder holding ``nbytes`` (QUOTA_EXCEEDED,
        changing nothing, past its limit), or refund the difference."""
        tenant = self.tenant
        more = max(0, nbytes - UNCHARGED) - self._charged
        if tenant is None or not more:
            return
        if more > 0:
            self.daemon.charges.charge(tenant, "frame_bytes", more)
        else:
            self.daemon.charges.refund(tenant, "frame_bytes", -more)
        self._charged += more

    def _frame_deadline(self, progressed: bool) -> None:
        """Started when a frame's bytes wait, restarted when one completed."""
        pending, timer = self._decoder.pending, self._frame_timer
        if timer is not None and (progressed or not pending):
            timer.cancel()
            self._frame_timer = timer = None
        if pending and timer is None:
            self._frame_timer = asyncio.get_running_loop().call_later(
                self.daemon.limits.frame_timeout, self._frame_overdue)

    def _frame_overdue(self) -> None:
        self._frame_timer = None
        if self._closed or not self._decoder.pending:
            return
        if self._held:  # we stopped reading: not the client's delay
            self._frame_deadline(False)
            return
        limit = self.daemon.limits.frame_timeout
        self._fail(Timeout(f"a frame did not arrive whole within {limit:g}s of its first "
                           f"byte ({self._decoder.pending} bytes of it came)",
                           {"limit": "frame_timeout", "frame_timeout": limit}))

    def _no_hello(self) -> None:
        self._hello_timer = None
        if self.tenant is None and not self._closed:
            log.warning("closing %s: no hello within %.0fs", self.peer,
                        self.daemon.limits.hello_timeout)
            self.shut()

    # -- answers and the end -----------------------------------------------------

    def send(self, message: dict[str, Any]) -> None:
        if self._closed or self._ended is not None or self.transport.is_closing():
            return
        try:
            frame = P.encode_frame(message, self.daemon.limits.max_frame)
        except P.FrameError as exc:
            frame = P.encode_frame(P.error_response(message.get("id"), BadRequest(str(exc))))
        out = self._out
        if out is None:  # the first answer of a loop turn leaves at once (latency) ...
            self.transport.write(frame)
            self._out = []
            asyncio.get_running_loop().call_soon(self.flush)
        else:  # ... the others (a pipelined burst) together, in one write, at its end
            out.append(frame)

    def flush(self) -> None:
        out, self._out = self._out, None
        if out and not self.transport.is_closing():
            self.transport.write(b"".join(out))

    def _reply(self, req_id: int, result: Result) -> None:
        """The one answer path: every request's answer frame leaves here, once."""
        if isinstance(result, RpcBufError):
            self.send(P.error_response(req_id, result))
        else:
            self.send(P.ok_response(req_id, result))

    def _fail(self, error: RpcBufError) -> None:
        """End the session with a connection-level ``error`` frame."""
        log.warning("closing %s (session %s): %s", self.peer, self.session_id, error)
        self.send(P.error_response(None, error))
        self.shut()

    def _refuse(self, error: RpcBufError, reason: str) -> None:
        """A connection we will not serve: the error frame, then it goes."""
        log.warning("refusing connection from %s: %s", self.peer, error)
        self.daemon.metrics.refused(reason)
        self._closed = True  # what it sends is dropped; it was never counted
        self.transport.write(P.encode_frame(P.error_response(None, error)))
        self._half_close(self.shut)

    def abort(self, why: str) -> None:
        """Abort the UCX endpoint (UCX cancels what is posted on it) and drop
        the connection; ``close`` then cleans up."""
        log.warning("session %s aborted: %s", self.session_id, why)
        if self.ops.ep is not None:
            self.ops.ep.abort()
        self.shut()

    def end(self, why: RpcBufError) -> None:
        """End the session from our side (its token expired, its key was
        revoked): requests are refused unanswered from now on, and after
        END_GRACE it is aborted whatever the client does."""
        if self._closed or self._ended is not None:
            return
        log.info("session %s tenant=%s ended: %s", self.session_id, self.tenant, why)
        self.send(P.error_response(None, why))
        self.flush()
        self._ended = why
        self.token_deadline = -math.inf  # dispatch refuses every request from now on
        self._half_close(self._hang_up)

    def shut(self) -> None:
        """Close the connection, our unsent answers first; a peer that has not
        read them within END_GRACE is reset, so one that never reads cannot
        keep its fd and our buffers (asyncio's close waits for the drain)."""
        transport = self.transport
        if transport.is_closing():
            return  # an earlier shut (or the loss) saw to it
        self.flush()  # this loop turn's answers (a connection-level error frame) first
        transport.close()
        asyncio.get_running_loop().call_later(END_GRACE, transport.abort)

    def _half_close(self, then: Callable[[], None]) -> None:
        """Our half closes after the error frame, ``then`` comes after END_GRACE:
        closing with the client's frames unread could reset away the frame."""
        with contextlib.suppress(Exception):
            if self.transport.can_write_eof():
                self.transport.write_eof()
        asyncio.get_running_loop().call_later(END_GRACE, then)

    def _hang_up(self) -> None:
        if not self._closed:
            self.abort(f"the client stayed {END_GRACE:.0f}s after the session ended")

    def token_ran_out(self) -> None:
        self.token_timer = None
        self.end(self._why_over())

    def _why_over(self) -> RpcBufError:
        """A fresh error (one is raised once) for a request after ``end``."""
        if self._ended is not None:
            return type(self._ended)(self._ended.message, self._ended.details)
        expired = None if self.grant is None else self.grant.expires_at
        return TokenExpired("this session's token expired; connect again with a new token",
                            {"expired_at": expired})

    def evict(self) -> None:
        """Dropped to make room for newer unauthenticated connections."""
        self.daemon.metrics.refused("max_unauthenticated")
        log.warning("closing %s: no hello yet, and newer connections need the room",
                    self.peer or f"pid {self.peer_pid}")
        self.send(P.error_response(None, QuotaExceeded(
            "too many connections have not said hello yet; this one waited longest",
            {"limit": "max_unauthenticated"})))
        self.shut()

    # -- hello --------------------------------------------------------------------

    def _challenge(self, req: P.Challenge) -> dict[str, Any]:
        """Said once per connection, whatever its outcome: no probing key ids."""
        if self.tenant is not None or self.challenged is not None:
            raise BadRequest("challenge is said once per connection, before hello")
        self.challenged = greeting.USED
        self.challenged, result = greeting.challenge(self.daemon, req)
        return result

    def _hello(self, req: P.Hello) -> dict[str, Any]:
        d = self.daemon
        if self.tenant is not None:
            raise BadRequest("hello was already said on this connection")
        if req.proof is None:
            raise BadRequest("hello carries a proof over the challenge's nonces (protocol "
                             f"{P.PROTOCOL_VERSION}); the token itself is never sent",
                             {"reason": "no_proof"})
        said, self.challenged = self.challenged, greeting.USED  # one hello per challenge
        grant = greeting.check(d, said, req)
        assert said is not None
        self._take_slot(grant.tenant, req.replaces)
        self.ops.tenant, self.grant = grant.tenant, grant
        d.unauthenticated.discard(self)  # counts toward --max-sessions from now
        self._decoder.max_frame, self._decoder.why = d.limits.max_frame, ""
        if grant.expires_at is not None:
            left = grant.expires_at - time.time()
            self.token_deadline = time.perf_counter() + left
            self.token_timer = asyncio.get_running_loop().call_later(
                max(0.0, left), self.token_ran_out)
        sock = self.transport.get_extra_info("socket")
        why = self.ops.grant_same_host(sock, self.unix) if req.handles else ""
        nonce = self.ops.handles_nonce
        log.info("session %s tenant=%s from %s%s", self.session_id, self.tenant,
                 self.peer or f"pid {self.peer_pid}", " (same host)" if nonce else "")
        return greeting.answer(d, self.session_id, grant, self.nonce, self.unix, nonce, why,
                               said.version)

    def _take_slot(self, tenant: str, replaces: bytes | None) -> None:
        """A Unix socket session may take over the slot of the TCP session it
        replaces (which ends now); any other is held to --max-sessions and
        --max-sessions-per-tenant, past which it is closed with QUOTA_EXCEEDED."""
        d = self.daemon
        old = greeting.replaced(d, self.session_id, tenant, replaces if self.unix else None)
        if old is not None:
            self.slot_charged, old.slot_charged = old.slot_charged, False  # its charge is ours
            old.shut()  # its close() cleans it up
            return
        error = greeting.refused(d, tenant, self.peer or f"pid {self.peer_pid}")
        if error is not None:
            self.send(P.error_response(None, error))
            self.shut()  # its hello is read: nothing unread to reset the frame
            raise error
        d.charges.charge(tenant, "sessions")  # checked above: the table counts it
        self.slot_charged = True

    def _bind_handles(self, req: P.BindHandles) -> None:
        """This connection is another session's handle channel: hand its
        socket over and let this one go (it never says hello)."""
        if self.tenant is not None or not self.unix:
            raise BadRequest("bind_handles is the only frame of a second connection to the "
                             "daemon's Unix socket")
        SessionOps.bind_handles(self.daemon, req.nonce, self.transport.get_extra_info("socket"))
        self.daemon.unauthenticated.discard(self)
        self.transport.abort()  # its socket lives on as a dup

    # -- dispatch -----------------------------------------------------------------

    def dispatch(self, msg: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            req_id, req = P.parse_request(msg)
        except P.RequestError as exc:
            self.send(P.error_response(exc.req_id, exc.error))
            self.daemon.metrics.observe("invalid", exc.error.code, started)
            return
        op = logs.OpRecord(req.op, self.tenant, self.session_id, started, req)
        if req_id in self.ops.tasks:
            self._answer(req_id, op, BadRequest(f"request id {req_id} is in flight"))
            return
        token = logs.CURRENT.set(op)  # what the op records attaches to this request
        try:
            if isinstance(req, P.Hello):
                self._answer(req_id, op, self._hello(req))
            elif isinstance(req, P.Challenge):
                self._answer(req_id, op, self._challenge(req))
            elif isinstance(req, P.BindHandles):
                self._bind_handles(req)  # answers nothing: the channel carries records
            elif self.tenant is None:
                raise AuthFailed("say hello first")
            elif started >= self.token_deadline:  # a session does not outlive its token
                raise self._why_over()
            elif self.daemon.shutting_down:
                raise ShuttingDown("daemon is stopping; no new requests")
            else:
                handler, may_wait = self.ops.table[type(req)]
                if may_wait:
                    self.ops.start(req_id, req, handler, op)
                else:
                    self._answer(req_id, op, handler(req))
        except RpcBufError as exc:
            self._answer(req_id, op, exc)
        finally:
            logs.CURRENT.reset(token)

    def _answer(self, req_id: int, op: logs.OpRecord, result: Result) -> None:
        self._reply(req_id, result)
        self.ops.finish(op, result if isinstance(result, RpcBufError) else None)

    # -- close --------------------------------------------------------------------

    async def close(self, why: str) -> None:
        """End the ops (``SessionOps.close``: transfers first), then the
        connection; the tenant's slot and frame bytes go whatever fails."""
        if self._closed:
            return
        self._closed = True
        d = self.daemon
        d.unauthenticated.discard(self)
        d.by_nonce.pop(self.nonce, None)
        for timer in (self.token_timer, self._hello_timer, self._frame_timer):
            if timer is not None:
                timer.cancel()
        try:
            await self.ops.close()
        finally:
            self._decoder = P.FrameDecoder(0)  # the half-received frame goes, and its charge
            self._hold(0)
            if self.slot_charged and self.tenant is not None:
                self.slot_charged = False
                d.charges.refund(self.tenant, "sessions")
            d.sessions.pop(self.session_id, None)
        d.schedule_expiry()
        self.shut()
        if self.tenant is None:  # a probe (doctor's "is anything listening?"), a scanner
            where = "{}:{}".format(*self.peer[:2]) if isinstance(self.peer, tuple) \
                else f"pid {self.peer_pid}"
            log.info("connection %s from %s closed before saying hello: %s", self.session_id,
                     where, why)
        else:
            log.info("session %s tenant=%s closed: %s", self.session_id, self.tenant, why)
