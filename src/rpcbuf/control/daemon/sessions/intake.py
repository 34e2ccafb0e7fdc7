"""Accepting control connections: the listening sockets and TLS.

- Listen backlog 4096 (``BACKLOG``): with asyncio's 100, one process flooding
  connects from one address made the kernel drop legitimate SYNs (connects
  took ~2 s, 1 in 6 timed out).  The kernel caps it at net.core.somaxconn.
- With TLS the handshake is ours, not the server's: ``Acceptor`` hands each
  socket over as it is accepted, before anything is read, so a connection
  counts among the unauthenticated from accept, its handshake included
  (``Handshaking``).  Counted only once the server's handshake was done, one
  source held 18,561 fds in handshakes against caps of 128 per source.
- A plain client on the TLS port gets one plain error frame that says so
  (``BAD_REQUEST``, reason ``tls_required``), logged once a minute at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable, Coroutine
from typing import Any

from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.errors import BadRequest
from rpcbuf.dataplane import shm

log = logging.getLogger("rpcbuf.daemon")
BACKLOG = 4096
TLS_HANDSHAKE = 0x16  # the first byte of a TLS record that opens a handshake
PLAIN_TO_TLS = ("this node speaks TLS and this client connected without it: pass --ca PEM "
                "(or set $RPCBUF_CA; rpcbuf.connect(tls=...)) to trust the node's certificate")
_said_plain = [0.0]  # when a plain client was last logged
Accepted = Callable[[socket.socket], Coroutine[Any, Any, None]]


class Acceptor:
    """A TCP listener that hands each accepted socket to ``accepted`` before
    anything is read from it.  Has what the daemon reads of an
    ``asyncio.Server``: ``sockets`` and ``close``."""

    def __init__(self, sockets: list[socket.socket], accepted: Accepted) -> None:
        self.sockets = sockets
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._accept(s, accepted)) for s in sockets]

    @staticmethod
    async def _accept(sock: socket.socket, accepted: Accepted) -> None:
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
    """Bound, listening, non-blocking sockets on every address ``host``
    resolves to, as ``create_server`` binds (port 0: the first picks one,
    the rest take the same)."""
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


class PlainClient(ConnectionError):
    """A client spoke our plain protocol to the TLS port (it was told so)."""


class Handshaking:
    """A TLS connection in its handshake: one of the unauthenticated ones,
    which ``evict`` ends (no frame: it would garble the handshake)."""

    def __init__(self, sock: socket.socket, peer: Any, accepted: float) -> None:
        self.sock, self.peer, self.accepted = sock, peer, accepted
        self.task: asyncio.Task[None] | None = None
        self.done = False  # the handshake is over: the socket is its session's now

    def evict(self) -> None:
        if self.done:
            return
        if self.task is not None:
            self.task.cancel()  # the handshake closes its socket
        self.sock.close()


async def handshake(factory: Callable[[], asyncio.Protocol], sock: socket.socket,
                    tls: ssl.SSLContext, timeout: float) -> None:
    """The TLS handshake on an accepted ``sock``, within ``timeout``; then
    ``factory``'s protocol gets the connection.  Raises what the handshake
    raised, or ``PlainClient`` (the socket is closed then).  The first byte
    tells a plain client: TLS opens with 0x16, our frames with 0x00."""
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
        await loop.connect_accepted_socket(factory, sock, ssl=tls,
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


def source(sock: Any, peer: Any) -> tuple[str, object]:
    """Where a connection comes from, for the per-source bound: its IP
    address, or on the Unix socket the connecting user."""
    if sock is not None and sock.family == socket.AF_UNIX:
        return "uid", shm.peer_cred(sock)[1]
    return "ip", peer[0] if isinstance(peer, tuple) else peer
