"""The references' client ends in ``bench.py``: what rpcbuf is measured against.

``_bench_peer.py`` serves two references in another process; these are
their clients in the benchmark's process: ``SockPeer`` (a plain blocking
TCP socket, the floor any transport must beat) and ``EchoClient`` (bare
msgpack request/reply with the daemon's framing, over TCP or the peer's
Unix socket: the floor for control ops).  ``RawUcxx`` drives the raw ucxx
reference, whose both ends are processes of their own
(``_bench_rawucx.py``).  Plus ``memcpy_round``, the
in-process copy.  Each exposes rounds of the ``benchkit.timing`` kind: a
count in, that many samples out, every buffer preallocated and pre-touched
by the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

import benchkit
from _bench_peer import (
    MODE_ECHO,
    MODE_QUIT,
    MODE_READ,
    MODE_STORE,
    PHASE,
    READ_REQUEST,
    recv_exact,
)
from benchkit import procs
from benchkit.timing import Round, blocking, timed_sync
from rpcbuf.control.wire import protocol as P


def memcpy_round(dst: np.ndarray, src: np.ndarray) -> Round:
    """The memcpy reference: ``np.copyto(dst, src)`` in this process."""
    return blocking(lambda n: timed_sync(lambda: np.copyto(dst, src), n))


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

    @classmethod
    async def connect_unix(cls, path: str) -> EchoClient:
        """The same echo over the peer's Unix socket (``--echo-unix``)."""
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), 10)
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



class RawUcxx:
    """The raw ucxx reference in two processes of its own (``_bench_rawucx.py``).

    The server and the client each run plain ucxx with the tuned settings;
    this object starts them, sends the client one command per round and
    reads its samples back (a blocking read, bounded by ``timeout``, on the
    event loop's thread: nothing else runs while measuring).  Between rounds
    both are stopped with SIGSTOP, because ucxx's own blocking mode keeps
    polling after its first event and would take CPU from whoever is
    measured next.  ``close`` ends both (bounded)."""

    def __init__(self, server: subprocess.Popen[bytes], client: subprocess.Popen[bytes],
                 result: int, timeout: float) -> None:
        self._server, self._client, self._result = server, client, result
        self._timeout = timeout
        self._pending = b""
        self._pause()

    @classmethod
    def start(cls, tmp: Path, max_bytes: int, loop: str = "asyncio", progress: str = "stock",
              timeout: float = 120.0, memory: str = "anon") -> RawUcxx:
        """Start the pair (raises RuntimeError, with a log's tail, if either fails)."""
        script = str(benchkit.SCRIPTS / "_bench_rawucx.py")
        slog, clog = tmp / "rawucx-server.log", tmp / "rawucx-client.log"
        how = ["--loop", loop, "--progress", progress]
        server = procs.spawn([sys.executable, script, "server", *how, "--memory", memory,
                              "--ready-file", str(tmp / "rawucx-server.ready"),
                              "--max-bytes", str(max_bytes)], slog)
        client: subprocess.Popen[bytes] | None = None
        read_end, write_end = os.pipe()
        try:
            port = procs.wait_ready(tmp / "rawucx-server.ready", server, slog, "raw ucxx server")
            client = procs.spawn([sys.executable, script, "client", *how,
                                  "--ready-file", str(tmp / "rawucx-client.ready"),
                                  "--max-bytes", str(max_bytes), "--port", port,
                                  "--result-fd", str(write_end)], clog,
                                 stdin=subprocess.PIPE, pass_fds=(write_end,))
            procs.wait_ready(tmp / "rawucx-client.ready", client, clog, "raw ucxx client")
        except BaseException:
            procs.stop(client)
            procs.stop(server)
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        return cls(server, client, read_end, timeout)

    def _signal(self, sig: int) -> None:
        for proc in (self._server, self._client):
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)

    def _pause(self) -> None:
        self._signal(signal.SIGSTOP)

    def _command(self, mode: str, nbytes: int, iters: int) -> list[float]:
        assert self._client.stdin is not None
        self._signal(signal.SIGCONT)
        try:
            self._client.stdin.write(f"{mode} {nbytes} {iters}\n".encode())
            self._client.stdin.flush()
            deadline = time.monotonic() + self._timeout
            while b"\n" not in self._pending:  # each pass reads or raises
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([self._result], [], [], left)[0]:
                    raise RuntimeError(f"raw ucxx client: no answer to {mode} {nbytes} "
                                       f"x{iters} in {self._timeout:.0f} s")
                chunk = os.read(self._result, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"raw ucxx client exited ({self._client.poll()})")
                self._pending += chunk
            line, self._pending = self._pending.split(b"\n", 1)
            return [float(s) for s in json.loads(line)["samples"]]
        finally:
            self._pause()

    def store(self, data: np.ndarray, iters: int) -> list[float]:
        """``iters`` sends of ``data.nbytes`` bytes, each followed by a 1-byte ack."""
        return self._command("store", data.nbytes, iters)

    def read(self, out: np.ndarray, iters: int) -> list[float]:
        """``iters`` 8-byte requests, each answered by ``out.nbytes`` bytes."""
        return self._command("read", out.nbytes, iters)

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        if self._client.stdin is not None:
            with contextlib.suppress(OSError):
                self._client.stdin.write(b"quit\n")
                self._client.stdin.flush()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._client.wait(5)
        procs.stop(self._client, 5)
        procs.stop(self._server, 5)
        with contextlib.suppress(OSError):
            os.close(self._result)
