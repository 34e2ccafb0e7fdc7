"""A session's incoming requests: read, decoded and dispatched as they
arrive, with back-pressure (``Intake``, one per ``Session``).

Before hello the connection is read by a loop (``run``), one small frame at
a time under one deadline from accept; after hello the session's bytes are
handed to ``_pump`` as they arrive (``reader.py``: no reading task to wake).
Either way at most ``max_inflight`` requests are tasks at once: past that,
reading pauses (the rest waits in the decoder) until a task ends
(``slot_freed``), and answers piling up unread pause it too.  One session
dispatches at most ``PUMP_FRAMES`` frames per loop turn: then the others'
turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from rpcbuf.control.daemon.ops.node import Node
from rpcbuf.control.daemon.sessions.reader import SessionReader
from rpcbuf.control.wire import protocol as P

log = logging.getLogger("rpcbuf.daemon")
READ_CHUNK = 1 << 16
PUMP_FRAMES = 64  # requests one session dispatches per loop turn (then the others' turn)


class Session(Protocol):
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

    def __init__(self, session: Session) -> None:
        self._s = session
        self.paused = False  # reading waits for a task to end (Session.may_claim)
        self._slot = asyncio.Event()
        self._reader: SessionReader | None = None  # after hello: bytes come to _pump
        # Until hello succeeds: small frames, one at a time, one deadline from now.
        self.decoder = P.FrameDecoder(P.HELLO_MAX_FRAME, " before hello")
        self._hello_by = asyncio.get_running_loop().time() + session.daemon.limits.hello_timeout

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
        arrives (no reading task to wake: ``reader.py``); we wait for the end
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
        try:
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
                    return  # else slot_freed pumps when a task ends
                msgs = decoder.feed(data, room)
                data = b""
                budget -= len(msgs)
                for msg in msgs:
                    s.dispatch(msg)
                if decoder.error is not None:
                    raise decoder.error
                if len(msgs) < room or s.closed:
                    break
            reader.resume()
            transport = s.writer.transport
            if transport.get_write_buffer_size() > transport.get_write_buffer_limits()[1]:
                # Answers pile up unread (past the transport's high-water
                # mark, as a reading loop's drain() would see): read no more
                # until they drain.
                reader.pause()
                asyncio.get_running_loop().create_task(self._resume_when_drained(reader))
        except P.FrameError as exc:
            log.warning("closing %s: %s", s.peer, exc)
            s.send(P.error_response(None, exc))
            s.flush()
            with contextlib.suppress(Exception):
                s.writer.close()
        except Exception:  # a bug: this session ends, everyone else is served
            log.exception("session %s: reading its requests failed", s.session_id)
            s.abort("internal error")

    async def _resume_when_drained(self, reader: SessionReader) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            await self._s.writer.drain()
        if self._reader is reader and not self._s.closed:
            reader.resume()
            self._pump()
