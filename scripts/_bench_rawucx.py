"""The raw ucxx reference, both ends in processes of their own: the strongest one built here.

Why separate processes and ucxx's own progress: the reference used to be a
``RawPeer`` in the benchmark's own process, talking to a listener that also
served the echo and raw-socket references, and both ends ran through
``rpcbuf.dataplane.ucx.ucxx()``, i.e. rpcbuf's own ``AdaptiveProgress`` (poll while
busy, sleep on epoll otherwise) under uvloop.  That made the reference as
slow as rpcbuf's progress engine wherever the engine is the limit, so the
ratio said little.  Here each end imports ``ucxx`` itself (never
``rpcbuf.dataplane.ucx.ucxx()``), with the tuned environment the issue names
(``UCXPY_PROGRESS_MODE=blocking``, ``UCX_RNDV_SCHEME=auto``, 2 MiB tcp
segments: ``rpcbuf.dataplane.ucx.UCX_DEFAULTS``, set only where unset), so ucxx's
stock blocking mode runs, which after its first event keeps polling (the
ucxx 0.52 behaviour ``AdaptiveProgress`` exists to avoid in a daemon;
for a reference it is the fastest progress there is).  Since both ends then
keep a core busy, the parent (``RawUcxx`` in ``_bench_refs``) keeps them
stopped (SIGSTOP) except while one of their rounds runs.

``server``: a ucxx listener with one preallocated, pre-touched buffer
(``--memory``: anonymous numpy memory, the default and the strongest
measured; or the daemon's kind, a sealed memfd mapped in place; or
anonymous without huge pages: ``receive_buffer``); per
endpoint it receives a 24-byte header ``[mode, nbytes, iters]`` and runs
that many exchanges: store: recv ``nbytes``, send a 1-byte ack; read: recv
an 8-byte request, send ``nbytes``.  ``client``: connects, then obeys one
command a line on stdin (``store N ITERS``, ``read N ITERS``, ``quit``),
timing each exchange, and answers one JSON line ``{"samples": [...]}`` (seconds)
on ``--result-fd``.  Either writes its ready file once listening/connected,
and exits when its parent goes away.  Imports: numpy, ucxx, the kit's
ready file, ``rpcbuf.dataplane.ucx`` for the defaults' values only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import benchkit

benchkit.loopback_ucx_env()
from rpcbuf.dataplane.ucx import UCX_DEFAULTS  # noqa: E402  (values only: no ucxx import)

for _key, _value in UCX_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

from benchkit.procs import write_ready  # noqa: E402

HEADER = struct.Struct("<qqq")  # mode, nbytes, iters
STORE, READ, QUIT = 1, 2, 0
TAG_HDR, TAG_DATA, TAG_REPLY = 11, 12, 13
MODES = {"store": STORE, "read": READ}


def load(progress: str) -> tuple[Any, Callable[[], contextlib.AbstractContextManager[Any]]]:
    """ucxx and the context each exchange runs in: ucxx's own progress
    (``stock``, the reference) or rpcbuf's ``AdaptiveProgress`` with
    ``progress.busy()`` (``adaptive``: what the old in-process reference ran, kept
    to measure the difference)."""
    if progress == "adaptive":
        from rpcbuf.dataplane import progress, ucx

        return ucx.ucxx(), progress.busy
    import ucxx

    return ucxx, contextlib.nullcontext


async def serve(ep: Any, buf: np.ndarray,
                busy: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
    header = np.zeros(3, dtype=np.int64)
    request = np.zeros(1, dtype=np.int64)
    ack = np.ones(1, dtype=np.uint8)
    try:
        while True:
            await ep.recv(header, tag=TAG_HDR)
            mode, nbytes, iters = (int(x) for x in header)
            view = buf[:nbytes]
            if mode == STORE:
                for _ in range(iters):
                    with busy():
                        await ep.recv(view, tag=TAG_DATA)
                        await ep.send(ack, tag=TAG_REPLY)
            elif mode == READ:
                for _ in range(iters):
                    with busy():
                        await ep.recv(request, tag=TAG_DATA)
                        await ep.send(view, tag=TAG_REPLY)
            else:
                break
    except Exception:  # the client went away (a UCX error): this endpoint is done
        pass


MEMORY = ("anon", "nohuge", "memfd")
MADV_NOHUGEPAGE = 15  # linux/mman.h


def receive_buffer(nbytes: int, memory: str) -> tuple[np.ndarray, Any]:
    """The server's buffer, pre-touched, and what keeps its memory alive.

    ``anon``: a numpy array (anonymous memory; numpy asks for transparent
    huge pages for large arrays, ``MADV_HUGEPAGE``, so with THP in
    ``madvise`` or ``always`` mode it gets 2 MiB pages).  ``nohuge``: the
    same with ``MADV_NOHUGEPAGE`` (4 KiB pages).  ``memfd``: a memfd mapped
    shared at a fixed address inside a reserved anonymous range, then sealed
    read-only, as ``rpcbuf.dataplane.arena.HostArena.back`` does for every buffer
    (shmem pages: 4 KiB unless ``shmem_enabled`` allows huge ones)."""
    if memory == "anon":
        buf = np.empty(nbytes, dtype=np.uint8)
        buf.fill(0xA5)  # every page touched before anything is timed
        return buf, None
    import ctypes
    import mmap

    from rpcbuf.dataplane import shm

    span = -(-nbytes // shm.PAGE) * shm.PAGE
    region = mmap.mmap(-1, span, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                       | shm.MAP_NORESERVE)
    buf = np.frombuffer(region, dtype=np.uint8, count=nbytes)
    addr = int(buf.ctypes.data)
    keep: list[Any] = [region]
    if memory == "nohuge":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(addr, span, MADV_NOHUGEPAGE) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_NOHUGEPAGE)")
    else:
        fd = shm.memfd(span, "rawucx-buffer")
        shm.map_fixed(addr, span, fd)
        shm.seal_read_only(fd)
        keep.append(fd)
    buf.fill(0xA5)
    return buf, keep


async def server_main(args: argparse.Namespace) -> None:
    ucxx, busy = load(args.progress)

    buf, _keep = receive_buffer(args.max_bytes, args.memory)
    async def on_endpoint(ep: Any) -> None:  # a coroutine function: ucxx awaits it
        await serve(ep, buf, busy)

    listener = ucxx.create_listener(on_endpoint, port=0)
    write_ready(args.ready_file, f"{listener.port}\n")
    parent, never = os.getppid(), asyncio.Event()  # nothing signals a parent's exit: polled
    while os.getppid() == parent:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(never.wait(), 0.5)
    listener.close()


async def client_main(args: argparse.Namespace) -> None:
    ucxx, busy = load(args.progress)

    ep = await asyncio.wait_for(ucxx.create_endpoint("127.0.0.1", args.port), 30)
    data = np.random.default_rng(0).integers(0, 256, args.max_bytes, dtype=np.uint8)
    out = np.zeros(args.max_bytes, dtype=np.uint8)
    header = np.zeros(3, dtype=np.int64)
    request = np.zeros(1, dtype=np.int64)
    ack = np.zeros(1, dtype=np.uint8)
    write_ready(args.ready_file, "connected\n")
    loop = asyncio.get_running_loop()
    clock = time.perf_counter
    result = os.fdopen(args.result_fd, "w", buffering=1)
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        words = line.split()
        if not words or words[0] == "quit":
            break
        mode, nbytes, iters = MODES[words[0]], int(words[1]), int(words[2])
        header[:] = (mode, nbytes, iters)
        await ep.send(header, tag=TAG_HDR)
        src, dst = data[:nbytes], out[:nbytes]
        request[0] = nbytes
        samples = []
        for _ in range(iters):
            t0 = clock()
            with busy():
                if mode == STORE:
                    await ep.send(src, tag=TAG_DATA)
                    await ep.recv(ack, tag=TAG_REPLY)
                else:
                    await ep.send(request, tag=TAG_DATA)
                    await ep.recv(dst, tag=TAG_REPLY)
            samples.append(clock() - t0)
        result.write(json.dumps({"samples": samples}) + "\n")
    header[:] = (QUIT, 0, 0)
    await asyncio.wait_for(ep.send(header, tag=TAG_HDR), 5)
    await asyncio.wait_for(ep.close(), 5)


def cli() -> None:
    p = argparse.ArgumentParser(description="raw ucxx reference (one end)")
    p.add_argument("role", choices=("server", "client"))
    p.add_argument("--ready-file", required=True)
    p.add_argument("--max-bytes", type=int, default=64 << 20)
    p.add_argument("--port", type=int, default=0, help="client: the server's port")
    p.add_argument("--result-fd", type=int, default=1, help="client: where answers go")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                   help="event loop of this end [%(default)s: measured the stronger here]")
    p.add_argument("--progress", choices=("stock", "adaptive"), default="stock",
                   help="ucxx's own progress, or rpcbuf's AdaptiveProgress [%(default)s]")
    p.add_argument("--memory", choices=MEMORY, default="anon",
                   help="server: what its buffer is (receive_buffer) [%(default)s]")
    args = p.parse_args()
    main = server_main(args) if args.role == "server" else client_main(args)
    if args.loop == "uvloop":
        import uvloop

        uvloop.run(main)
    else:
        asyncio.run(main)


if __name__ == "__main__":
    cli()
