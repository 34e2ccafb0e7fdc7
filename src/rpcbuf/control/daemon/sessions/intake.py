"""A session's incoming requests: read, decoded and started as they arrive,
with back-pressure.  Three parts, in this order:

**Intake**, one per ``Session``.  Before hello the connection is read by a
loop (``run``), one small frame at a time under one deadline from accept;
after hello the session's bytes are handed to ``_pump`` as they arrive (the
reader: no reading task to wake).  Either way at most ``max_inflight``
requests are tasks at once: past that, reading pauses (the rest waits in
the decoder) until a task ends (``slot_freed``), and answers piling up
unread pause it too.  One session dispatches at most ``PUMP_FRAMES`` frames
per loop turn: then the others' turn.

**What a half-sent frame holds.**  After hello a frame may be up to
``max_frame`` (16 MiB), and what has arrived of it waits in the decoder.
Those bytes are the tenant's: every byte the decoder holds is charged to
it (``charges``' ``frame_bytes``, all its sessions together, at most
``--max-buffered-per-tenant``) *before* it is taken in, so a tenant past it
gets QUOTA_EXCEEDED and that session ends; and a frame must arrive whole
within ``--frame-timeout`` of the first byte the decoder kept of it
(while the session is not paused by us), or the session ends.  Both go
with the session (``close``), at once: a session and its intake refer to
each other, and a buffer that waited for the garbage collector to find
the pair stayed for good on a daemon that collects rarely.  Before, a tenant with a 1 MiB quota held
15 MiB of frame on each of 64 sessions, with no deadline.

**The reader** (``SessionReader``, ``serve_tcp``, ``serve_unix``): a
``StreamReader`` that can hand a session's bytes straight to it instead of
buffering them for a reading task.  ``asyncio.start_server`` gives each
connection a ``StreamReader``: every chunk the transport receives is
appended to its buffer, a reading task is woken, resumes in ``read()`` and
only then parses.  That hand-off cost about 20-28 us per message here (a
bare uvloop echo server: 82-94 us a round trip with a reading task, 61-66
us from ``data_received``), the largest fixed cost of a 4 KiB store once
its Python was trimmed.  So once a session said hello,
``SessionReader.hand_to(sink)`` makes ``feed_data`` call ``sink`` with each
chunk, synchronously, in the transport's callback; the session pauses and
resumes reading itself (``pause``/``resume``: too many requests in flight,
or answers piling up unread).  Before hello the reader works as asyncio's
own, so a stranger's bytes go through the same bounded one-frame-at-a-time
loop.

**The start of an op** (``start``): a request's coroutine runs at once,
and becomes a task only if it waits.  Most requests never wait: a 4 KiB
same-host store locks a free range, copies one slot and answers, all in its
first step.  ``start`` runs that first step right away, in the caller's
loop turn (in a copy of the current context, as a task would), and returns
``None`` when the coroutine finished there; a coroutine that has to wait (a
lock held by another request, a UCX message, a copy thread) goes on as an
``asyncio.Task`` from where it stopped.  So an op is written once, as an
``async def``, and the cheap case costs no task, no event-loop round and no
second dispatch table.  Requests also ask for their locks in the order they
arrive: each one's first step, which takes its locks, runs when it is
dispatched.  This is Python 3.12's eager task start (``Task(...,
eager_start=True)``), used where it exists; on 3.11 the first step is taken
here and the rest driven by a task through ``_Rest``.  Either way a
handler's first step runs with no current task: nothing in it may need one
(``asyncio.timeout`` does; 3.11's ``asyncio.wait_for`` does not, and on
3.12 the task is real).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import socket
import ssl
import sys
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Protocol

from rpcbuf.control.daemon.ops.node import Node
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest, QuotaExceeded, RpcBufError, Timeout

log = logging.getLogger("rpcbuf.daemon")
READ_CHUNK = 1 << 16
PUMP_FRAMES = 64  # requests one session dispatches per loop turn (then the others' turn)
UNCHARGED = READ_CHUNK  # bytes of a session's frames in the decoder not charged to its tenant
EAGER = sys.version_info >= (3, 12)
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class IntakeSession(Protocol):
    """What the intake sees of its session (``session.Session``)."""

    daemon: Node
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    tasks: dict[int, asyncio.Task[None]]
    tenant: str | None
    peer: Any
    session_id: str

    @property
    def closed(self) -> bool: ...
    def dispatch(self, msg: dict[str, Any]) -> None: ...
    def send(self, message: dict[str, Any]) -> None: ...
    def flush(self) -> None: ...
    def abort(self, why: str) -> None: ...


class Intake:
    """The requests of one session as they arrive."""

    def __init__(self, session: IntakeSession) -> None:
        self._s = session
        self.paused = False  # reading waits for a task to end (Session.may_claim)
        self._slot = asyncio.Event()
        self._reader: SessionReader | None = None  # after hello: bytes come to _pump
        # Until hello succeeds: small frames, one at a time, one deadline from now.
        self.decoder = P.FrameDecoder(P.HELLO_MAX_FRAME, " before hello")
        self._hello_by = asyncio.get_running_loop().time() + session.daemon.limits.hello_timeout
        self._charged = 0  # bytes the decoder holds, charged to the tenant ("frame_bytes")
        self._frame_timer: asyncio.TimerHandle | None = None  # the frame now arriving

    def close(self) -> None:
        """The session ended: what the decoder holds goes, and its charge."""
        if self._frame_timer is not None:
            self._frame_timer.cancel()
            self._frame_timer = None
        self.decoder = P.FrameDecoder(0)  # the old buffer is freed with the old decoder
        self._hold(0)

    def _hold(self, nbytes: int) -> None:
        """Charge the tenant for the decoder holding ``nbytes`` (QUOTA_EXCEEDED,
        changing nothing, past its limit), or refund what it holds no more.
        The first ``UNCHARGED`` bytes of each session are not counted (the
        session caps bound them): the common small request costs nothing."""
        tenant = self._s.tenant
        more = max(0, nbytes - UNCHARGED) - self._charged
        if tenant is None or not more:
            return
        charges = self._s.daemon.charges
        if more > 0:
            charges.charge(tenant, "frame_bytes", more)
        else:
            charges.refund(tenant, "frame_bytes", -more)
        self._charged += more

    def _frame_deadline(self, progressed: bool) -> None:
        """A frame must arrive whole within ``frame_timeout`` of when the
        decoder first kept a byte of it: started when bytes wait, restarted
        when a frame completed, ended when nothing waits."""
        pending = self.decoder.pending
        timer = self._frame_timer
        if timer is not None and (progressed or not pending):
            timer.cancel()
            self._frame_timer = timer = None
        if pending and timer is None:
            self._frame_timer = asyncio.get_running_loop().call_later(
                self._s.daemon.limits.frame_timeout, self._frame_overdue)

    def _frame_overdue(self) -> None:
        self._frame_timer = None
        s, reader = self._s, self._reader
        if s.closed or reader is None or not self.decoder.pending:
            return
        if reader.held:  # we stopped reading (back-pressure): not the client's delay
            self._frame_deadline(False)
            return
        limit = s.daemon.limits.frame_timeout
        self._fail(Timeout(f"a frame did not arrive whole within {limit:g}s of its first "
                           f"byte ({self.decoder.pending} bytes of it came)",
                           {"limit": "frame_timeout", "frame_timeout": limit}))

    def _fail(self, error: RpcBufError) -> None:
        """End the session with a connection-level ``error`` frame."""
        s = self._s
        log.warning("closing %s (session %s): %s", s.peer, s.session_id, error)
        s.send(P.error_response(None, error))
        s.flush()
        with contextlib.suppress(Exception):
            s.writer.close()

    def hello_by(self, deadline: float) -> None:
        """Hello must come by ``deadline`` (the loop's clock), not later:
        a TLS connection's deadline runs from accept, its handshake included."""
        self._hello_by = min(self._hello_by, deadline)

    def said_hello(self) -> None:
        """Hello succeeded: frames up to the node's limit from now on."""
        self.decoder.max_frame, self.decoder.why = self._s.daemon.limits.max_frame, ""

    def slot_freed(self) -> None:
        """A task ended: the read loop's back-pressure wait ends, and the
        pump, paused at ``max_inflight``, goes on."""
        self._slot.set()
        if self._reader is not None and \
                len(self._s.tasks) == self._s.daemon.limits.max_inflight - 1:
            asyncio.get_running_loop().call_soon(self._pump)

    async def run(self) -> None:
        """Read, decode and dispatch until the connection ends."""
        s, limits, decoder = self._s, self._s.daemon.limits, self.decoder
        try:
            while not s.closed:
                if s.tenant is not None and isinstance(s.reader, SessionReader):
                    await self._run_handed(s.reader)
                    return
                if s.tenant is None:  # one deadline from accept, not per read
                    async with asyncio.timeout_at(self._hello_by):
                        data = await s.reader.read(READ_CHUNK)
                else:
                    data = await s.reader.read(READ_CHUNK)
                if not data:
                    return
                # Before hello one frame at a time: what follows a hello is
                # parsed under the limit that holds once it was handled.
                one = s.tenant is None
                msgs = decoder.feed(data, 1 if one else None)
                while True:
                    for msg in msgs:
                        s.dispatch(msg)
                        while len(s.tasks) >= limits.max_inflight:  # back-pressure
                            self._slot.clear()
                            self.paused = True
                            try:
                                await self._slot.wait()
                            finally:
                                self.paused = False
                    if decoder.error is not None:
                        raise decoder.error
                    if not (one and msgs) or s.closed:
                        break
                    one = s.tenant is None
                    msgs = decoder.feed(b"", 1 if one else None)
                await s.writer.drain()
        except P.FrameError as exc:
            log.warning("closing %s: %s", s.peer, exc)
            s.send(P.error_response(None, exc))
        except TimeoutError:
            log.warning("closing %s: no hello within %.0fs", s.peer, limits.hello_timeout)
        except (ConnectionError, OSError):
            pass

    async def _run_handed(self, reader: SessionReader) -> None:
        """After hello: the reader hands each chunk to ``_pump`` as it
        arrives (no reading task to wake: the reader, below); we wait for the end
        of the connection (EOF, reset: the session closes either way)."""
        self._reader = reader
        try:
            await reader.hand_to(self._pump)
        finally:
            self._reader = None

    def _pump(self, data: bytes = b"") -> None:
        """Frames as they arrive, dispatched at once, at most ``max_inflight``
        tasks in flight: past that, reading pauses (the rest waits in the
        decoder) until a task ends (``slot_freed`` pumps again)."""
        s, reader, decoder = self._s, self._reader, self.decoder
        if reader is None or s.closed:
            return
        limit = s.daemon.limits.max_inflight
        progressed = False
        try:
            if data:  # charged before it is taken in: past the limit, nothing is kept
                self._hold(decoder.pending + len(data))
            budget = PUMP_FRAMES  # this loop turn's share: other sessions go next
            while True:
                slots = limit - len(s.tasks)
                room = min(slots, budget)
                if room <= 0:
                    if data:
                        decoder.feed(data, 0)  # kept, unparsed, for later
                    reader.pause()
                    if slots > 0:  # our turn is over, not our slots: go on next turn
                        asyncio.get_running_loop().call_soon(self._pump)
                    self._settle(progressed)
                    return  # else slot_freed pumps when a task ends
                msgs = decoder.feed(data, room)
                data = b""
                budget -= len(msgs)
                progressed = progressed or bool(msgs)
                for msg in msgs:
                    s.dispatch(msg)
                if decoder.error is not None:
                    raise decoder.error
                if len(msgs) < room or s.closed:
                    break
            self._settle(progressed)
            reader.resume()
            transport = s.writer.transport
            if transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
                # Answers pile up unread (past the transport's high-water
                # mark, as a reading loop's drain() would see): read no more
                # until they drain.
                reader.pause()
                asyncio.get_running_loop().create_task(self._resume_when_drained(reader))
        except (P.FrameError, QuotaExceeded) as exc:
            self._fail(exc)
        except Exception:  # a bug: this session ends, everyone else is served
            log.exception("session %s: reading its requests failed", s.session_id)
            s.abort("internal error")

    def _settle(self, progressed: bool) -> None:
        """After a pump: the charge follows what the decoder holds now, and
        so does the frame's deadline."""
        if not self._s.closed:
            self._hold(self.decoder.pending)
            self._frame_deadline(progressed)

    async def _resume_when_drained(self, reader: SessionReader) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            await self._s.writer.drain()
        if self._reader is reader and not self._s.closed:
            reader.resume()
            self._pump()


# -- the reader: bytes straight to the session ------------------------------


class SessionReader(asyncio.StreamReader):
    """A ``StreamReader`` whose bytes can go straight to a sink.  It reads
    the base class's ``_buffer``, ``_paused``, ``_eof``, ``_exception`` and
    ``_transport`` (CPython's, unchanged since 3.4; not typed, hence ``me``)."""

    def __init__(self, limit: int, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self._sink: Callable[[bytes], None] | None = None
        self._ended: asyncio.Future[None] | None = None
        self._held = False  # reading paused by the sink's owner

    def hand_to(self, sink: Callable[[bytes], None]) -> asyncio.Future[None]:
        """From now on every chunk goes to ``sink`` (what is buffered first);
        the future completes at EOF or when the connection is lost."""
        me: Any = self
        loop = asyncio.get_running_loop()
        self._ended = ended = loop.create_future()
        self._sink = sink
        buffered = bytes(me._buffer)
        me._buffer.clear()
        if me._paused:  # asyncio paused it over a full buffer: ours to resume now
            me._paused = False
            if me._transport is not None:
                me._transport.resume_reading()
        if buffered:
            sink(buffered)
        if me._eof or me._exception is not None:
            ended.set_result(None)
        return ended

    def feed_data(self, data: Any) -> None:
        sink = self._sink
        if sink is None:
            super().feed_data(data)
        elif data:
            sink(data)

    def feed_eof(self) -> None:
        super().feed_eof()
        self._end()

    def set_exception(self, exc: Exception) -> None:
        super().set_exception(exc)
        self._end()

    def _end(self) -> None:
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(None)

    @property
    def held(self) -> bool:
        """Reading is paused by the sink's owner."""
        return self._held

    def pause(self) -> None:
        transport = getattr(self, "_transport", None)
        if not self._held and transport is not None:
            self._held = True
            transport.pause_reading()

    def resume(self) -> None:
        transport = getattr(self, "_transport", None)
        if self._held and transport is not None:
            self._held = False
            transport.resume_reading()




def _factory(handler: Handler, limit: int) -> Callable[[], asyncio.StreamReaderProtocol]:
    loop = asyncio.get_running_loop()

    def make() -> asyncio.StreamReaderProtocol:
        reader = SessionReader(limit, loop)
        return asyncio.StreamReaderProtocol(reader, handler, loop=loop)
    return make


# asyncio's default listen backlog is 100: one process flooding connects from
# one address filled it, and legitimate SYNs were dropped and retried by the
# kernel after 1 s and 3 s (connects took ~2 s, 1 in 6 timed out).  The kernel
# caps this at net.core.somaxconn (4096 on current kernels).
BACKLOG = 4096


async def serve_tcp(handler: Handler, host: str, port: int, limit: int) -> asyncio.Server:
    """``asyncio.start_server``, with a ``SessionReader`` per connection."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(_factory(handler, limit), host, port, backlog=BACKLOG)


class Acceptor:
    """A TCP listener that hands each accepted socket to ``accepted`` as it
    comes, before anything is read from it: for TLS, where the server's own
    handshake (``create_server(ssl=...)``) shows a connection to us only once
    it is done, and a stream's start_tls on uvloop loses a ClientHello read before
    it.  ``accepted`` counts the connection, then makes it a stream
    (``handshake``).  What ``Daemon`` reads of an ``asyncio.Server``:
    ``sockets`` and ``close``."""

    def __init__(self, sockets: list[socket.socket],
                 accepted: Callable[[socket.socket], Coroutine[Any, Any, None]]) -> None:
        self.sockets = sockets
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._accept(s, accepted)) for s in sockets]

    @staticmethod
    async def _accept(sock: socket.socket,
                      accepted: Callable[[socket.socket], Coroutine[Any, Any, None]]) -> None:
        loop = asyncio.get_running_loop()
        running: set[asyncio.Task[None]] = set()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:  # EMFILE and the like: the next accept may work
                log.debug("accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            task = loop.create_task(accepted(conn))
            running.add(task)  # (a task nobody holds may be collected mid-way)
            task.add_done_callback(running.discard)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for sock in self.sockets:
            sock.close()


def listen_tcp(host: str, port: int) -> list[socket.socket]:
    """Bound, listening, non-blocking sockets for ``host:port`` (every
    address the host resolves to, as ``create_server`` binds; port 0: the
    first picks one, the rest take the same)."""
    out: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
            sock = socket.socket(family, kind, proto)
            out.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if out[1:] and port == 0:
                addr = (addr[0], out[0].getsockname()[1], *addr[2:])
            sock.bind(addr)
            sock.listen(BACKLOG)
            sock.setblocking(False)
    except BaseException:
        for sock in out:
            sock.close()
        raise
    return out


TLS_HANDSHAKE = 0x16  # the first byte of a TLS record that opens a handshake
PLAIN_TO_TLS = ("this node speaks TLS and this client connected without it: pass --ca PEM "
                "(or set $RPCBUF_CA; rpcbuf.connect(tls=...)) to trust the node's certificate")
_said_plain = [0.0]  # when a plain client was last logged (once a minute at most)


class PlainClient(ConnectionError):
    """A client spoke our plain protocol to the TLS port (it was told so)."""


async def handshake(handler: Handler, sock: socket.socket, limit: int, tls: ssl.SSLContext,
                    timeout: float) -> None:
    """The TLS handshake on an accepted ``sock``; then ``handler`` gets its
    streams, as from ``serve_tcp``.  Raises what the handshake raised (the
    socket is closed then).

    A client without TLS (no ``--ca``) used to meet a closed connection and
    a log that said nothing.  The first byte tells: a TLS client opens with
    a handshake record (0x16), ours with a frame's length (0x00 for any
    frame under 16 MiB).  A plain client gets one error frame in plain text,
    ``PLAIN_TO_TLS`` (``BAD_REQUEST``, reason ``tls_required``), and the log
    a line (once a minute at most: a stranger could send many)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    try:
        async with asyncio.timeout(timeout):
            first = await _peek(loop, sock)
        if first and first[0] != TLS_HANDSHAKE:
            with contextlib.suppress(OSError):
                sock.send(P.encode_frame(P.error_response(None, BadRequest(
                    PLAIN_TO_TLS, {"reason": "tls_required"}))))
            if loop.time() - _said_plain[0] >= 60:
                _said_plain[0] = loop.time()
                log.info("a client connected without TLS (%s) and was told to use it: "
                         "%s", _peer(sock), PLAIN_TO_TLS)
            raise PlainClient("a client spoke plain TCP to the TLS port")
        await loop.connect_accepted_socket(_factory(handler, limit), sock, ssl=tls,
                                           ssl_handshake_timeout=max(0.1, deadline - loop.time()))
    except BaseException:
        sock.close()
        raise


async def _peek(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> bytes:
    """The first byte ``sock`` received, left in it (b"" at EOF)."""
    ready: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not ready.done():
            ready.set_result(None)

    fd = sock.fileno()
    loop.add_reader(fd, readable)
    try:
        await ready
    finally:
        loop.remove_reader(fd)
    try:
        return sock.recv(1, socket.MSG_PEEK)
    except (BlockingIOError, InterruptedError):
        return b"\x16"  # (spurious wake-up: let the handshake read it)


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except OSError:
        return "gone"
    return f"{host}:{port}"


async def serve_unix(handler: Handler, sock: socket.socket, limit: int) -> Any:
    """``asyncio.start_unix_server`` on a bound socket, likewise."""
    loop = asyncio.get_running_loop()
    return await loop.create_unix_server(_factory(handler, limit), sock=sock, backlog=BACKLOG)


# -- the start of an op: at once, a task only if it waits -------------------


def start(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
    """Run ``coro`` up to its first wait: ``None`` if it finished there
    (an exception it raised is raised here), else the task that runs the
    rest."""
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
    # (The loop only now: on 3.11 each get_running_loop() is a getpid() call.)
    rest: Any = _Rest(coro, waits_on)  # a coroutine by protocol (send, throw, close)
    return asyncio.get_running_loop().create_task(rest, context=ctx)


class _Rest:
    """The rest of a coroutine whose first step was taken, as a coroutine a
    task drives: the task's first step waits on what the coroutine waits
    on (``waits_on``, what it yielded); every later send and every throw
    goes into the coroutine (a cancel before the task's first step too: the
    coroutine is suspended in its await, as it would be in a task)."""

    __slots__ = ("_coro", "_waits_on")

    def __init__(self, coro: Coroutine[Any, Any, None], waits_on: Any) -> None:
        self._coro, self._waits_on = coro, waits_on

    def __await__(self) -> _Rest:
        return self

    def __iter__(self) -> _Rest:
        return self

    def __next__(self) -> Any:
        return self.send(None)

    def send(self, value: Any) -> Any:
        waits_on, self._waits_on = self._waits_on, _TAKEN
        if waits_on is not _TAKEN:
            return waits_on
        return self._coro.send(value)

    def throw(self, exc: BaseException) -> Any:
        waits_on, self._waits_on = self._waits_on, _TAKEN
        if isinstance(waits_on, asyncio.Future):  # cancelled before the task's first step:
            waits_on.cancel()  # what it waits on goes too, as Task.cancel does
        return self._coro.throw(exc)

    def close(self) -> None:
        self._coro.close()


_TAKEN = object()
