"""Reference peer for ``scripts/bench.py``: what rpcbuf is measured against.

One process, under uvloop, serving two things on 127.0.0.1 (the raw ucxx
reference has processes of its own: ``_bench_rawucx.py``):

* a bare msgpack echo server: length-prefixed frames in, the same frames out,
  parsed and re-encoded with ``control.wire.protocol`` (as the daemon does), with
  the daemon's read loop shape (read, decode, write each answer, drain); on
  TCP, and with ``--echo-unix PATH`` also on that Unix socket (the same-host
  path's control channel is one: its echo must be one too).
* a raw blocking TCP socket server, in its own thread (not asyncio; the
  socket calls release the GIL, and the event loop is idle meanwhile), with
  ``TCP_NODELAY`` and the kernel's default (autotuned) socket buffers.  Per
  connection, phases like the ucxx ones but in-band: a ``PHASE`` header
  ``[mode, nbytes, iters]``, then ``iters`` exchanges with one preallocated,
  pre-touched buffer of its own, each received with ``recv_into`` a
  memoryview and sent with ``sendall``: ``MODE_STORE``: recv ``nbytes``,
  send a 1-byte ack; ``MODE_READ``: recv an 8-byte request holding the size,
  send that many bytes; ``MODE_ECHO``: recv ``nbytes``, send them back;
  ``MODE_QUIT`` (or EOF) ends the connection.

Once listening it writes ``ECHO_PORT SOCKET_PORT`` to
``--ready-file``.  It exits 0 on SIGTERM/SIGINT, and on its own when its
parent process goes away.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import struct
import threading

import numpy as np

from benchkit.procs import write_ready
from rpcbuf.control.wire import protocol as P

MODE_QUIT, MODE_STORE, MODE_READ, MODE_ECHO = 0, 1, 2, 3
READ_CHUNK = 1 << 16


PHASE = struct.Struct("<qqq")  # mode, nbytes, iters: a raw socket phase's header
READ_REQUEST = struct.Struct("<q")  # the raw socket's read request: the size wanted


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from a blocking socket; EOF raises ConnectionError."""
    got, n = 0, len(view)
    while got < n:  # each pass receives at least one byte or raises
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the socket")
        got += k


def serve_socket(conn: socket.socket, buf: np.ndarray) -> None:
    """One raw socket client: phases until MODE_QUIT or EOF (blocking calls)."""
    header = bytearray(PHASE.size)
    request = bytearray(READ_REQUEST.size)
    whole = buf.data.cast("B")
    ack = b"\x01"
    try:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                recv_exact(conn, memoryview(header))
                mode, nbytes, iters = PHASE.unpack(header)
                if mode == MODE_STORE:
                    view = whole[:nbytes]
                    for _ in range(iters):
                        recv_exact(conn, view)
                        conn.sendall(ack)
                elif mode == MODE_READ:
                    for _ in range(iters):
                        recv_exact(conn, memoryview(request))
                        conn.sendall(whole[: READ_REQUEST.unpack(request)[0]])
                elif mode == MODE_ECHO:
                    view = whole[:nbytes]
                    for _ in range(iters):
                        recv_exact(conn, view)
                        conn.sendall(view)
                else:
                    break
    except (ConnectionError, OSError):
        pass  # the client went away


def socket_server(listener: socket.socket, buf: np.ndarray) -> None:
    """Accept loop (a daemon thread: it ends with the process)."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # closed
        threading.Thread(target=serve_socket, args=(conn, buf), daemon=True,
                         name="raw-socket").start()


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    decoder = P.FrameDecoder()
    try:
        while True:
            data = await reader.read(READ_CHUNK)
            if not data:
                break
            for msg in decoder.feed(data):
                writer.write(P.encode_frame(msg))
            await writer.drain()
    except (ConnectionError, OSError, P.FrameError):
        pass
    finally:
        writer.close()


async def main(args: argparse.Namespace) -> None:
    server = await asyncio.start_server(echo, "127.0.0.1", 0, limit=READ_CHUNK)
    echo_port = server.sockets[0].getsockname()[1]
    sock_buf = np.empty(args.max_bytes, dtype=np.uint8)
    sock_buf.fill(0x5A)  # the raw socket's own buffer, pre-touched too
    sock_listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=socket_server, args=(sock_listener, sock_buf), daemon=True,
                     name="raw-socket-accept").start()
    sock_port = sock_listener.getsockname()[1]
    unix = None
    if args.echo_unix:
        unix = await asyncio.start_unix_server(echo, args.echo_unix, limit=READ_CHUNK)
    write_ready(args.ready_file, f"{echo_port} {sock_port}\n")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()
    while not stop.is_set() and os.getppid() == parent:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    server.close()
    if unix is not None:
        unix.close()
    with contextlib.suppress(OSError):
        sock_listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
    sock_listener.close()


def cli() -> None:
    p = argparse.ArgumentParser(
        description="bench.py's reference peer (echo, raw socket)")
    p.add_argument("--ready-file", required=True)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--echo-unix", help="also serve the echo on this Unix socket path")
    args = p.parse_args()
    import uvloop

    uvloop.run(main(args))


if __name__ == "__main__":
    cli()
