"""Both ends of one ``bench_ucx.py`` pair: the server (it stands for rpcbufd) and
the client (it measures), each a child process in its configuration's environment.

The server is a ucxx listener (or, for ``sm``, an endpoint made from the
client's worker address) with one preallocated, pre-touched 64 MiB buffer;
the client sends phase headers over a plain TCP connection (so between
phases the server has no UCX receive posted, as rpcbufd, whose requests come
over its control socket), then runs the phase's exchanges over UCX and
times them.  The client obeys one command per line on stdin (``chunk R``,
``idle``, ``multi``, ``deadpeer``) and answers one JSON line each on
``--result-fd``; the parent (``_bench_ucx_pairs``) pauses and wakes the pair
between commands.  ucxx is imported only here, through ``load_ucxx``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from _bench_ucx_config import (
    BIG,
    BY_KEY,
    HDR,
    LEN,
    M_CMA_READ,
    M_CMA_STORE,
    M_DEADPEER,
    M_HELLO,
    M_MULTI,
    M_QUIT,
    M_READ,
    M_STORE,
    M_STORE_MANY,
    MULTI_BYTES,
    MULTI_COUNT,
    PLANS,
    TAG_DATA,
    TAG_REPLY,
    Config,
    Plan,
    load_ucxx,
)
from benchkit import KiB, MiB
from benchkit.procs import write_ready
from benchkit.report import write_json
from benchkit.timing import cpu_ticks, no_gc, rotated


class Link:
    """A ucxx endpoint with the tag convention of its kind: hashed with the
    endpoint's tags for listener endpoints, forced for worker-address ones
    (those have no tags of their own)."""

    def __init__(self, ep: Any, forced: bool) -> None:
        self.ep, self.forced = ep, forced

    async def send(self, buf: Any, tag: int) -> None:
        await self.ep.send(buf, tag=tag, force_tag=self.forced)

    async def recv(self, buf: Any, tag: int) -> None:
        await self.ep.recv(buf, tag=tag, force_tag=self.forced)


# -- server -------------------------------------------------------------------------


class _Cma:
    """``process_vm_readv``/``writev`` of one peer process: the reference
    UCX's cma transport stands on (rpcbuf itself no longer copies client
    memory: its same-host path shares memory by handle)."""

    def __init__(self, pid: int) -> None:
        import ctypes

        self._pid = pid
        libc = ctypes.CDLL(None, use_errno=True)
        self._fns = libc.process_vm_readv, libc.process_vm_writev
        for fn in self._fns:
            fn.restype = ctypes.c_ssize_t
            fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                           ctypes.c_ulong, ctypes.c_ulong]
        self._iov = ctypes.c_void_p * 2

    def _copy(self, fn: Any, local: list[int], remote: list[int], sizes: list[int]) -> None:
        import ctypes

        chunk = 8 << 20
        for lo, ro, n in zip(local, remote, sizes, strict=True):
            for at in range(0, n, chunk):
                k = min(chunk, n - at)
                liov, riov = self._iov(lo + at, k), self._iov(ro + at, k)
                if fn(self._pid, liov, 1, riov, 1, 0) != k:
                    raise OSError(ctypes.get_errno(), "process_vm_readv/writev")

    def read(self, local: list[int], remote: list[int], sizes: list[int]) -> None:
        self._copy(self._fns[0], local, remote, sizes)

    def write(self, local: list[int], remote: list[int], sizes: list[int]) -> None:
        self._copy(self._fns[1], local, remote, sizes)


async def server_main(args: argparse.Namespace) -> None:
    cfg = BY_KEY[args.config]
    U, busy = load_ucxx(cfg)

    buf = np.empty(args.max_bytes, dtype=np.uint8)
    buf.fill(0xA5)  # touch every page before anything is timed
    ack = np.ones(1, dtype=np.uint8)
    request = np.zeros(1, dtype=np.int64)
    loop = asyncio.get_running_loop()
    listener_ep: asyncio.Future[Link] = loop.create_future()
    hold = asyncio.Event()
    finished = asyncio.Event()
    listener = None
    if not cfg.same_host:
        async def on_endpoint(ep: Any) -> None:
            if not listener_ep.done():
                listener_ep.set_result(Link(ep, forced=False))
            await hold.wait()  # keep the handler, and so the endpoint, alive

        listener = U.create_listener(on_endpoint, port=0)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link: Link | None = None
        peer: Any = None
        try:
            while True:
                mode, n, iters, arg = HDR.unpack(await reader.readexactly(HDR.size))
                if mode == M_HELLO:  # same-host: swap worker addresses, pid for cma
                    address = await reader.readexactly(n)
                    peer = _Cma(arg)
                    ep = await U.create_endpoint_from_worker_address(
                        U.get_ucx_address_from_buffer(address), endpoint_error_handling=False)
                    link = Link(ep, forced=True)
                    mine = U.get_worker_address().tobytes()
                    writer.write(LEN.pack(len(mine)) + mine)
                    await writer.drain()
                    continue
                if mode == M_QUIT:
                    break
                if link is None:
                    link = await asyncio.wait_for(listener_ep, 30)
                if mode == M_STORE:
                    view = buf[:n]
                    for _ in range(iters):
                        with busy():
                            await link.recv(view, TAG_DATA)
                            await link.send(ack, TAG_REPLY)
                elif mode == M_READ:
                    for _ in range(iters):
                        with busy():
                            await link.recv(request, TAG_DATA)
                            await link.send(buf[: int(request[0])], TAG_REPLY)
                elif mode == M_STORE_MANY:  # ``arg`` messages of n bytes, then one ack
                    for _ in range(iters):
                        with busy():
                            for k in range(arg):
                                await link.recv(buf[k * n:(k + 1) * n], TAG_DATA)
                            await link.send(ack, TAG_REPLY)
                elif mode == M_MULTI:
                    for _ in range(iters):
                        with busy():
                            frames = await link.ep.recv_multi(tag=TAG_DATA,
                                                              force_tag=link.forced)
                            if len(frames) != arg:
                                raise RuntimeError(f"recv_multi got {len(frames)} frames")
                            await link.send(ack, TAG_REPLY)
                elif mode in (M_CMA_STORE, M_CMA_READ):  # one TCP byte per copy, each way
                    copy = peer.read if mode == M_CMA_STORE else peer.write
                    local = [buf.ctypes.data]
                    for _ in range(iters):
                        await reader.readexactly(1)
                        copy(local, [arg], [n])
                        writer.write(b"\x01")
                elif mode == M_DEADPEER:
                    await dead_peer(link, buf[:n], iters, arg / 1000, busy, args.result_file)
                    continue  # the client is gone: the next read ends the loop
                writer.write(b"\x01")  # phase done
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away
        finally:
            writer.close()
            finished.set()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    ucx_port = 0 if listener is None else listener.port
    write_ready(args.ready_file, f"{port} {ucx_port}\n")
    await finished.wait()
    hold.set()


async def dead_peer(link: Link, view: np.ndarray, iters: int, timeout: float,
                    busy: Callable[[], Any], result_file: str) -> None:
    """Post receives until one fails or times out; write how it ended."""
    done, outcome = 0, "no receive ended"
    started = time.time()
    for _ in range(iters):
        started = time.time()
        try:
            async with asyncio.timeout(timeout):
                with busy():
                    await link.recv(view, TAG_DATA)
            done += 1
        except TimeoutError:
            outcome = f"still pending after {timeout:.0f} s (timed out)"
            break
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
            break
    write_json(result_file, {"dead_peer": {"completed_before": done, "outcome": outcome,
                                           "recv_started": started, "ended": time.time()}})


Side = Callable[[int], Awaitable[list[float]]]


class Ctl:
    """The client's end of the TCP phase connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def phase(self, mode: int, nbytes: int, iters: int, arg: int = 0) -> None:
        self.writer.write(HDR.pack(mode, nbytes, iters, arg))
        await self.writer.drain()

    async def done(self) -> None:
        await self.reader.readexactly(1)


class Client:
    """Measures one configuration, one command from the parent at a time."""

    def __init__(self, cfg: Config, plan: Plan, args: argparse.Namespace) -> None:
        self.cfg, self.plan, self.args = cfg, plan, args
        self.clock = time.perf_counter
        self.extras = set(filter(None, args.extras.split(",")))

    async def setup(self) -> None:
        cfg = self.cfg
        U, self.busy = load_ucxx(cfg)
        reader, writer = await asyncio.open_connection("127.0.0.1", self.args.ctrl_port)
        self.ctl = Ctl(reader, writer)
        if cfg.same_host:
            mine = U.get_worker_address().tobytes()
            writer.write(HDR.pack(M_HELLO, len(mine), 0, os.getpid()) + mine)
            (n,) = LEN.unpack(await reader.readexactly(LEN.size))
            address = await reader.readexactly(n)
            ep = await U.create_endpoint_from_worker_address(
                U.get_ucx_address_from_buffer(address), endpoint_error_handling=False)
            self.link = Link(ep, forced=True)
        else:
            ep = await asyncio.wait_for(U.create_endpoint("127.0.0.1", self.args.ucx_port), 30)
            self.link = Link(ep, forced=False)
        self.data = np.empty(BIG, dtype=np.uint8)
        self.data.fill(0x5A)  # pre-touched, as every buffer here
        self.out = np.empty(BIG, dtype=np.uint8)
        self.out.fill(0)
        self.ack = np.zeros(1, dtype=np.uint8)
        self.request = np.zeros(1, dtype=np.int64)
        self.lat: dict[str, Side] = {"lat_4k": self.store(4 * KiB)}
        if "core" in self.extras:
            self.lat["lat_4k_core"] = core_store(self.link, self.ctl, self.data[:4 * KiB],
                                                 self.ack, self.busy, self.clock)
        self.mid: dict[str, Side] = {"store_1m": self.store(MiB), "read_1m": self.read(MiB)}
        self.big: dict[str, Side] = {"store_64m": self.store(BIG), "read_64m": self.read(BIG)}
        if cfg.same_host:
            self.big.update(same_host_sides(self.ctl, self.data, self.out, self.clock))
        # warm-up: every path once, so no first-use cost lands in a timed chunk
        await self.lat["lat_4k"](50)
        for side in (*self.lat.values(), *self.mid.values(), *self.big.values()):
            await side(1)

    def store(self, nbytes: int) -> Side:
        """Send ``nbytes``, receive a 1-byte ack."""
        return self._exchange(M_STORE, nbytes, self.data[:nbytes], self.ack)

    def read(self, nbytes: int) -> Side:
        """Send an 8-byte request holding the size, receive ``nbytes``."""
        return self._exchange(M_READ, nbytes, self.request, self.out[:nbytes])

    def _exchange(self, mode: int, nbytes: int, send: np.ndarray, recv: np.ndarray) -> Side:
        link, ctl, clock = self.link, self.ctl, self.clock

        async def run(count: int) -> list[float]:
            await ctl.phase(mode, nbytes, count + 1)
            if mode == M_READ:  # the request buffer is shared by every read side
                send[0] = nbytes
            got = []
            for i in range(count + 1):  # the first one is untimed
                t0 = clock()
                with self.busy():
                    await link.send(send, TAG_DATA)
                    await link.recv(recv, TAG_REPLY)
                if i:
                    got.append(clock() - t0)
            await ctl.done()
            return got
        return run

    async def cold(self, nbytes: int, count: int) -> list[float]:
        """After a quiet gap: the header over TCP, then the payload (rpcbufd's shape)."""
        view, got = self.data[:nbytes], []
        for _ in range(count):
            await asyncio.sleep(self.plan.cold_gap)
            t0 = self.clock()
            self.ctl.writer.write(HDR.pack(M_STORE, nbytes, 1, 0))
            with self.busy():
                await self.link.send(view, TAG_DATA)
                await self.link.recv(self.ack, TAG_REPLY)
            got.append(self.clock() - t0)
            await self.ctl.done()
        return got

    async def chunk(self, r: int) -> dict[str, Any]:
        """One round's share of every measurement; sides within it rotate with ``r``."""
        plan, out = self.plan, {}
        with no_gc():
            for k in rotated(list(self.lat), r):
                out[k] = await self.lat[k](plan.lat_iters)
            out["cold_4k"] = await self.cold(4 * KiB, plan.cold_iters)
            out["cold_1m"] = await self.cold(MiB, plan.cold_iters)
            for k in rotated(list(self.mid), r):
                out[k] = await self.mid[k](plan.mid_iters)
            for k in rotated(list(self.big), r):
                out[k] = await self.big[k](plan.big_iters)
        return {"samples": out}

    async def idle(self) -> dict[str, Any]:
        """CPU of the server (and of this client) while connected and quiet."""
        await asyncio.sleep(0.3)  # past AdaptiveProgress's 10 ms grace, and then some
        pid = self.args.server_pid
        srv0, me0, t0 = cpu_ticks(pid), cpu_ticks(os.getpid()), time.monotonic()
        await asyncio.sleep(self.plan.idle_seconds)
        srv1, me1, t1 = cpu_ticks(pid), cpu_ticks(os.getpid()), time.monotonic()
        tick = os.sysconf("SC_CLK_TCK")
        if srv0 is None or srv1 is None or me0 is None or me1 is None:
            return {"error": "no /proc/PID/stat"}
        return {"idle": {"server_pct": 100 * (srv1 - srv0) / tick / (t1 - t0),
                         "client_pct": 100 * (me1 - me0) / tick / (t1 - t0),
                         "seconds": t1 - t0}}

    async def multi(self) -> dict[str, Any]:
        return {"samples": await multi(self.link, self.ctl, self.data, self.ack, self.busy,
                                       self.plan, self.clock)}

    async def dead_peer(self, report: Callable[[dict[str, Any]], None]) -> None:
        """Start sending 64 MiB messages, then SIGKILL ourselves mid-transfer."""
        await self.ctl.phase(M_DEADPEER, BIG, 100, int(self.plan.dead_timeout * 1000))

        async def keep_sending() -> None:
            for _ in range(100):
                with self.busy():
                    await self.link.send(self.data, TAG_DATA)

        task = asyncio.ensure_future(keep_sending())
        await asyncio.sleep(0.03)  # a 64 MiB send takes 20-150 ms here: mid-transfer
        report({"killed_at": time.time(), "send_done": task.done()})
        os.kill(os.getpid(), signal.SIGKILL)


async def client_main(args: argparse.Namespace) -> None:
    """Set up, say ready, then obey one command per line on stdin, answering
    one JSON line each on ``--result-fd``."""
    cfg, plan = BY_KEY[args.config], PLANS[args.plan]
    results = os.fdopen(args.result_fd, "w", buffering=1)

    def report(obj: dict[str, Any]) -> None:
        results.write(json.dumps(obj) + "\n")
        results.flush()

    client = Client(cfg, plan, args)
    try:
        async with asyncio.timeout(plan.command_timeout):
            await client.setup()
    except Exception as exc:
        report({"error": f"setup: {type(exc).__name__}: {exc}"})
        return
    report({"ready": True})
    loop = asyncio.get_running_loop()
    commands = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(commands), sys.stdin)
    while line := (await commands.readline()).decode().split():
        cmd, arg = line[0], int(line[1]) if len(line) > 1 else 0
        try:
            async with asyncio.timeout(plan.command_timeout):
                if cmd == "chunk":
                    report(await client.chunk(arg))
                elif cmd == "idle":
                    report(await client.idle())
                elif cmd == "multi":
                    report(await client.multi())
                elif cmd == "deadpeer":
                    await client.dead_peer(report)
                else:
                    break
        except Exception as exc:  # reported, not raised: the parent shows it
            report({"error": f"{cmd}: {type(exc).__name__}: {exc}"})


def core_store(link: Link, ctl: Ctl, view: np.ndarray, ack: np.ndarray,
               busy: Callable[[], Any], clock: Callable[[], float]) -> Side:
    """The 4 KiB round trip through ucxx's core API: the endpoint's own
    ``tag_send``/``tag_recv`` with a prebuilt ``Array`` and ``Tag`` (the
    asyncio ``Endpoint`` wrapper does checks, hashing and wrapping per call)."""
    from ucxx._lib.arr import Array
    from ucxx._lib_async.utils import hash64bits
    from ucxx.types import Tag, TagMaskFull

    ep = link.ep
    send_tag = Tag(hash64bits(ep._tags["msg_send"], hash(TAG_DATA)))
    recv_tag = Tag(hash64bits(ep._tags["msg_recv"], hash(TAG_REPLY)))
    src, dst = Array(view), Array(ack)
    core = ep._ep

    async def run(count: int) -> list[float]:
        await ctl.phase(M_STORE, view.nbytes, count + 1)
        got = []
        for i in range(count + 1):
            t0 = clock()
            with busy():  # as the wrapper's side: only the API differs
                await core.tag_send(src, send_tag).wait()
                await core.tag_recv(dst, recv_tag, TagMaskFull).wait()
            if i:
                got.append(clock() - t0)
        await ctl.done()
        return got
    return run


def same_host_sides(ctl: Ctl, data: np.ndarray, out: np.ndarray,
                    clock: Callable[[], float]) -> dict[str, Side]:
    """64 MiB by process_vm_readv/writev (done by the server) and by memcpy."""
    def cma(mode: int, arr: np.ndarray) -> Side:
        async def run(count: int) -> list[float]:
            await ctl.phase(mode, arr.nbytes, count + 1, arr.ctypes.data)
            got = []
            for i in range(count + 1):
                t0 = clock()
                ctl.writer.write(b"g")
                await ctl.reader.readexactly(1)
                if i:
                    got.append(clock() - t0)
            await ctl.done()
            return got
        return run

    dst = np.empty_like(data)
    dst.fill(1)

    async def memcpy(count: int) -> list[float]:
        got = []
        for _ in range(count):
            t0 = clock()
            np.copyto(dst, data)
            got.append(clock() - t0)
        return got

    return {"cma_store_64m": cma(M_CMA_STORE, data), "cma_read_64m": cma(M_CMA_READ, out),
            "memcpy_64m": memcpy}


async def multi(link: Link, ctl: Ctl, data: np.ndarray, ack: np.ndarray,
                busy: Callable[[], Any], plan: Plan,
                clock: Callable[[], float]) -> dict[str, list[float]]:
    """10,000 x 4 KiB: send_multi, a loop of sends, and one 40 MB send."""
    frames = [data[i * MULTI_BYTES:(i + 1) * MULTI_BYTES].copy() for i in range(MULTI_COUNT)]
    whole = data[:MULTI_COUNT * MULTI_BYTES]

    async def by_multi(count: int) -> list[float]:
        await ctl.phase(M_MULTI, MULTI_BYTES, count, MULTI_COUNT)
        got = []
        for _ in range(count):
            t0 = clock()
            with busy():
                await link.ep.send_multi(frames, tag=TAG_DATA, force_tag=link.forced)
                await link.recv(ack, TAG_REPLY)
            got.append(clock() - t0)
        await ctl.done()
        return got

    async def by_loop(count: int) -> list[float]:
        await ctl.phase(M_STORE_MANY, MULTI_BYTES, count, MULTI_COUNT)
        got = []
        for _ in range(count):
            t0 = clock()
            with busy():
                for f in frames:
                    await link.send(f, TAG_DATA)
                await link.recv(ack, TAG_REPLY)
            got.append(clock() - t0)
        await ctl.done()
        return got

    async def by_one(count: int) -> list[float]:
        await ctl.phase(M_STORE, whole.nbytes, count)
        got = []
        for _ in range(count):
            t0 = clock()
            with busy():
                await link.send(whole, TAG_DATA)
                await link.recv(ack, TAG_REPLY)
            got.append(clock() - t0)
        await ctl.done()
        return got

    sides: dict[str, Side] = {"multi_send_multi": by_multi, "multi_send_loop": by_loop,
                              "multi_one_send": by_one}
    for side in sides.values():  # warm-up, each
        await side(1)
    out: dict[str, list[float]] = {k: [] for k in sides}
    with no_gc():
        for r in range(plan.multi_reps):  # one of each per round, rotating who goes first
            for k in rotated(list(sides), r):
                out[k] += await sides[k](1)
    return out


def child(args: argparse.Namespace) -> int:
    import uvloop

    if args.role == "server":
        uvloop.run(server_main(args))
    else:
        uvloop.run(client_main(args))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip ucxx's teardown: it can block on endpoints of a dead peer

