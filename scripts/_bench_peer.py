"""Reference peer for ``scripts/bench.py``: what rpcbuf is measured against.

One process, under uvloop, serving three things on 127.0.0.1:

* a raw ucxx listener (same UCX settings as rpcbufd, via
  ``dataplane.ucx.apply_defaults``) and a phase TCP server: for each phase
  header ``[mode, nbytes, iters]`` read from TCP it runs
  ``iters`` exchanges into/out of one preallocated, pre-touched numpy buffer:
  ``MODE_STORE``: recv ``nbytes`` (``TAG_DATA``), send a 1-byte ack
  (``TAG_REPLY``); ``MODE_READ``: recv an 8-byte request holding the size
  (``TAG_DATA``), send that many bytes (``TAG_REPLY``), then answers one byte
  on TCP; ``MODE_QUIT`` ends it.
* a bare msgpack echo server: length-prefixed frames in, the same frames out,
  parsed and re-encoded with ``control.protocol`` (as the daemon does), with
  the daemon's read loop shape (read, decode, write each answer, drain).
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

Once listening it writes ``UCX_PORT ECHO_PORT PHASE_PORT SOCKET_PORT`` to
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
from typing import Any

import numpy as np

from benchkit.procs import write_ready
from control.wire import protocol as P
from dataplane import ucx

MODE_QUIT, MODE_STORE, MODE_READ, MODE_ECHO = 0, 1, 2, 3
TAG_PHASE, TAG_DATA, TAG_REPLY = 1, 2, 3
READ_CHUNK = 1 << 16


PHASE = struct.Struct("<qqq")  # mode, nbytes, iters: sent over the phase TCP connection
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


async def run_phases(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     endpoint: asyncio.Future[Any], buf: np.ndarray) -> None:
    """Phase headers arrive over TCP, not UCX: between phases no UCX receive is
    posted here, because ucxx's request wait polls with sleep(0) and a posted
    receive would keep a core busy while rpcbuf's own rounds run."""
    request = np.zeros(1, dtype=np.int64)
    ack = np.ones(1, dtype=np.uint8)
    ep = await endpoint
    try:
        while True:
            mode, nbytes, iters = PHASE.unpack(await reader.readexactly(PHASE.size))
            # ucx.busy(): the same progress policy rpcbufd's transfers get
            # (poll while a transfer is in flight, sleep on epoll otherwise)
            if mode == MODE_STORE:
                view = buf[:nbytes]
                for _ in range(iters):
                    with ucx.busy():
                        await ep.recv(view, tag=TAG_DATA)
                        await ep.send(ack, tag=TAG_REPLY)
            elif mode == MODE_READ:
                for _ in range(iters):
                    with ucx.busy():
                        await ep.recv(request, tag=TAG_DATA)
                        await ep.send(buf[: int(request[0])], tag=TAG_REPLY)
            else:
                break
            writer.write(b"\x01")  # phase done
    except (asyncio.IncompleteReadError, ConnectionError, OSError):
        pass  # the client went away
    except Exception:  # a UCX error: the client went away mid-phase
        pass
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await ep.close()


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
    ucxx = ucx.ucxx()  # applies rpcbuf's UCX defaults before importing ucxx
    buf = np.empty(args.max_bytes, dtype=np.uint8)
    buf.fill(0xA5)  # touch every page now, not during the first timed transfer
    endpoint: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    closed = asyncio.Event()

    async def on_endpoint(ep: Any) -> None:
        if not endpoint.done():  # one raw client per run
            endpoint.set_result(ep)
        await closed.wait()  # keep the listener's handler (and the endpoint) alive

    listener = ucxx.create_listener(on_endpoint, port=0)
    server = await asyncio.start_server(echo, "127.0.0.1", 0, limit=READ_CHUNK)
    echo_port = server.sockets[0].getsockname()[1]
    phase_server = await asyncio.start_server(
        lambda r, w: run_phases(r, w, endpoint, buf), "127.0.0.1", 0)
    phase_port = phase_server.sockets[0].getsockname()[1]
    sock_buf = np.empty(args.max_bytes, dtype=np.uint8)
    sock_buf.fill(0x5A)  # the raw socket's own buffer, pre-touched too
    sock_listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=socket_server, args=(sock_listener, sock_buf), daemon=True,
                     name="raw-socket-accept").start()
    sock_port = sock_listener.getsockname()[1]
    write_ready(args.ready_file,
                f"{listener.port} {echo_port} {phase_port} {sock_port}\n")

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    parent = os.getppid()
    while not stop.is_set() and os.getppid() == parent:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)
    closed.set()
    server.close()
    phase_server.close()
    listener.close()
    with contextlib.suppress(OSError):
        sock_listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread
    sock_listener.close()


def cli() -> None:
    p = argparse.ArgumentParser(
        description="bench.py's reference peer (raw ucxx, echo, raw socket)")
    p.add_argument("--ready-file", required=True)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    args = p.parse_args()
    import uvloop

    uvloop.run(main(args))


if __name__ == "__main__":
    cli()
