"""A fake, hostile rpcbufd for client tests: an asyncio server that speaks the
real control framing (``control.wire.protocol``) and answers what a handler tells
it to, optionally with a real UCX listener for the data endpoint.  It stands
in for the third attacker (a malicious or broken daemon) and for a daemon
that dies at an exact point of a transfer, which a real daemon cannot be
made to do on cue."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from rpcbuf.control.wire import protocol as P
from rpcbuf.dataplane import shm, staging, ucx


def hello_answer(**overrides: Any) -> dict[str, Any]:
    """What a real daemon says in hello, with ``overrides`` on top (a key
    set to ``...`` is left out)."""
    answer: dict[str, Any] = {
        "session_id": "s-fake", "tenant": "alice", "node_id": "fake",
        "version": P.PROTOCOL_VERSION, "ucx": {"port": 1}, "bind_nonce": os.urandom(16),
        "devices": [], "same_host": False,
        "limits": {"max_frame": P.DEFAULT_MAX_FRAME, "max_inflight": 4,
                   "transfer_timeout": 30.0},
    }
    for key, value in overrides.items():
        if value is ...:
            answer.pop(key, None)
        else:
            answer[key] = value
    return answer


def send_handle(conn: Conn, tag: int, value: int, fd: int | None) -> None:
    """A handle-channel record on ``conn`` (the fake's end of a client's
    ``bind_handles`` connection): ``fd`` attached, or none."""
    sock = conn.writer.get_extra_info("socket").dup()
    try:
        shm.send_fds(sock, tag, value, [] if fd is None else [fd])
    finally:
        sock.close()


def staging_fd(size: int = staging.SIZE, seal: bool = True) -> int:
    """A staging area as a real daemon makes it (or, ``seal=False``, one
    that can shrink under the client's mapping)."""
    fd = shm.memfd(size, "fake-staging")
    if seal:
        shm.seal_size(fd)
    return fd


class Conn:
    """One control connection of the fake daemon."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = P.FrameDecoder()

    def send(self, msg: dict[str, Any]) -> None:
        self.writer.write(P.encode_frame(msg))

    def answer(self, req: dict[str, Any], result: dict[str, Any]) -> None:
        self.send({"id": req["id"], "ok": True, "result": result})

    def close(self) -> None:
        self.writer.close()


Handler = Callable[[Conn, dict[str, Any]], Awaitable[None]]


class FakeDaemon:
    """``handler(conn, request)`` runs for every request frame, in order."""

    def __init__(self, handler: Handler, ucx_listener: bool = False,
                 bind: bool = True) -> None:
        self.handler = handler
        self.bind = bind  # False: take the bind nonce, never answer it
        self.conns: list[Conn] = []
        self.endpoints: list[ucx.DataEndpoint] = []
        self._server: asyncio.Server | None = None
        self._listener: ucx.DataListener | None = None
        self._want_ucx = ucx_listener
        self.ucx_port = 0

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        if self._want_ucx:
            self._listener = ucx.DataListener(self._on_endpoint)
            self.ucx_port = self._listener.port
        return f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _on_endpoint(self, ep: ucx.DataEndpoint) -> None:
        nonce = np.zeros(ucx.NONCE_BYTES, dtype=np.uint8)
        await ep.recv(nonce, ucx.BIND_TAG)
        self.endpoints.append(ep)
        if self.bind:
            await ep.send(np.ones(1, dtype=np.uint8), ucx.BIND_TAG)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Conn(reader, writer)
        self.conns.append(conn)
        with contextlib.suppress(ConnectionError, OSError, P.FrameError):
            while data := await reader.read(1 << 16):
                for req in conn.decoder.feed(data):
                    await self.handler(conn, req)
        writer.close()

    async def close(self) -> None:
        for conn in self.conns:
            conn.close()
        for ep in self.endpoints:
            ep.abort()
        if self._listener is not None:
            self._listener.close()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

