"""The daemon's core: the control server, one ``Session`` per connection, and
the UCX listener that binds data endpoints to sessions.

Requests are parsed by the sans-I/O protocol, decided by the synchronous
``Registry``, and only then turned into I/O.  Quick ops are answered inline;
``store``, ``read`` and a ``request_buffer`` that has to wait run as tasks, so
one connection carries many requests at once and answers leave in any order.

A store costs one control round trip: the client sends the request and the
payload together; the daemon checks the request, then posts the receive
straight into the buffer's arena slice.  A refused store is drained with a
1-byte receive (UCX truncates it; the sender's send completes without moving a
rendezvous payload), so the sender never hangs and nothing is parked here.

A transfer pins its buffer; release during a transfer frees the memory only
when the transfer ends.  A session that goes away aborts its UCX endpoint
first (UCX cancels what is posted), waits for its transfers, and only then
releases its session-scoped buffers.

Same host: besides TCP the daemon listens on a Unix socket (abstract by
default, so only its own network namespace sees it; ``--local-socket``) and
tells TCP clients its name and this kernel's boot id in ``hello``.  A client
on this host reconnects there; the kernel names its pid (``SO_PEERCRED``), and
its hello carries a probe (bytes and their address in its memory) that the
daemon reads back with ``process_vm_readv``.  When that works the session is
*same-host*: data requests carry the client's addresses and the daemon copies
between them and the arena itself (``dataplane/cma.py``), no UCX involved,
always on its copy threads (``copypool.py``), never on this loop.

Every request ends in ``Session._finish``, answered inline or by its task:
that one place counts it and times it for the metrics (``metrics.py``) and
writes its audit records with the result code (``logs.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import ssl
import stat
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from control.daemon import logs
from control.daemon.admission import Pending
from control.daemon.content import ContentIndex
from control.daemon.copypool import CopyPool
from control.daemon.dataops import DataOps, Held
from control.daemon.dedupops import DedupOps
from control.daemon.metrics import Metrics
from control.daemon.registry import Buffer, Registry, Waiter
from control.wire import protocol as P
from control.wire.auth import Grant, Keyring, verify
from control.wire.errors import (
    AuthFailed,
    BadRequest,
    ConnectionLost,
    QuotaExceeded,
    RpcBufError,
    ShuttingDown,
    TokenExpired,
)
from dataplane import cma
from dataplane.cuda_arena import is_device_arena
from dataplane.ucx import (
    BIND_TAG,
    NONCE_BYTES,
    DataEndpoint,
    DataListener,
    TransferError,
)

log = logging.getLogger("rpcbuf.daemon")
READ_CHUNK = 1 << 16
ABORT_GRACE = 2.0  # seconds for transfers to end after their endpoint is aborted
RENEW_AUDIT_EVERY = 10.0  # seconds between audit records of one buffer's renews
END_GRACE = 2.0  # seconds a session ended by us (Session.end) waits for the client to go
PROBE_WAIT = 0.05  # seconds the loop waits for a hello's probe (16 bytes) at most


@dataclass(frozen=True)
class Limits:
    max_frame: int = P.DEFAULT_MAX_FRAME
    max_inflight: int = 64
    transfer_timeout: float = 300.0
    drain_timeout: float = 30.0
    hello_timeout: float = 10.0  # from accept to a successful hello, one deadline
    max_sessions: int = 1024  # authenticated control connections
    # Connections before their hello, and UCX endpoints before they bind
    # (each its own count): at the bound the oldest goes (see admission.py).
    max_unauthenticated: int = 512
    max_unauthenticated_per_source: int = 128  # control connections, per address (or uid)
    copy_threads: int = 4  # same-host copies (copypool.py): at most half for one tenant

    def to_wire(self) -> dict[str, Any]:
        return {"max_frame": self.max_frame, "max_inflight": self.max_inflight,
                "transfer_timeout": self.transfer_timeout}


class Daemon:
    def __init__(self, registry: Registry, keys: Keyring, *, node_id: str,
                 limits: Limits | None = None, unsafe_same_host: bool = False) -> None:
        """``unsafe_same_host``: serve the same-host path even as root or with
        CAP_SYS_PTRACE (``--unsafe-privileged-same-host``, for tests only)."""
        self.registry = registry
        self.keys = keys
        self.node_id = node_id
        self.limits = limits or Limits()
        self.sessions: dict[str, Session] = {}  # every connection, authenticated or not
        self._by_nonce: dict[bytes, Session] = {}
        lim = self.limits
        self.unauthenticated: Pending[Session] = Pending(
            lim.max_unauthenticated, lim.max_unauthenticated_per_source)
        self.pending_endpoints: Pending[DataEndpoint] = Pending(lim.max_unauthenticated)
        self.copies = CopyPool(lim.copy_threads)
        # The hello probes (a read of client memory too, so never on the loop):
        # apart from the copies, so that a tenant's busy copies cannot delay
        # its new session's probe; one thread per tenant at most.
        self.probes = CopyPool(2, per_tenant=1)
        self.started_at = time.time()
        self.shutting_down = False
        self.stopped = False  # shutdown is done: tasks left are cancelled and let go
        self._server: asyncio.AbstractServer | None = None
        self._listener: DataListener | None = None
        self._local_server: asyncio.AbstractServer | None = None
        self.local_socket: str | None = None  # "@name" (abstract) or a path
        self._expiry_timer: asyncio.TimerHandle | None = None
        self.ucx_port = 0
        self.counters: dict[str, int] = {"bytes_stored": 0, "bytes_read": 0,
                                         "verify_failures": 0, "sessions_total": 0}
        # The same counts per tenant: what ``stats`` shows a tenant (see _stats)
        self.tenant_counters: dict[str, dict[str, int]] = {}
        self.metrics = Metrics(self)
        self.content = ContentIndex()  # dedup: daemon.py attaches the --cache-dir cache
        # Why the same-host path is refused to everyone (None: it is offered).
        self.same_host_off = cma.privileged_why()
        if self.same_host_off and unsafe_same_host:
            log.warning("--unsafe-privileged-same-host: serving the same-host path although "
                        "this daemon is root or holds CAP_SYS_PTRACE: a client can make it "
                        "write into other processes (a setuid program it execs). Tests only")
            self.same_host_off = None

    # -- lifecycle --------------------------------------------------------------

    async def start(self, host: str, port: int, ucx_port: int,
                    tls: ssl.SSLContext | None = None, local_socket: str | None = "auto") -> None:
        """``local_socket``: "auto" (an abstract Unix socket named after our
        pid), None (no same-host path), "@name" (abstract) or a path."""
        self._listener = DataListener(self._on_endpoint, port=ucx_port)
        self.ucx_port = self._listener.port
        self._server = await asyncio.start_server(
            self._on_connection, host, port, limit=READ_CHUNK, ssl=tls,
            ssl_handshake_timeout=self.limits.hello_timeout if tls else None)
        self.address = self._server.sockets[0].getsockname()[:2]
        if local_socket is not None:
            await self._start_local(local_socket)
        log.info("listening control=%s:%d ucx=%d devices=%s", self.address[0],
                 self.address[1], self.ucx_port, ",".join(self.registry.pools))

    async def _start_local(self, name: str) -> None:
        if name == "auto":
            name = f"@rpcbufd-{os.getpid()}-{secrets.token_hex(4)}"
        path = "\0" + name[1:] if name.startswith("@") else name
        if not name.startswith("@"):
            _unlink_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:  # bound here: uvloop refuses abstract names (EINVAL)
            sock.bind(path)
        except BaseException:
            sock.close()
            raise
        self._local_server = await asyncio.start_unix_server(
            self._on_connection, sock=sock, limit=READ_CHUNK)
        if not name.startswith("@"):
            os.chmod(path, 0o666)  # tokens authenticate, as on TCP
        self.local_socket = name
        self.boot_id = cma.boot_id()

    def local_info(self) -> dict[str, Any] | None:
        """What a TCP client needs to find the same-host path."""
        if self.local_socket is None:
            return None
        return {"socket": self.local_socket, "boot_id": self.boot_id, "pid": os.getpid()}

    async def shutdown(self) -> None:
        """Stop accepting, let in-flight transfers finish (bounded), close all."""
        if self.shutting_down:
            return
        self.shutting_down = True
        log.info("shutting down: %d sessions", len(self.sessions))
        if self._server is not None:
            self._server.close()
        if self._local_server is not None:
            self._local_server.close()
            if self.local_socket and not self.local_socket.startswith("@"):
                with contextlib.suppress(OSError):
                    os.unlink(self.local_socket)
        if self._listener is not None:
            self._listener.close()
        busy = [t for s in self.sessions.values() for t in s.transfers]
        if busy:
            log.info("waiting for %d in-flight transfers", len(busy))
            await asyncio.wait(busy, timeout=self.limits.drain_timeout)
        closing = [s.close("daemon shutting down") for s in list(self.sessions.values())]
        await asyncio.gather(*closing, return_exceptions=True)
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
        self.copies.close()
        self.probes.close()
        self.metrics.close()
        self.stopped = True
        log.info("stopped")

    def status_line(self) -> str:
        """One line for systemd's STATUS=."""
        used = sum(p.allocator.stats().used for p in self.registry.pools.values())
        total = sum(p.arena.size for p in self.registry.pools.values())
        return (f"serving {len(self.sessions)} sessions, {used} of {total} bytes held; "
                f"control {self.address[0]}:{self.address[1]}, ucx {self.ucx_port}")

    # -- keys -------------------------------------------------------------------

    def set_keys(self, keys: Keyring) -> int:
        """SIGHUP re-read the secret file: new hellos are checked against
        ``keys``, and a session whose token's key is gone (or now holds another
        secret) ends at once with AUTH_FAILED: revoking a key revokes its
        sessions too.  Returns how many ended."""
        self.keys = keys
        ended = 0
        for session in list(self.sessions.values()):
            grant = session.grant
            if grant is not None and keys.keys.get(grant.kid) != grant.key:
                session.end(AuthFailed(f"the key {grant.kid!r} that signed this session's "
                                       "token was revoked"))
                ended += 1
        return ended

    # -- leases -----------------------------------------------------------------

    def schedule_expiry(self) -> None:
        when = self.registry.next_expiry()
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
            self._expiry_timer = None
        if when is None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, when - time.time())
        self._expiry_timer = loop.call_later(delay, self._expire)

    def _expire(self) -> None:
        self._expiry_timer = None
        for buf in self.registry.expire():
            logs.write({"op": "expire", "tenant": buf.tenant, "session": None,
                        "buffer": buf.buffer_id, "device": buf.pool.key, "offset": 0,
                        "bytes": buf.alloc_size, "code": "OK", "duration_s": 0.0,
                        "note": "lease ran out"})
        self.schedule_expiry()

    # -- connections ------------------------------------------------------------

    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        if self.shutting_down:
            await self._refuse(reader, writer, ShuttingDown("daemon is stopping"), "shutting_down")
            return
        # --max-sessions counts authenticated sessions (Session._take_slot, at
        # hello); until then the connection is one of the unauthenticated
        # ones, whose bound drops the oldest, never the newcomer.
        session = Session(self, reader, writer)
        for old in self.unauthenticated.add(session, _source(writer)):
            old.evict()
        self.sessions[session.session_id] = session
        self._by_nonce[session.nonce] = session
        self.counters["sessions_total"] += 1
        try:
            await session.run()
        finally:
            self.unauthenticated.discard(session)
            self._by_nonce.pop(session.nonce, None)
            await session.close("connection closed")
            self.sessions.pop(session.session_id, None)

    def authenticated(self) -> int:
        """Sessions whose hello succeeded (what --max-sessions bounds)."""
        return sum(1 for s in self.sessions.values() if s.tenant is not None)

    def too_many_sessions(self) -> QuotaExceeded:
        """QUOTA_EXCEEDED, not SHUTTING_DOWN: the node is healthy and stays up;
        a configured allowance is used up and frees as other sessions close."""
        limit = self.limits.max_sessions
        return QuotaExceeded(
            f"this node serves at most {limit} sessions at once; try again later",
            {"limit": "max_sessions", "max_sessions": limit})

    async def _refuse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      error: RpcBufError, reason: str) -> None:
        """Answer a connection we will not serve with a connection-level error
        frame, then close.  Half-close and wait (briefly) for the client to go:
        closing with its hello unread would reset the connection and could
        destroy the frame before the client reads it."""
        log.warning("refusing connection from %s: %s", writer.get_extra_info("peername"), error)
        self.metrics.refused(reason)
        try:
            writer.write(P.encode_frame(P.error_response(None, error)))
            if writer.can_write_eof():
                writer.write_eof()
            async with asyncio.timeout(2.0):
                while await reader.read(READ_CHUNK):
                    pass
        except (TimeoutError, ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _on_endpoint(self, ep: DataEndpoint) -> None:
        # Until it binds, an endpoint is one of a bounded few (the oldest goes).
        for old in self.pending_endpoints.add(ep):
            log.warning("data endpoint dropped before binding: %d others wait to bind",
                        self.limits.max_unauthenticated)
            old.abort()
        nonce = np.zeros(NONCE_BYTES, dtype=np.uint8)
        try:
            await asyncio.wait_for(ep.recv(nonce, BIND_TAG), self.limits.hello_timeout)
        except (TimeoutError, TransferError) as exc:
            if ep in self.pending_endpoints:  # (else: dropped above, and said so)
                log.warning("data endpoint dropped before binding: %s", exc or "timeout")
            ep.abort()
            return
        finally:
            self.pending_endpoints.discard(ep)
        session = self._by_nonce.pop(nonce.tobytes(), None)
        ok = session is not None and session.tenant is not None and session.ep is None
        try:
            await ep.send(np.array([1 if ok else 0], dtype=np.uint8), BIND_TAG)
        except TransferError:
            ok = False
        if not ok or session is None:
            log.warning("data endpoint with an unknown nonce refused")
            ep.abort()
            return
        session.bind(ep)


class Session(DedupOps, DataOps):
    """One control connection: its tenant, its data endpoint, its requests."""

    def __init__(self, daemon: Daemon, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.daemon = daemon
        self.registry = daemon.registry
        self.reader = reader
        self.writer = writer
        self.session_id = "s-" + secrets.token_urlsafe(12)
        self.nonce = os.urandom(NONCE_BYTES)
        self.tenant: str | None = None
        self.grant: Grant | None = None  # the hello's token: whose, until when, which key
        # When the token expires, in time.perf_counter()'s terms (what _dispatch
        # compares against: one float compare per request); -inf once ended.
        self._token_deadline = math.inf
        self._token_timer: asyncio.TimerHandle | None = None
        self._ended: RpcBufError | None = None  # why we ended it (end): no more answers
        self.ep: DataEndpoint | None = None
        self.cma: cma.Peer | None = None
        self.cma_stop = threading.Event()
        self.peer = writer.get_extra_info("peername")
        # Unix socket sessions: the process that connected, pinned by a pidfd
        # now, at accept (never looked up again by pid): see cma.Peer.of_socket
        self._process, self._process_why = _accept_peer(writer)
        self.peer_pid = None if self._process is None else self._process.pid
        self.unix = writer.get_extra_info("socket").family == socket.AF_UNIX
        self._fd: int | None = None  # the Unix socket's fd: see peer_gone
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.transfers: set[asyncio.Task[None]] = set()
        self._slot = asyncio.Event()
        self._closed = False
        # Until hello succeeds: small frames, one at a time, one deadline from now.
        self._decoder = P.FrameDecoder(P.HELLO_MAX_FRAME, " before hello")
        self._hello_by = asyncio.get_running_loop().time() + daemon.limits.hello_timeout
        self._out: list[bytes] | None = None  # answers waiting for the end of this loop turn

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
        self._flush()
        self._ended = why
        self._token_deadline = -math.inf  # _dispatch refuses every request from now on
        with contextlib.suppress(Exception):
            if self.writer.can_write_eof():
                self.writer.write_eof()
        asyncio.get_running_loop().call_later(END_GRACE, self._hang_up)

    def _hang_up(self) -> None:
        if not self._closed:
            self.abort(f"the client stayed {END_GRACE:.0f}s after the session ended")

    def _token_ran_out(self) -> None:
        self._token_timer = None
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
        log.debug("session %s bound its data endpoint", self.session_id)

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
            asyncio.get_running_loop().call_soon(self._flush)
        else:  # ... the others (a pipelined burst) together, in one write, at its end
            out.append(frame)

    def _flush(self) -> None:
        out, self._out = self._out, None
        if out and not self.writer.is_closing():
            self.writer.write(b"".join(out))

    async def run(self) -> None:
        limits = self.daemon.limits
        decoder = self._decoder
        try:
            while not self._closed:
                if self.tenant is None:  # one deadline from accept, not per read
                    async with asyncio.timeout_at(self._hello_by):
                        data = await self.reader.read(READ_CHUNK)
                else:
                    data = await self.reader.read(READ_CHUNK)
                if not data:
                    return
                # Before hello one frame at a time: what follows a hello is
                # parsed under the limit that holds once it was handled.
                one = self.tenant is None
                msgs = decoder.feed(data, 1 if one else None)
                while True:
                    for msg in msgs:
                        self._dispatch(msg)
                        while len(self.tasks) >= limits.max_inflight:  # back-pressure
                            self._slot.clear()
                            await self._slot.wait()
                    if decoder.error is not None:
                        raise decoder.error
                    if not (one and msgs) or self._closed:
                        break
                    one = self.tenant is None
                    msgs = decoder.feed(b"", 1 if one else None)
                await self.writer.drain()
        except P.FrameError as exc:
            log.warning("closing %s: %s", self.peer, exc)
            self.send(P.error_response(None, exc))
        except TimeoutError:
            log.warning("closing %s: no hello within %.0fs", self.peer, limits.hello_timeout)
        except (ConnectionError, OSError):
            pass

    def evict(self) -> None:
        """Dropped to make room for newer unauthenticated connections (see
        admission.py): say why, then close; ``close`` cleans up."""
        log.warning("closing %s: no hello yet, and newer connections need the room",
                    self.peer or f"pid {self.peer_pid}")
        self.daemon.metrics.refused("max_unauthenticated")
        self.send(P.error_response(None, QuotaExceeded(
            "too many connections have not said hello yet; this one waited longest",
            {"limit": "max_unauthenticated"})))
        with contextlib.suppress(Exception):
            self.writer.close()

    def _dispatch(self, msg: dict[str, Any]) -> None:
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
                self._answer(req_id, op, self._hello(req))
                return
            if self.tenant is None:
                raise AuthFailed("say hello with a token first")
            if started >= self._token_deadline:  # a session does not outlive its token
                raise self._why_over()
            if self.daemon.shutting_down:
                raise ShuttingDown("daemon is stopping; no new requests")
            handler = _SYNC_OPS.get(type(req))
            if handler is not None:
                self._answer(req_id, op, handler(self, req))
                return
            if isinstance(req, P.RequestBuffer):
                buf = self._try_request(req)
                if buf is not None:
                    self._answer(req_id, op, self._granted(buf))
                    return
            # Same-host copies too, however small: they touch client memory,
            # which may never arrive, so never on this loop (DataOps._cma).
            self._spawn(req_id, req)
        except RpcBufError as exc:
            self._answer(req_id, op, exc)
        finally:
            logs.CURRENT.reset(token)

    def _answer(self, req_id: int, op: logs.OpRecord,
                result: dict[str, Any] | RpcBufError) -> None:
        if isinstance(result, RpcBufError):
            self.send(P.error_response(req_id, result))
            self._finish(op, result)
        else:
            self.send(P.ok_response(req_id, result))
            self._finish(op, None)

    def _finish(self, op: logs.OpRecord, error: RpcBufError | None) -> None:
        """Every request ends here, answered inline or by its task: count it,
        time it, and write its audit records with the result code."""
        code = "OK" if error is None else error.code
        self.daemon.metrics.observe(op.op, code, op.started)
        logs.finish(op, code, None if error is None else error.message)

    def _spawn(self, req_id: int, req: P.Request) -> None:
        handler = _ASYNC_OPS[type(req)]
        op = logs.CURRENT.get() or logs.OpRecord(req.op, self.tenant, self.session_id,
                                                 time.perf_counter(), req)
        assert self.tenant is not None
        held = Held(self.registry, self.tenant)  # what the handler looks up stays pinned
        task = asyncio.get_running_loop().create_task(
            self._run_task(req_id, handler(self, req_id, req, held), op, held))
        self.tasks[req_id] = task
        if not isinstance(req, P.RequestBuffer):
            self.transfers.add(task)

    async def _run_task(self, req_id: int, coro: Any, op: logs.OpRecord, held: Held) -> None:
        logs.CURRENT.set(op)  # this task's own context: its _log records land on op
        error: RpcBufError | None = None
        try:
            result = await coro
            if result is not None:  # None: the handler answered already
                self.send(P.ok_response(req_id, result))
        except RpcBufError as exc:
            error = exc
            self.send(P.error_response(req_id, exc))
        except asyncio.CancelledError:
            error = ConnectionLost("request cancelled")
            self.send(P.error_response(req_id, error))
        except Exception as exc:  # a bug: answer, log, keep serving everyone else
            log.exception("request %d failed", req_id)
            error = RpcBufError(f"internal error: {exc}")
            self.send(P.error_response(req_id, error))
        finally:
            held.release()
            self._finish(op, error)
            task = self.tasks.pop(req_id, None)
            if task is not None:
                self.transfers.discard(task)
            self._slot.set()

    async def close(self, why: str) -> None:
        """Abort the data endpoint, wait for transfers, release session buffers."""
        if self._closed:
            return
        self._closed = True
        if self._token_timer is not None:
            self._token_timer.cancel()
        self.cma_stop.set()  # same-host copies stop within a chunk
        ep, self.ep = self.ep, None
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
        if self._process is not None:
            self._process.close()  # no copy starts after this: Peer.alive() is False
        self._fd = None
        for buf in self.registry.session_closed(self.session_id):
            self._log("release", buf, note="session closed")
        self.daemon.schedule_expiry()
        self._flush()  # answers of this loop turn (a connection-level error frame) go first
        with contextlib.suppress(Exception):
            self.writer.close()
        log.info("session %s tenant=%s closed: %s", self.session_id, self.tenant, why)

    # -- ops --------------------------------------------------------------------

    def _log(self, op: str, buf: Buffer, offset: int = 0, nbytes: int | None = None,
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

    def _count(self, key: str, n: int) -> None:
        """Count ``n`` into the node's counter ``key`` and this tenant's."""
        counters = self.daemon.counters
        counters[key] = counters.get(key, 0) + n
        assert self.tenant is not None
        mine = self.daemon.tenant_counters.get(self.tenant)
        if mine is None:
            mine = self.daemon.tenant_counters[self.tenant] = {}
        mine[key] = mine.get(key, 0) + n

    def _hello(self, req: P.Hello) -> dict[str, Any]:
        if self.tenant is not None:
            raise BadRequest("hello was already said on this connection")
        version = P.negotiate(P.hello_versions(req))  # else BAD_REQUEST naming both
        grant = verify(self.daemon.keys, req.token)
        tenant = grant.tenant
        self._take_slot(tenant, req.replaces)
        self.tenant, self.grant = tenant, grant
        self.daemon.unauthenticated.discard(self)  # counts toward --max-sessions from now
        self._decoder.max_frame, self._decoder.why = self.daemon.limits.max_frame, ""
        if grant.expires_at is not None:
            left = grant.expires_at - time.time()
            self._token_deadline = time.perf_counter() + left
            self._token_timer = asyncio.get_running_loop().call_later(
                max(0.0, left), self._token_ran_out)
        same_host, why = self._same_host(req, tenant)
        log.info("session %s tenant=%s from %s%s", self.session_id, self.tenant,
                 self.peer or f"pid {self.peer_pid}", " (same host)" if same_host else "")
        answer = {
            "session_id": self.session_id,
            "tenant": self.tenant,
            "token_expires_at": grant.expires_at,  # the session ends then (None: never)
            "node_id": self.daemon.node_id,
            "version": version,
            "versions": [P.PROTOCOL_MIN, P.PROTOCOL_VERSION],
            # Each device's own checksum (what a plain store into it is verified with).
            "checksum_kinds": {p.key: "devsum" if is_device_arena(p.arena) else "xxh3"
                               for p in self.registry.pools.values()},
            "ucx": {"port": self.daemon.ucx_port},
            "bind_nonce": self.nonce,
            "devices": [p.describe() for p in self.registry.pools.values()],
            "limits": self.daemon.limits.to_wire(),
            "same_host": same_host,
        }
        if why:
            answer["same_host_why"] = why
        local = self.daemon.local_info()
        if local is not None and not self.unix:
            if self.daemon.same_host_off:  # no point reconnecting: say why here
                answer["same_host_why"] = self.daemon.same_host_off
            else:
                answer["local"] = local
        return answer

    def peer_gone(self) -> bool:
        """Whether the client closed its connection, even if nothing reads it
        now (a session at --max-inflight is not reading): same-host copies
        must not start then, the client no longer keeps its arrays."""
        if self._fd is None:
            return False
        return cma.peer_closed(self._fd)

    def _take_slot(self, tenant: str, replaces: bytes | None) -> None:
        """A Unix socket session may take over the slot of the TCP session it
        replaces (which ends now); any other checks --max-sessions, and past
        it gets a connection-level QUOTA_EXCEEDED and is closed."""
        old = self.daemon._by_nonce.get(replaces) if replaces and self.unix else None
        if old is not None and old is not self and old.tenant == tenant:
            self.daemon._by_nonce.pop(old.nonce, None)
            self.daemon.sessions.pop(old.session_id, None)  # it no longer counts
            log.debug("session %s replaces %s", self.session_id, old.session_id)
            with contextlib.suppress(Exception):
                old.writer.close()  # its run loop ends, close() cleans up
            return
        if self.daemon.authenticated() >= self.daemon.limits.max_sessions:
            error = self.daemon.too_many_sessions()
            log.warning("refusing connection from %s: %s", self.peer or f"pid {self.peer_pid}",
                        error)
            self.daemon.metrics.refused("max_sessions")
            self.send(P.error_response(None, error))
            with contextlib.suppress(Exception):
                self.writer.close()  # its hello is read: nothing unread to reset the frame
            raise error

    def _same_host(self, req: P.Hello, tenant: str) -> tuple[bool, str]:
        """Turn on the same-host path if this is a Unix socket session whose
        client proved we can read its memory, and the daemon may serve it."""
        if req.probe is None or req.probe_addr is None:
            return False, ""
        if not self.unix:
            return False, "the same-host path needs the daemon's Unix socket"
        if self.daemon.same_host_off:
            return False, self.daemon.same_host_off
        peer = self._process
        if peer is None:
            return False, f"cannot watch the client process: {self._process_why}"
        why = self._probe(tenant, peer, req.probe_addr, req.probe)
        if why is not None:
            log.info("session %s: same-host path off: %s", self.session_id, why)
            return False, why
        self._fd = self.writer.get_extra_info("socket").fileno()
        self.cma = peer
        log.debug("session %s bound the same-host path (pid %d)", self.session_id, peer.pid)
        return True, ""

    def _probe(self, tenant: str, peer: cma.Peer, addr: int, expected: bytes) -> str | None:
        """``peer.probe`` on a probe thread, the loop waiting for it at most
        PROBE_WAIT: the client chose the address, and its memory may never
        arrive (a stuck probe's thread is written off)."""
        probes = self.daemon.probes
        job = probes.submit(tenant, peer.probe, addr, expected)
        job.future.add_done_callback(_consume)
        if probes.wait(job, PROBE_WAIT, alone=False):
            result: str | None = job.future.result()
            return result
        if not probes.cancel(job):
            probes.written_off(job)
        return (f"reading the probe from the client's memory took over "
                f"{PROBE_WAIT * 1e3:.0f} ms")

    def _try_request(self, req: P.RequestBuffer) -> Buffer | None:
        assert self.tenant is not None
        pool = self.registry.pool_for(req.device_type, req.device)
        if req.ttl is not None and req.ttl <= 0:
            raise BadRequest("ttl must be positive")
        return self.registry.try_allocate(self.tenant, pool, req.size, name=req.name,
                                          ttl=req.ttl, session_id=self.session_id)

    def _granted(self, buf: Buffer) -> dict[str, Any]:
        self._log("request_buffer", buf, note=f"size={buf.size}")
        if buf.expires_at is not None:
            self.daemon.schedule_expiry()
        return buf.meta()

    async def _wait_for_memory(self, req_id: int, req: P.RequestBuffer,
                               held: Held) -> dict[str, Any]:
        assert self.tenant is not None
        pool = self.registry.pool_for(req.device_type, req.device)
        if not req.timeout:
            raise self.registry.out_of_memory(pool, req.size)
        fut: asyncio.Future[Buffer] = asyncio.get_running_loop().create_future()

        def done(buf: Buffer | None, err: RpcBufError | None) -> None:
            if fut.done():  # we gave up in the meantime: hand the memory back
                if buf is not None:
                    self.registry.release(buf)
                return
            if err is not None:
                fut.set_exception(err)
            else:
                fut.set_result(buf)  # type: ignore[arg-type]

        waiter = Waiter(self.tenant, pool, req.size,
                        {"name": req.name, "ttl": req.ttl, "session_id": self.session_id}, done)
        self.registry.enqueue(waiter)
        try:
            buf = await asyncio.wait_for(asyncio.shield(fut), req.timeout)
        except TimeoutError:
            self.registry.cancel(waiter)
            if fut.done() and not fut.exception():
                return self._granted(fut.result())  # granted at the last moment
            raise self.registry.out_of_memory(pool, req.size) from None
        except BaseException:
            self.registry.cancel(waiter)
            if fut.done() and not fut.cancelled() and not fut.exception():
                self.registry.release(fut.result())
            raise
        return self._granted(buf)

    def _get(self, buffer_id: str) -> Buffer:
        assert self.tenant is not None
        return self.registry.get(self.tenant, buffer_id)

    def _meta(self, req: P.GetBufferMeta) -> dict[str, Any]:
        return self._get(req.buffer_id).meta(tensors=req.tensors)

    def _open(self, req: P.OpenBuffer) -> dict[str, Any]:
        assert self.tenant is not None
        return self.registry.by_name(self.tenant, req.name).meta()

    def _release(self, req: P.Release) -> dict[str, Any]:
        buf = self._get(req.buffer_id)
        self.registry.release(buf)
        self._log("release", buf, note="deferred until transfers end" if buf.pins else "")
        self.daemon.schedule_expiry()
        return {"buffer_id": buf.buffer_id}

    def _renew(self, req: P.Renew) -> dict[str, Any]:
        buf = self._get(req.buffer_id)
        if req.ttl is not None and req.ttl <= 0:
            raise BadRequest("ttl must be positive")
        self.registry.renew(buf, req.ttl)
        # Renews are coalesced in the audit trail: one record per buffer per
        # RENEW_AUDIT_EVERY seconds, saying how many it stands for (a renew
        # storm must not grow the log; the last lease is always in the meta).
        now = time.monotonic()
        if now - buf.renew_logged_at >= RENEW_AUDIT_EVERY:
            also = f" (+{buf.renews_unlogged} renews since the last record)" \
                if buf.renews_unlogged else ""
            self._log("renew", buf, note=f"expires_at={buf.expires_at}{also}")
            buf.renew_logged_at, buf.renews_unlogged = now, 0
        else:
            buf.renews_unlogged += 1
            logs.quiet()
        self.daemon.schedule_expiry()
        return {"buffer_id": buf.buffer_id, "expires_at": buf.expires_at}

    def _list_devices(self, req: P.ListDevices) -> dict[str, Any]:
        return {"node_id": self.daemon.node_id,
                "devices": [p.describe() for p in self.registry.pools.values()]}

    def _list_buffers(self, req: P.ListBuffers) -> dict[str, Any]:
        assert self.tenant is not None
        return {"buffers": [b.meta() for b in self.registry.buffers_of(self.tenant)]}

    def _stats(self, req: P.Stats) -> dict[str, Any]:
        """What a tenant may see: its own sessions, buffers, bytes, waiters
        and counters, and each device's size and free bytes; nothing about
        other tenants (the node-wide figures are the operator's, in
        ``--metrics``)."""
        assert self.tenant is not None
        mine = [s for s in self.daemon.sessions.values() if s.tenant == self.tenant]
        counters = {"bytes_stored": 0, "bytes_read": 0, "verify_failures": 0,
                    **self.daemon.tenant_counters.get(self.tenant, {})}
        return {"node_id": self.daemon.node_id, "uptime": time.time() - self.daemon.started_at,
                "sessions": len(mine), "same_host_sessions": sum(1 for s in mine if s.cma),
                # node-wide, but about no tenant: connections not yet authenticated
                "unauthenticated": len(self.daemon.unauthenticated),
                "pending_endpoints": len(self.daemon.pending_endpoints),
                **counters, "expired_total": self.registry.expired_of(self.tenant),
                **self.registry.stats(self.tenant)}

    def _ping(self, req: P.Ping) -> dict[str, Any]:
        return {"time": time.time()}


def _unlink_stale(path: str) -> None:
    """Remove a socket file an earlier run left behind (nothing else)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def _consume(fut: asyncio.Future[Any]) -> None:
    """A probe nobody waits for any more: its outcome does not matter."""
    if not fut.cancelled():
        fut.exception()


def _source(writer: asyncio.StreamWriter) -> tuple[str, object]:
    """Where a connection comes from, for the per-source bound: its IP
    address, or on the Unix socket the connecting user."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family == socket.AF_UNIX:
        cred = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return "uid", struct.unpack("3i", cred)[1]
    peer = writer.get_extra_info("peername")
    return "ip", peer[0] if isinstance(peer, tuple) else peer


def _accept_peer(writer: asyncio.StreamWriter) -> tuple[cma.Peer | None, str]:
    """On a Unix socket: the connecting process (``cma.Peer.of_socket``), or
    None and why it cannot be had.  Not a Unix socket: (None, "")."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None, ""
    try:
        return cma.Peer.of_socket(sock), ""
    except OSError as exc:
        return None, exc.strerror or str(exc)


_SYNC_OPS: dict[type, Any] = {
    P.GetBufferMeta: Session._meta,
    P.OpenBuffer: Session._open,
    P.Release: Session._release,
    P.Renew: Session._renew,
    P.ListDevices: Session._list_devices,
    P.ListBuffers: Session._list_buffers,
    P.Stats: Session._stats,
    P.Ping: Session._ping,
}

# Ops that may wait (memory, locks, transfers): each runs as a task.
_ASYNC_OPS: dict[type, Any] = {
    P.RequestBuffer: Session._wait_for_memory,
    P.Store: Session._store,
    P.Read: Session._read,
    P.StoreBatch: Session._store_batch,
    P.ReadBatch: Session._read_batch,
    P.ClearBuffer: Session._clear,
    P.CopyBuffer: Session._copy,
    P.DedupStore: Session._dedup_store,
}
