"""How a session's bytes reach it: a ``StreamReader`` that can hand them
straight to the session instead of buffering them for a reading task.

``asyncio.start_server`` gives each connection a ``StreamReader``: every
chunk the transport receives is appended to its buffer, a reading task is
woken, resumes in ``read()`` and only then parses.  That hand-off cost about
20-28 us per message here (a bare uvloop echo server: 82-94 us a round trip
with a reading task, 61-66 us from ``data_received``), the largest fixed
cost of a 4 KiB store once its Python was trimmed.  So once a session said
hello, ``SessionReader.hand_to(sink)`` makes ``feed_data`` call ``sink``
with each chunk, synchronously, in the transport's callback; the session
pauses and resumes reading itself (``pause``/``resume``: too many requests
in flight, or answers piling up unread).  Before hello the reader works as
asyncio's own, so a stranger's bytes go through the same bounded
one-frame-at-a-time loop as before.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


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


async def serve_tcp(handler: Handler, host: str, port: int, limit: int,
                    tls: ssl.SSLContext | None, handshake_timeout: float | None
                    ) -> asyncio.Server:
    """``asyncio.start_server``, with a ``SessionReader`` per connection."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(_factory(handler, limit), host, port, ssl=tls,
                                    ssl_handshake_timeout=handshake_timeout,
                                    backlog=BACKLOG)


async def serve_unix(handler: Handler, sock: socket.socket, limit: int) -> Any:
    """``asyncio.start_unix_server`` on a bound socket, likewise."""
    loop = asyncio.get_running_loop()
    return await loop.create_unix_server(_factory(handler, limit), sock=sock, backlog=BACKLOG)
