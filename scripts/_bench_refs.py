"""The references' client ends in ``bench.py``: what rpcbuf is measured against.

``_bench_peer.py`` serves three references in another process; these are
their clients in the benchmark's process: ``RawPeer`` (raw ucxx, phases
announced over TCP so an idle peer has no UCX receive posted), ``SockPeer``
(a plain blocking TCP socket, the floor any transport must beat) and
``EchoClient`` (bare msgpack request/reply with the daemon's framing, the
floor for control ops).  Plus ``memcpy_round``, the in-process copy.  Each
exposes rounds of the ``benchkit.timing`` kind: a count in, that many
samples out, every buffer preallocated and pre-touched by the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import struct
from typing import Any

import numpy as np

from _bench_peer import (
    MODE_ECHO,
    MODE_QUIT,
    MODE_READ,
    MODE_STORE,
    PHASE,
    READ_REQUEST,
    TAG_DATA,
    TAG_REPLY,
    recv_exact,
)
from benchkit.timing import Round, blocking, timed, timed_sync
from control.wire import protocol as P
from dataplane import ucx


def memcpy_round(dst: np.ndarray, src: np.ndarray) -> Round:
    """The memcpy reference: ``np.copyto(dst, src)`` in this process."""
    return blocking(lambda n: timed_sync(lambda: np.copyto(dst, src), n))


class RawPeer:
    """Client side of the raw ucxx reference (protocol: see _bench_peer.py)."""

    def __init__(self, ep: Any, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:
        self.ep = ep
        self._reader, self._writer = reader, writer
        self._request = np.zeros(1, dtype=np.int64)
        self._ack = np.zeros(1, dtype=np.uint8)
        self._open_phase = False

    @classmethod
    async def connect(cls, port: int, phase_port: int) -> RawPeer:
        ep = await asyncio.wait_for(ucx.ucxx().create_endpoint("127.0.0.1", port), 30)
        reader, writer = await asyncio.open_connection("127.0.0.1", phase_port)
        return cls(ep, reader, writer)

    async def _phase(self, mode: int, nbytes: int, iters: int) -> None:
        if self._open_phase:  # the previous phase's "done" byte
            await self._reader.readexactly(1)
        self._writer.write(PHASE.pack(mode, nbytes, iters))
        await self._writer.drain()
        self._open_phase = mode != MODE_QUIT

    async def store(self, data: np.ndarray, iters: int) -> list[float]:
        await self._phase(MODE_STORE, data.nbytes, iters)
        ep, ack = self.ep, self._ack

        async def once() -> None:
            with ucx.busy():  # the progress policy rpcbuf's own transfers get
                await ep.send(data, tag=TAG_DATA)
                await ep.recv(ack, tag=TAG_REPLY)

        return await timed(once, iters)

    async def read(self, out: np.ndarray, iters: int) -> list[float]:
        await self._phase(MODE_READ, out.nbytes, iters)
        ep, request = self.ep, self._request
        request[0] = out.nbytes

        async def once() -> None:
            with ucx.busy():
                await ep.send(request, tag=TAG_DATA)
                await ep.recv(out, tag=TAG_REPLY)

        return await timed(once, iters)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._phase(MODE_QUIT, 0, 0), 5)
        self._writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ep.close(), 5)


class SockPeer:
    """Client side of the raw blocking TCP socket reference (see _bench_peer.py).

    A plain blocking ``socket.socket`` with ``TCP_NODELAY`` and the kernel's
    default (autotuned) buffers; sends with ``sendall`` and receives with
    ``recv_into`` a memoryview of a preallocated array.  Kernel-level 30 s
    send/receive timeouts (``SO_SNDTIMEO``/``SO_RCVTIMEO``) bound every call
    while keeping the calls plain blocking ones (a Python ``settimeout``
    would make the socket non-blocking and poll before each call)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._ack = bytearray(1)
        self._request = bytearray(READ_REQUEST.size)

    @classmethod
    def connect(cls, port: int) -> SockPeer:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.settimeout(None)  # blocking from here on
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        bound = struct.pack("ll", 30, 0)  # struct timeval: 30 s
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, bound)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, bound)
        return cls(sock)

    def _phase(self, mode: int, nbytes: int, iters: int) -> None:
        self.sock.sendall(PHASE.pack(mode, nbytes, iters))

    def store(self, data: np.ndarray, iters: int) -> list[float]:
        """Send ``data``, receive a 1-byte ack; time each."""
        self._phase(MODE_STORE, data.nbytes, iters)
        sock, view, ack = self.sock, data.data.cast("B"), memoryview(self._ack)

        def once() -> None:
            sock.sendall(view)
            recv_exact(sock, ack)

        return timed_sync(once, iters)

    def read(self, out: np.ndarray, iters: int) -> list[float]:
        """Send an 8-byte request, receive ``out.nbytes`` into ``out``; time each."""
        self._phase(MODE_READ, out.nbytes, iters)
        sock, view = self.sock, out.data.cast("B")
        request = READ_REQUEST.pack(out.nbytes)

        def once() -> None:
            sock.sendall(request)
            recv_exact(sock, view)

        return timed_sync(once, iters)

    def round_trip(self, nbytes: int, iters: int) -> list[float]:
        """Send ``nbytes``, receive them echoed; time each."""
        self._phase(MODE_ECHO, nbytes, iters)
        sock, msg = self.sock, b"\x5a" * nbytes
        back = memoryview(bytearray(nbytes))

        def once() -> None:
            sock.sendall(msg)
            recv_exact(sock, back)

        return timed_sync(once, iters)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._phase(MODE_QUIT, 0, 0)
        self.sock.close()


class EchoClient:
    """A bare msgpack request/reply client: frames out, a reader task matching ids."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._decoder = P.FrameDecoder()
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._task = asyncio.get_running_loop().create_task(self._read_loop())

    @classmethod
    async def connect(cls, port: int) -> EchoClient:
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
        return cls(reader, writer)

    async def _read_loop(self) -> None:
        try:
            while data := await self._reader.read(1 << 16):
                for msg in self._decoder.feed(data):
                    fut = self._pending.pop(msg["id"], None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg)
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ConnectionError("echo server went away"))

    def call(self, req: P.Request) -> asyncio.Future[dict[str, Any]]:
        req_id = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[req_id] = fut
        self._writer.write(P.encode_frame(req.to_wire(req_id)))
        return fut

    def close(self) -> None:
        self._task.cancel()
        self._writer.close()

