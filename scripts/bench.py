"""rpcbuf benchmark: data ops against raw ucxx, a raw socket and memcpy,
control ops against a bare echo, and the daemon's idle CPU.

Run as ``.venv/bin/python scripts/bench.py [--json bench.json] [--quick]``.

What runs where (all on 127.0.0.1, one run, so the ratios compare like with
like; DESIGN.md "Performance goals" says the ratios are what count):

* this process, the client, under uvloop: two rpcbuf contexts on the daemon,
  ``rpcbuf.connect(addr, token=..., same_host=False)`` (the UCX path over
  loopback TCP, "tcp" in the table) and ``rpcbuf.connect(addr, token=...)``,
  the default, which on the daemon's own host is the same-host path (the
  daemon copies straight from and into this process's memory;
  "same-host" in the table; a loopback client gets it by default).  Which
  path each got is printed, and a note under the table says so when the
  default one did not get the same-host path (its rows then measure UCX).
  Plus a raw ucxx endpoint, a bare echo connection and a plain blocking
  socket to the reference peer;
* a real ``rpcbufd`` (``--device cpu:1GiB``, free ports, ``--ready-file``,
  its same-host socket left at ``auto``);
* ``scripts/_bench_peer.py``, the reference peer: a raw ucxx listener that
  receives into / sends from a preallocated numpy buffer, a msgpack echo
  server using the daemon's framing (``control.protocol``), and a raw
  blocking TCP socket server in its own thread (not asyncio) with its own
  preallocated buffer.

All three processes get the same UCX settings: ``UCX_TLS=tcp``,
``UCX_NET_DEVICES=lo`` and ``dataplane.ucx.apply_defaults()`` (blocking
progress, put_zcopy rendezvous, 2 MiB tcp segments), each only where the
environment does not already set it.  So raw ucxx runs with the fastest
settings found (DESIGN.md "Facts measured here"), as the goal demands.

The raw socket reference: a plain blocking ``socket.socket`` on both sides
(on this side called from the event loop's thread, which it stalls: nothing
else runs while measuring), ``TCP_NODELAY``, ``sendall`` and ``recv_into`` a
memoryview of a preallocated, pre-touched array.  ``SO_SNDBUF``/``SO_RCVBUF``
are left at the kernel's defaults, so Linux autotunes them (setting them
turns autotuning off); kernel-level 30 s ``SO_SNDTIMEO``/``SO_RCVTIMEO``
bound every call on this side without making the socket non-blocking.
The memcpy reference: ``np.copyto(dst, src)`` of the same bytes in this
process, both arrays pre-touched (one core).

Measured, for 4 KiB, 1 MiB and 64 MiB uint8 arrays, in one alternation per
direction (so every side sees the same drift): rpcbuf ``store_tensor`` (one
control round trip, payload over UCX or copied by the daemon) on both paths,
raw ucxx "send N bytes, recv a 1-byte ack", the raw socket doing the same,
and ``np.copyto``; rpcbuf ``read_buffer(out=...)`` on both paths, raw ucxx
and the raw socket "send an 8-byte request, recv N bytes", and
``np.copyto``.  At 4 KiB the store alternation also holds the raw socket's
40-byte round trip (send 40 bytes, the peer echoes them).
Control ops, on the default (same-host) context and then on the tcp one:
``request_buffer(4096)`` + ``release_buffer`` pairs one at a time against
two sequential echos of the same two messages (same bytes on the wire, same
framing, uvloop TCP to the echo server whichever path the context took),
and pipelined with ``asyncio.gather`` of many workers against the same for
echos.

Batching, on each context (same-host, then tcp), after the peer's ucxx and
echo connections are closed (the raw socket stays: its peer thread sleeps in
``recv`` between phases): 10,000 separate 4 KiB uint8 arrays against one
40 MiB uint8 array, as the issue words the goal (the tensors are copies of
its first 40,960,000 bytes; it has 41,943,040), and against the raw socket
streaming those same 40,960,000 bytes as one store (read: one request, the
bytes back).  Each call is timed whole (median), in rounds of one call
alternating with the references, after warm-up:

* ``store_tensors(bid, {"t0": a0, ...})`` into a buffer sized by
  ``calculate_buffer_size`` (a ``get_buffer_meta`` round trip for the
  manifest, then one ``store_batch`` round trip whose touching tensors
  coalesce; each call overwrites the same names in place) against one
  40 MiB ``store_tensor`` and the raw socket stream;
* ``store_batch(bid, [(offset, array), ...])``, no manifest, against the same;
* the naive loop, one ``store_tensor`` per array (with ``--quick`` only the
  first 2,000 are timed and the time is scaled to 10,000), against one
  40 MiB ``store_tensor``;
* ``load_tensors(bid)`` (one batch read, checksums verified, the default)
  against one 40 MiB ``read_buffer(out=...)`` and the raw socket's read.

Each batched write is checked once to read back as the arrays it stored.

Daemon idle CPU: utime + stime of the rpcbufd process (all threads, from
``/proc/<pid>/stat``) over ``idle_seconds`` (3 s; 1.5 s with ``--quick``)
while this process only sleeps: once right after start, before any client,
and once after all measurements with both contexts still connected (this
client's own CPU over that window is shown too).

Each measurement warms up first (the first store touches fresh arena pages),
then runs rpcbuf and its references in rounds that rotate who goes first, so
drift on a busy 2-core machine hits all alike.  The garbage collector is off
while timing.  Latency is per operation (median and p99); throughput is
bytes / median.  Ratios are always rpcbuf / reference: for a latency or
time row lower is better (goal "<="), for a throughput row higher is better
(goal ">=").

Goals (DESIGN.md "Performance goals"; a goal shows in the row it applies to):

* 64 MiB store and read over tcp: >= 0.9 x raw ucxx throughput (foundation)
  and >= 1.5 x the raw blocking socket's;
* 64 MiB store and read, same-host: >= 0.6 x ``np.copyto`` throughput;
* one 4 KiB store: p50 <= 2 x the raw socket's 40-byte round trip p50, on
  both paths (the same-host one is the default on this host);
* request+release: pair p50 <= 2 x the bare echo p50 (a pair against a pair
  of echos, i.e. per op against one echo); pipelined on one connection
  >= 20,000 ops/s (absolute; the ratio shown is against pipelined echos);
* 10,000 x 4 KiB ``store_tensors``: <= 3 x the time of one 40 MiB store
  (foundation) and >= 0.5 x the raw socket stream's throughput (store_batch
  and load_tensors show both ratios without a goal);
* daemon idle: ~0 % CPU, met below 2 % of one core.

Output: one aligned table on stdout and every number (including each sample,
in microseconds) as JSON at ``--json``: "paths" (which path each context
got), "data" (per size and direction, keyed rpcbuf_tcp, rpcbuf_same_host,
raw_ucxx, raw_socket, memcpy, raw_socket_rtt_40B), "control" and "batching"
(each per path), "idle", "rows".
Missing a goal does not change the exit status; errors do (SIGINT/SIGTERM:
128 + signal).  The daemon and the peer are stopped with SIGTERM (bounded,
then SIGKILL) however the run ends, and get SIGTERM from the kernel should
this process die first (PR_SET_PDEATHSIG).  The share of CPU that other
processes took during the run is printed when it is large, and always stored.
"""

from __future__ import annotations

import os

# UCX reads its environment when ucxx is imported: set ours before anything can.
ENV_DEFAULTS = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", "UCX_WARN_UNUSED_ENV_VARS": "n"}
for _key, _value in ENV_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import ctypes  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import struct  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable, Sequence  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from dataplane import ucx  # noqa: E402

ucx.apply_defaults()  # blocking progress, put_zcopy, 2 MiB segments: for us and our children

import numpy as np  # noqa: E402
import uvloop  # noqa: E402

import rpcbuf  # noqa: E402
from _bench_peer import (  # noqa: E402
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
from _benchkit import cpu_ticks, no_gc  # noqa: E402
from control.wire import auth  # noqa: E402
from control.wire import protocol as P  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
HERE = Path(__file__).resolve().parent
Round = Callable[[int], Awaitable[list[float]]]


@dataclass(frozen=True)
class Plan:
    """How much to measure; ``--quick`` takes the small one."""

    iters: dict[int, int]  # payload size -> timed iterations per op
    warmup: dict[int, int]
    rounds: int  # alternating rpcbuf/reference rounds per measurement
    control_pairs: int
    pipelined_pairs: int
    concurrency: int
    batch_reps: int  # timed repetitions of each batched op (and of its reference)
    batch_warmup: int
    naive_tensors: int  # tensors the timed naive loop stores (scaled to BATCH_TENSORS)
    naive_reps: int
    idle_seconds: float  # how long the daemon's idle CPU is measured


FULL = Plan(iters={4 * KiB: 3000, 1 * MiB: 300, 64 * MiB: 30},
            warmup={4 * KiB: 200, 1 * MiB: 20, 64 * MiB: 3},
            rounds=10, control_pairs=3000, pipelined_pairs=20000, concurrency=64,
            batch_reps=7, batch_warmup=2, naive_tensors=10_000, naive_reps=3,
            idle_seconds=3.0)
QUICK = Plan(iters={4 * KiB: 300, 1 * MiB: 40, 64 * MiB: 6},
             warmup={4 * KiB: 50, 1 * MiB: 5, 64 * MiB: 2},
             rounds=4, control_pairs=300, pipelined_pairs=2000, concurrency=64,
             batch_reps=3, batch_warmup=1, naive_tensors=2_000, naive_reps=1,
             idle_seconds=1.5)
BATCH_TENSORS = 10_000  # the issue's batch: 10,000 tensors of 4 KiB
BATCH_TENSOR_BYTES = 4 * KiB
ONE_TENSOR_BYTES = 40 * MiB  # the issue's reference: "one 40 MiB tensor"
RTT_BYTES = 40  # the raw socket round trip the 4 KiB store is held against
BIG = 64 * MiB  # the size the throughput goals name
IDLE_GOAL_PERCENT = 2.0  # "daemon idle: ~0 % CPU": met below this share of one core
PIPELINED_GOAL = 20_000  # request+release ops/s, pipelined on one connection


def size_name(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


# -- statistics ------------------------------------------------------------------


def summarize(samples: list[float], nbytes: int | None = None) -> dict[str, Any]:
    """Latency stats in microseconds (+ GB/s at the median when ``nbytes``)."""
    arr = np.asarray(samples, dtype=np.float64)
    p50 = float(np.median(arr))
    out: dict[str, Any] = {
        "n": len(samples),
        "p50_us": p50 * 1e6,
        "p99_us": float(np.percentile(arr, 99)) * 1e6,
        "mean_us": float(arr.mean()) * 1e6,
        "min_us": float(arr.min()) * 1e6,
        "max_us": float(arr.max()) * 1e6,
    }
    if nbytes is not None:
        out["nbytes"] = nbytes
        out["gbps_p50"] = nbytes / p50 / 1e9
        out["gbps_mean"] = nbytes / float(arr.mean()) / 1e9
    out["samples_us"] = [round(s * 1e6, 3) for s in samples]
    return out


async def timed(op: Callable[[], Awaitable[Any]], iters: int) -> list[float]:
    samples = []
    clock = time.perf_counter
    for _ in range(iters):
        check_interrupted()
        t0 = clock()
        await op()
        samples.append(clock() - t0)
    return samples


async def alternate_many(sides: Sequence[Round], iters: int, rounds: int,
                         warm: bool = False) -> list[list[float]]:
    """Run ``iters`` of each side in ``rounds`` chunks, rotating who goes first.

    With ``warm`` each chunk starts with one untimed operation: every side measures
    steady traffic.  (The raw peer has its receive posted, and so keeps polling,
    through a whole chunk; rpcbufd sleeps on epoll after 10 ms without
    traffic, and the first transfer after such a lull pays a UCX wake-up:
    that cost is real but belongs to another row than steady throughput.)"""
    out: list[list[float]] = [[] for _ in sides]
    rounds = max(1, min(rounds, iters))
    w = 1 if warm else 0
    k = len(sides)
    for r in range(rounds):
        n = iters // rounds + (1 if r < iters % rounds else 0)
        with no_gc():
            for j in range(k):
                i = (r + j) % k
                out[i] += (await sides[i](n + w))[w:]
    return out


async def alternate(ours: Round, ref: Round, iters: int, rounds: int,
                    warm: bool = False) -> tuple[list[float], list[float]]:
    a, b = await alternate_many((ours, ref), iters, rounds, warm)
    return a, b


def timed_sync(op: Callable[[], object], iters: int) -> list[float]:
    """``timed`` for blocking operations (the raw socket, memcpy)."""
    samples = []
    clock = time.perf_counter
    for _ in range(iters):
        t0 = clock()
        op()
        samples.append(clock() - t0)
    check_interrupted()
    return samples


def blocking(fn: Callable[[int], list[float]]) -> Round:
    """A blocking round as a ``Round``: it runs on the event loop's thread,
    stalling the loop, which is fine here: nothing else runs while measuring."""
    async def run(n: int) -> list[float]:
        return fn(n)
    return run


def memcpy_round(dst: np.ndarray, src: np.ndarray) -> Round:
    """The memcpy reference: ``np.copyto(dst, src)`` in this process."""
    return blocking(lambda n: timed_sync(lambda: np.copyto(dst, src), n))


# -- the reference peer's clients ---------------------------------------------------------


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


# -- processes and signals ------------------------------------------------------------


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived: stop measuring, clean up, exit 128 + signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


_pending_signal: int | None = None


def _raise_interrupted(signum: int, _frame: object) -> None:
    """Outside the event loop (start-up, shutdown): raise at once."""
    raise Interrupted(signum)


def _note_signal(signum: int) -> None:
    """Inside the event loop: a flag checked between operations.  Cancelling
    the main task is not enough, because on Python 3.11 ``asyncio.wait_for``
    (which the rpcbuf client uses) swallows a cancellation that races with
    the answer arriving."""
    global _pending_signal
    _pending_signal = signum


def check_interrupted() -> None:
    if _pending_signal is not None:
        raise Interrupted(_pending_signal)


_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In each child before exec: get SIGTERM if this process dies, even by SIGKILL."""
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _tail(path: Path, n: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    return ""


def wait_ready(path: Path, proc: subprocess.Popen[bytes], log: Path, what: str,
               timeout: float = 60.0) -> str:
    """Poll for a ready file; fail fast (with the log's tail) if the process dies."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            text = path.read_text()
            if text.endswith("\n"):
                return text.strip()
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        time.sleep(0.02)
    raise RuntimeError(f"{what} not ready after {timeout:.0f}s:\n{_tail(log)}")


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 15.0) -> int | None:
    """SIGTERM, wait (bounded), then SIGKILL. Returns the exit status."""
    if proc is None:
        return None
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    return proc.returncode


def daemon_command() -> list[str]:
    exe = Path(sys.executable).with_name("rpcbufd")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "control.daemon"]


# -- measurements -------------------------------------------------------------------


def data_sides(tcp: rpcbuf.RpcContext, local: rpcbuf.RpcContext, raw: RawPeer, sock: SockPeer,
               bids: dict[str, str], data: np.ndarray, out: np.ndarray,
               copy_dst: np.ndarray) -> tuple[dict[str, Round], dict[str, Round]]:
    """Every store side and every read side of one size, by JSON key."""
    stores: dict[str, Round] = {}
    reads: dict[str, Round] = {}
    for key, ctx in (("rpcbuf_tcp", tcp), ("rpcbuf_same_host", local)):
        async def rp_store(n: int, ctx: rpcbuf.RpcContext = ctx,
                           bid: str = bids[key]) -> list[float]:
            return await timed(lambda: ctx.store_tensor(bid, data), n)

        async def rp_read(n: int, ctx: rpcbuf.RpcContext = ctx,
                          bid: str = bids[key]) -> list[float]:
            return await timed(lambda: ctx.read_buffer(bid, out=out), n)

        stores[key], reads[key] = rp_store, rp_read

    async def raw_store(n: int) -> list[float]:
        return await raw.store(data, n)

    async def raw_read(n: int) -> list[float]:
        return await raw.read(out, n)

    stores["raw_ucxx"], reads["raw_ucxx"] = raw_store, raw_read
    stores["raw_socket"] = blocking(lambda n: sock.store(data, n))
    reads["raw_socket"] = blocking(lambda n: sock.read(out, n))
    stores["memcpy"] = reads["memcpy"] = memcpy_round(copy_dst, data)
    return stores, reads


async def bench_data(tcp: rpcbuf.RpcContext, local: rpcbuf.RpcContext, raw: RawPeer,
                     sock: SockPeer, plan: Plan) -> dict[str, Any]:
    """Store and read of each size: rpcbuf on both paths against raw ucxx, the
    raw socket and memcpy, all in one alternation; at the smallest size the
    store alternation also holds the raw socket's 40-byte round trip."""
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {}
    smallest = min(plan.iters)
    for nbytes, iters in plan.iters.items():
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        out = np.empty(nbytes, dtype=np.uint8)
        out.fill(0)  # touch every page before anything is timed
        copy_dst = np.empty(nbytes, dtype=np.uint8)
        copy_dst.fill(0)
        bids = {"rpcbuf_tcp": await tcp.request_buffer(nbytes),
                "rpcbuf_same_host": await local.request_buffer(nbytes)}
        try:
            stores, reads = data_sides(tcp, local, raw, sock, bids, data, out, copy_dst)
            if nbytes == smallest:
                stores["raw_socket_rtt_40B"] = blocking(lambda n: sock.round_trip(RTT_BYTES, n))

            warm = plan.warmup[nbytes]
            name = size_name(nbytes)
            for key in ("rpcbuf_tcp", "rpcbuf_same_host"):
                out.fill(0)
                await stores[key](warm)
                await reads[key](warm)
                if not np.array_equal(out, data):
                    raise RuntimeError(f"rpcbuf ({key}) read back different bytes ({name})")
            for key in ("raw_ucxx", "raw_socket", "memcpy"):
                await stores[key](warm)
                await reads[key](warm)
            if "raw_socket_rtt_40B" in stores:
                await stores["raw_socket_rtt_40B"](warm)
            s = await alternate_many(list(stores.values()), iters, plan.rounds, warm=True)
            r = await alternate_many(list(reads.values()), iters, plan.rounds, warm=True)
            results[name] = {
                "store": {key: summarize(samples, RTT_BYTES if key.endswith("_40B") else nbytes)
                          for key, samples in zip(stores, s, strict=True)},
                "read": {key: summarize(samples, nbytes)
                         for key, samples in zip(reads, r, strict=True)},
            }
        finally:
            await tcp.release_buffer(bids["rpcbuf_tcp"])
            await local.release_buffer(bids["rpcbuf_same_host"])
    return results


async def bench_control(ctx: rpcbuf.RpcContext, echo: EchoClient, plan: Plan) -> dict[str, Any]:
    # The echo sends exactly what rpcbuf sends: the same request objects, encoded the same way.
    sample_id = await ctx.request_buffer(4096)
    await ctx.release_buffer(sample_id)
    echo_req = P.RequestBuffer(size=4096)
    echo_rel = P.Release(buffer_id=sample_id)
    clock = time.perf_counter

    def sequential(kind: str) -> tuple[Round, dict[str, list[float]]]:
        parts: dict[str, list[float]] = {"first": [], "second": []}

        async def run(n: int) -> list[float]:
            pairs = []
            for _ in range(n):
                check_interrupted()
                t0 = clock()
                if kind == "rpcbuf":
                    bid = await ctx.request_buffer(4096)
                    t1 = clock()
                    await ctx.release_buffer(bid)
                else:
                    await echo.call(echo_req)
                    t1 = clock()
                    await echo.call(echo_rel)
                t2 = clock()
                parts["first"].append(t1 - t0)
                parts["second"].append(t2 - t1)
                pairs.append(t2 - t0)
            return pairs

        return run, parts

    async def rp_pair() -> None:
        await ctx.release_buffer(await ctx.request_buffer(4096))

    async def echo_pair() -> None:
        await echo.call(echo_req)
        await echo.call(echo_rel)

    def pipelined(pair: Callable[[], Awaitable[None]]) -> Round:
        async def run(n: int) -> list[float]:
            workers = min(plan.concurrency, n)

            async def worker(k: int) -> None:
                for _ in range(k):
                    check_interrupted()
                    await pair()

            t0 = clock()
            await asyncio.gather(*(worker(n // workers + (i < n % workers))
                                   for i in range(workers)))
            return [clock() - t0]

        return run

    rp_run, rp_parts = sequential("rpcbuf")
    echo_run, echo_parts = sequential("echo")
    await rp_run(50)  # warm-up
    await echo_run(50)
    for parts in (rp_parts, echo_parts):
        parts["first"].clear()
        parts["second"].clear()
    rp_pairs, echo_pairs = await alternate(rp_run, echo_run, plan.control_pairs, plan.rounds)

    await pipelined(rp_pair)(plan.concurrency * 4)  # warm-up
    await pipelined(echo_pair)(plan.concurrency * 4)
    rp_pipe, echo_pipe = await alternate(pipelined(rp_pair), pipelined(echo_pair),
                                         plan.pipelined_pairs, plan.rounds)
    pipe_ops = 2 * plan.pipelined_pairs
    return {
        "sequential": {
            "rpcbuf": {"pair": summarize(rp_pairs),
                       "request_buffer": summarize(rp_parts["first"]),
                       "release_buffer": summarize(rp_parts["second"])},
            "echo": {"pair": summarize(echo_pairs),
                     "first": summarize(echo_parts["first"]),
                     "second": summarize(echo_parts["second"])},
        },
        "pipelined": {
            "concurrency": plan.concurrency,
            "pairs": plan.pipelined_pairs,
            "rpcbuf": {"seconds": sum(rp_pipe), "ops_per_s": pipe_ops / sum(rp_pipe)},
            "echo": {"seconds": sum(echo_pipe), "echos_per_s": pipe_ops / sum(echo_pipe)},
        },
    }


@dataclass
class Batch:
    """The batching inputs, built once and used on both paths."""

    big: np.ndarray  # one 40 MiB array
    arrays: list[np.ndarray]  # 10,000 separate 4 KiB copies of its first 40,960,000 bytes
    tensors: dict[str, np.ndarray]
    items: list[tuple[int, np.ndarray]]
    out: np.ndarray  # 40 MiB, pre-touched

    @classmethod
    def make(cls) -> Batch:
        count, size = BATCH_TENSORS, BATCH_TENSOR_BYTES
        big = np.random.default_rng(1).integers(0, 256, ONE_TENSOR_BYTES, dtype=np.uint8)
        arrays = [row.copy() for row in big[:count * size].reshape(count, size)]
        out = np.empty(ONE_TENSOR_BYTES, dtype=np.uint8)
        out.fill(0)  # touch every page before anything is timed
        return cls(big, arrays, {f"t{i}": a for i, a in enumerate(arrays)},
                   [(i * size, a) for i, a in enumerate(arrays)], out)


async def bench_batching(ctx: rpcbuf.RpcContext, batch: Batch, sock: SockPeer,
                         plan: Plan) -> dict[str, Any]:
    """10,000 x 4 KiB tensors: batched (store_tensors, store_batch), naive
    (one store_tensor each) and load_tensors, each against one store / read
    of a single 40 MiB array (whose first 10,000 x 4 KiB are the tensors) and
    against the raw socket streaming the same 40,960,000 bytes as one store
    (one read for load_tensors)."""
    count, size = BATCH_TENSORS, BATCH_TENSOR_BYTES
    total = count * size  # 40,960,000 bytes: the issue's "40 MiB" is 41,943,040
    big, arrays, tensors, items = batch.big, batch.arrays, batch.tensors, batch.items
    out = batch.out
    buffer_size = rpcbuf.calculate_buffer_size(tensors)
    naive_n = min(plan.naive_tensors, count)
    scale = count / naive_n
    clock = time.perf_counter
    started = clock()
    tensors_bid = await ctx.request_buffer(buffer_size)
    # The 40 MiB store and read, store_batch (no manifest) and the naive loop.
    plain_bid = await ctx.request_buffer(ONE_TENSOR_BYTES)
    try:
        def repeat(op: Callable[[], Awaitable[Any]]) -> Round:
            async def run(n: int) -> list[float]:
                return await timed(op, n)
            return run

        async def naive_loop(n: int) -> list[float]:
            samples = []
            for _ in range(n):
                t0 = clock()
                for i in range(naive_n):
                    check_interrupted()
                    await ctx.store_tensor(plain_bid, arrays[i], offset=i * size)
                samples.append((clock() - t0) * scale)
            return samples

        one_store = repeat(lambda: ctx.store_tensor(plain_bid, big))
        one_read = repeat(lambda: ctx.read_buffer(plain_bid, out=out))
        store_tensors = repeat(lambda: ctx.store_tensors(tensors_bid, tensors))
        store_batch = repeat(lambda: ctx.store_batch(plain_bid, items))
        load_tensors = repeat(lambda: ctx.load_tensors(tensors_bid))
        stream = big[:total]
        sock_store = blocking(lambda n: sock.store(stream, n))
        sock_read = blocking(lambda n: sock.read(out[:total], n))

        # Warm every op up (fresh arena pages, the first manifest) and check the
        # bytes once: each batched write must read back as the arrays it stored.
        warm = plan.batch_warmup
        for op in (one_store, one_read, store_tensors, load_tensors, sock_store, sock_read):
            await op(warm)
        await ctx.clear_buffer(plain_bid)
        answer = await ctx.store_batch(plain_bid, items)
        await store_batch(warm - 1)
        await ctx.read_buffer(plain_bid, out=out)
        if not (np.array_equal(out[:total], big[:total]) and not out[total:].any()):
            raise RuntimeError("store_batch: the buffer does not read back as the arrays")
        for i in range(min(200, naive_n)):
            await ctx.store_tensor(plain_bid, arrays[i], offset=i * size)
        loaded = await ctx.load_tensors(tensors_bid)
        if list(loaded) != list(tensors) or not all(
                np.array_equal(loaded[name], a) for name, a in tensors.items()):
            raise RuntimeError("load_tensors did not return the arrays store_tensors stored")
        manifest_entries = len((await ctx.get_buffer_meta(tensors_bid))["tensors"])
        del loaded

        reps = plan.batch_reps
        st, st_ref, st_sock = await alternate_many((store_tensors, one_store, sock_store),
                                                   reps, reps)
        sb, sb_ref, sb_sock = await alternate_many((store_batch, one_store, sock_store),
                                                   reps, reps)
        nv, nv_ref = await alternate(naive_loop, one_store, plan.naive_reps, plan.naive_reps)
        lt, lt_ref, lt_sock = await alternate_many((load_tensors, one_read, sock_read),
                                                   reps, reps)
    finally:
        await ctx.release_buffer(tensors_bid)
        await ctx.release_buffer(plain_bid)

    def pair(ours: list[float], ref: list[float], ref_name: str,
             sock_samples: list[float] | None = None) -> dict[str, Any]:
        out = {"rpcbuf": summarize(ours, total), ref_name: summarize(ref, ONE_TENSOR_BYTES)}
        if sock_samples is not None:
            out["raw_socket_stream"] = summarize(sock_samples, total)
        return out

    return {
        "tensors": count,
        "tensor_bytes": size,
        "total_bytes": total,
        "one_tensor_bytes": ONE_TENSOR_BYTES,
        "buffer_size": buffer_size,
        "manifest_entries": manifest_entries,
        "store_batch_answer": answer,  # nbytes, items, UCX messages
        "store_tensors": pair(st, st_ref, "one_store", st_sock),
        "store_batch": pair(sb, sb_ref, "one_store", sb_sock),
        "naive_loop": {**pair(nv, nv_ref, "one_store"), "timed_tensors": naive_n,
                       "scaled_by": scale,
                       "per_store_us": float(np.median(nv)) / count * 1e6},
        "load_tensors": {**pair(lt, lt_ref, "one_read", lt_sock), "verify": True},
        "seconds": clock() - started,  # the whole section, warm-ups and checks included
    }


# -- idle CPU ------------------------------------------------------------------------


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads)."""
    ticks = cpu_ticks(pid)
    if ticks is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return ticks / os.sysconf("SC_CLK_TCK")


async def idle_cpu(pid: int, seconds: float) -> dict[str, Any]:
    """Share of one core the daemon (and this client) used over ``seconds`` of
    nothing to do: this process only sleeps on its event loop meanwhile."""
    clock = time.perf_counter
    d0, t0 = process_cpu_seconds(pid), clock()
    c0 = os.times()
    await asyncio.sleep(seconds)
    d1, t1 = process_cpu_seconds(pid), clock()
    c1 = os.times()
    wall = t1 - t0
    client = (c1.user + c1.system) - (c0.user + c0.system)
    return {"seconds": wall, "daemon_cpu_seconds": d1 - d0,
            "daemon_percent": 100.0 * (d1 - d0) / wall,
            "client_cpu_seconds": client, "client_percent": 100.0 * client / wall,
            "clock_ticks_per_s": os.sysconf("SC_CLK_TCK")}


def path_name(ctx: rpcbuf.RpcContext) -> str:
    return "same-host" if ctx.same_host else "UCX (tcp)"


async def run_all(addr: str, token: str, daemon_pid: int, peer_ucx_port: int, echo_port: int,
                  phase_port: int, sock_port: int, plan: Plan) -> dict[str, Any]:
    tcp: rpcbuf.RpcContext | None = None
    local: rpcbuf.RpcContext | None = None
    raw: RawPeer | None = None
    echo: EchoClient | None = None
    sock: SockPeer | None = None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _note_signal, sig)
    try:
        progress(f"daemon idle CPU before any client ({plan.idle_seconds:g} s) ...")
        idle_before = await idle_cpu(daemon_pid, plan.idle_seconds)
        tcp = await rpcbuf.connect(addr, token=token, same_host=False)  # UCX over loopback
        local = await rpcbuf.connect(addr, token=token)  # the default: same-host here
        paths: dict[str, Any] = {"tcp": tcp.same_host, "default": local.same_host}
        progress(f"contexts: same_host=False got the {path_name(tcp)} path, "
                 f"the default got the {path_name(local)} path")
        if paths["tcp"]:
            progress("WARNING: the context opened with same_host=False reports same_host")
        if not local.same_host:
            why = local.hello.get("same_host_why") or (
                "the daemon offered no same-host socket" if "local" not in local.hello
                else "the client stayed on TCP")
            paths["default_why"] = why
            progress(f"WARNING: the default context is not on the same-host path: {why}")
        raw = await RawPeer.connect(peer_ucx_port, phase_port)
        echo = await EchoClient.connect(echo_port)
        sock = SockPeer.connect(sock_port)
        progress("data ops: rpcbuf (tcp, same-host) vs raw ucxx, raw socket, memcpy ...")
        data = await bench_data(tcp, local, raw, sock, plan)
        progress("control ops: rpcbuf (default path, then tcp) vs msgpack echo ...")
        control = {"same_host": await bench_control(local, echo, plan),
                   "tcp": await bench_control(tcp, echo, plan)}
        # Done with the peer's ucxx and echo (its phases come over TCP, so an
        # idle peer has no UCX receive posted and uses no CPU; closing them is
        # just tidy).  The raw socket stays: it is the batching reference.
        await raw.close()
        raw = None
        echo.close()
        echo = None
        progress(f"batching: {BATCH_TENSORS:,} x {size_name(BATCH_TENSOR_BYTES)} "
                 f"vs one {size_name(ONE_TENSOR_BYTES)} tensor and the raw socket ...")
        batch = Batch.make()
        batching = {"same_host": await bench_batching(local, batch, sock, plan),
                    "tcp": await bench_batching(tcp, batch, sock, plan)}
        del batch
        sock.close()
        sock = None
        progress(f"daemon idle CPU, both contexts connected ({plan.idle_seconds:g} s) ...")
        gc.collect()
        idle_after = await idle_cpu(daemon_pid, plan.idle_seconds)
        return {"paths": paths, "data": data, "control": control, "batching": batching,
                "idle": {"before_clients": idle_before, "connected": idle_after},
                "daemon_limits": local.hello["limits"]}
    finally:
        if sock is not None:
            sock.close()
        if echo is not None:
            echo.close()
        if raw is not None:
            await raw.close()
        for ctx in (tcp, local):
            if ctx is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ctx.close(), 10)


# -- report ----------------------------------------------------------------------


@dataclass
class Row:
    what: str
    value: str
    reference: str
    ref_value: str
    ratio: float | None = None
    goal: str = "-"
    met: bool | None = None


def _us(us: float) -> str:
    return f"{us / 1000:,.1f} ms" if us >= 10_000 else f"{us:,.0f} us"


def _lat(s: dict[str, Any]) -> str:
    return f"{_us(s['p50_us'])} (p99 {_us(s['p99_us'])})"


PATH_KEYS = (("rpcbuf_tcp", "tcp"), ("rpcbuf_same_host", "same-host"))
REF_NAMES = {"raw_ucxx": {"store": "raw ucxx send+ack", "read": "raw ucxx req+recv"},
             "raw_socket": {"store": "raw socket send+ack", "read": "raw socket req+recv"}}


def lat_row(what: str, ours: dict[str, Any], ref_name: str, ref: dict[str, Any],
            goal: float | None = None) -> Row:
    """A latency (time) row: ratio = ours / reference, lower is better."""
    ratio = ours["p50_us"] / ref["p50_us"]
    row = Row(what, _lat(ours), ref_name, _lat(ref), ratio)
    if goal is not None:
        row.goal, row.met = f"<= {goal:g}x", ratio <= goal
    return row


def thr_row(what: str, ours: dict[str, Any], ref_name: str, ref: dict[str, Any],
            goal: float | None = None) -> Row:
    """A throughput row: ratio = ours / reference (GB/s at the medians), higher is better."""
    ratio = ours["gbps_p50"] / ref["gbps_p50"]
    row = Row(what, f"{ours['gbps_p50']:.3f} GB/s", ref_name, f"{ref['gbps_p50']:.3f} GB/s",
              ratio)
    if goal is not None:
        row.goal, row.met = f">= {goal:g}x", ratio >= goal
    return row


def data_rows(data: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for name, ops in data.items():
        nbytes = ops["store"]["rpcbuf_tcp"]["nbytes"]
        big = nbytes == BIG
        for op in ("store", "read"):
            d = ops[op]
            ucxx_name, sock_name = REF_NAMES["raw_ucxx"][op], REF_NAMES["raw_socket"][op]
            tcp, local = d["rpcbuf_tcp"], d["rpcbuf_same_host"]
            rows.append(lat_row(f"{op} {name} p50, tcp", tcp, ucxx_name, d["raw_ucxx"]))
            rows.append(thr_row(f"{op} {name} throughput, tcp", tcp, ucxx_name, d["raw_ucxx"],
                                0.9 if big else None))
            if big:
                rows.append(thr_row(f"{op} {name} throughput, tcp", tcp, sock_name,
                                    d["raw_socket"], 1.5))
            rows.append(lat_row(f"{op} {name} p50, same-host", local, ucxx_name, d["raw_ucxx"]))
            if nbytes >= MiB:
                rows.append(thr_row(f"{op} {name} throughput, same-host", local, "np.copyto",
                                    d["memcpy"], 0.6 if big else None))
            rtt = d.get("raw_socket_rtt_40B")
            if rtt is not None:
                for key, label in PATH_KEYS:
                    rows.append(lat_row(f"{op} {name} p50, {label}", d[key],
                                        f"raw socket {RTT_BYTES} B round trip", rtt, 2.0))
    return rows


def control_rows(control: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    for key, label in (("same_host", "same-host"), ("tcp", "tcp")):
        seq = control[key]["sequential"]
        ours, ref = seq["rpcbuf"], seq["echo"]
        rows.append(lat_row(f"request+release pair p50, {label}", ours["pair"],
                            "2 msgpack echos", ref["pair"], 2.0))
        for op, echo in (("request_buffer", "first"), ("release_buffer", "second")):
            rows.append(lat_row(f"{op} p50, {label}", ours[op], "1 msgpack echo", ref[echo]))
        pipe = control[key]["pipelined"]
        ops = pipe["rpcbuf"]["ops_per_s"]
        rows.append(Row(f"pipelined request+release ({pipe['concurrency']} in flight), {label}",
                        f"{ops:,.0f} ops/s", "pipelined echos",
                        f"{pipe['echo']['echos_per_s']:,.0f} /s",
                        ops / pipe["echo"]["echos_per_s"],
                        f">= {PIPELINED_GOAL:,} ops/s", ops >= PIPELINED_GOAL))
    return rows


def idle_rows(idle: dict[str, Any]) -> list[Row]:
    goal = f"~0 % (< {IDLE_GOAL_PERCENT:g} %)"
    before, after = idle["before_clients"], idle["connected"]
    return [
        Row("daemon idle CPU, before any client", f"{before['daemon_percent']:.1f} % of a core",
            "-", "-", None, goal, before["daemon_percent"] < IDLE_GOAL_PERCENT),
        Row("daemon idle CPU, 2 contexts connected", f"{after['daemon_percent']:.1f} % of a core",
            "-", "-", None, goal, after["daemon_percent"] < IDLE_GOAL_PERCENT),
        Row("client idle CPU, 2 contexts connected", f"{after['client_percent']:.1f} % of a core",
            "-", "-"),
    ]


def build_rows(results: dict[str, Any]) -> list[Row]:
    rows = data_rows(results["data"])
    rows += control_rows(results["control"])
    for key, label in (("same_host", "same-host"), ("tcp", "tcp")):
        rows += batching_rows(results["batching"][key], label)
    rows += idle_rows(results["idle"])
    return rows


def _took(s: dict[str, Any]) -> str:
    return f"{_us(s['p50_us'])} ({s['gbps_p50']:.2f} GB/s)"


def batching_rows(b: dict[str, Any], label: str) -> list[Row]:
    """Against one op on a single 40 MiB array: time / its time, lower is
    better; against the raw socket stream: throughput / its throughput (the
    same 40,960,000 bytes), higher is better."""
    n, size = b["tensors"], size_name(b["tensor_bytes"])
    one = f"one {size_name(b['one_tensor_bytes'])}"
    naive = b["naive_loop"]
    naive_name = f"naive loop {n:,} x store_tensor"
    if naive["timed_tensors"] != n:
        naive_name += f" ({naive['timed_tensors']:,} timed, x{naive['scaled_by']:g})"
    stream = f"raw socket {b['total_bytes'] / 1e6:.2f} MB stream"
    rows = []
    for what, key, ref_key, ref, time_goal, sock_ref, sock_goal in (
            (f"{n:,} x {size} store_tensors", "store_tensors", "one_store", f"{one} store",
             3.0, f"{stream} (store)", 0.5),
            (f"{n:,} x {size} store_batch", "store_batch", "one_store", f"{one} store",
             None, f"{stream} (store)", None),
            (naive_name, "naive_loop", "one_store", f"{one} store", None, None, None),
            (f"{n:,} x {size} load_tensors", "load_tensors", "one_read", f"{one} read_buffer",
             None, f"{stream} (read)", None)):
        ours, theirs = b[key]["rpcbuf"], b[key][ref_key]
        ratio = ours["p50_us"] / theirs["p50_us"]
        row = Row(f"{what}, {label}", _took(ours), ref, _took(theirs), ratio)
        if time_goal is not None:
            row.goal, row.met = f"<= {time_goal:g}x", ratio <= time_goal
        rows.append(row)
        if sock_ref is not None:
            rows.append(thr_row(f"{what}, {label}", ours, sock_ref,
                                b[key]["raw_socket_stream"], sock_goal))
    return rows


def format_table(rows: list[Row]) -> str:
    header = ("what", "rpcbuf", "reference", "reference value", "ratio", "goal", "met?")
    cells = [header] + [
        (r.what, r.value, r.reference, r.ref_value,
         "-" if r.ratio is None else f"{r.ratio:.2f}x", r.goal,
         "-" if r.met is None else ("yes" if r.met else "NO"))
        for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    right = {1, 3, 4}  # numbers line up on the right

    def line(c: tuple[str, ...]) -> str:
        return "  ".join(v.rjust(w) if i in right else v.ljust(w)
                         for i, (v, w) in enumerate(zip(c, widths, strict=True))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(c) for c in cells[1:])])


def progress(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- main ------------------------------------------------------------------------


def measure(plan: Plan, tmp: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start the daemon and the peer, measure, stop both (always, bounded)."""
    secret = auth.load_or_create_secret(tmp / "secret")
    token = auth.create_token(secret, "bench")
    daemon_log, peer_log = tmp / "daemon.log", tmp / "peer.log"
    daemon: subprocess.Popen[bytes] | None = None
    peer: subprocess.Popen[bytes] | None = None
    procs: dict[str, Any] = {}
    # Children get their own session (a terminal's Ctrl-C reaches only us, and we
    # stop them in order) and die with us however we die (PR_SET_PDEATHSIG).
    spawn: dict[str, Any] = {"stdin": subprocess.DEVNULL, "stderr": subprocess.STDOUT,
                             "start_new_session": True, "preexec_fn": _die_with_parent}
    handlers = {sig: signal.signal(sig, _raise_interrupted)
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with open(daemon_log, "wb") as log:
            daemon = subprocess.Popen(
                [*daemon_command(), "--listen", "127.0.0.1:0", "--ucx-port", "0",
                 "--device", "cpu:1GiB", "--secret-file", str(tmp / "secret"),
                 "--ready-file", str(tmp / "daemon.ready"), "--log-level", "WARNING"],
                stdout=log, **spawn)
        with open(peer_log, "wb") as log:
            peer = subprocess.Popen(
                [sys.executable, str(HERE / "_bench_peer.py"), "--ready-file",
                 str(tmp / "peer.ready"), "--max-bytes", str(max(plan.iters))],
                stdout=log, **spawn)
        addr, _daemon_ucx = wait_ready(tmp / "daemon.ready", daemon, daemon_log, "rpcbufd").split()
        peer_ucx, echo_port, phase_port, sock_port = wait_ready(
            tmp / "peer.ready", peer, peer_log, "bench peer").split()
        progress(f"rpcbufd at {addr} (pid {daemon.pid}), reference peer ucx={peer_ucx} "
                 f"echo={echo_port} socket={sock_port}")
        results = uvloop.run(run_all(addr, token, daemon.pid, int(peer_ucx), int(echo_port),
                                     int(phase_port), int(sock_port), plan))
    finally:
        for sig in handlers:  # cleanup is bounded; a second Ctrl-C must not cut it short
            signal.signal(sig, signal.SIG_IGN)
        procs["daemon_exit"] = stop(daemon)
        procs["peer_exit"] = stop(peer)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        procs["daemon_log"] = _tail(daemon_log, 50)
        procs["peer_log"] = _tail(peer_log, 50)
        for name in ("daemon", "peer"):
            if procs[f"{name}_exit"] not in (0, None, -signal.SIGTERM) or procs[f"{name}_log"]:
                progress(f"{name} exited {procs[f'{name}_exit']}; log tail:\n"
                         f"{procs[f'{name}_log']}")
    return results, procs


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU time used on the whole machine, CPU time of this process and its
    reaped children), to tell how much other processes competed with the run."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    machine = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    t = os.times()
    return machine, t.user + t.system + t.children_user + t.children_system


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default="bench.json", help="write every number here [%(default)s]")
    p.add_argument("--quick", action="store_true",
                   help="fewer iterations: a smoke run, about half a minute")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    started = time.time()
    before = cpu_seconds()
    try:
        with tempfile.TemporaryDirectory(prefix="rpcbuf-bench-") as tmpdir:
            results, procs = measure(plan, Path(tmpdir))
    except Interrupted as exc:
        progress(f"{exc}; daemon and peer stopped")
        return 128 + exc.signum
    after = cpu_seconds()
    wall = time.time() - started
    rows = build_rows(results)
    print(format_table(rows))
    if not results["paths"]["default"]:
        print("note: the default context did not get the same-host path: its rows "
              "(\"same-host\") measure the UCX (tcp) path")
    others = None if before is None or after is None else (
        (after[0] - before[0] - (after[1] - before[1])) / wall)
    if others is not None and others > 0.25:
        print(f"note: other processes used {others:.1f} CPUs on average during this run "
              f"({os.cpu_count()} CPUs here): latencies include scheduling delays; trust the "
              "ratios more than the absolute numbers, or rerun on a quiet machine")
    report = {
        "meta": {
            "started_at": started,
            "seconds": wall,
            "quick": args.quick,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "other_processes_cpus": others,
            "ucxx": getattr(ucx.ucxx(), "__version__", None),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX")},
            "plan": {**asdict(plan),
                     "iters": {size_name(k): v for k, v in plan.iters.items()},
                     "warmup": {size_name(k): v for k, v in plan.warmup.items()}},
        },
        **results,
        **procs,
        "rows": [asdict(r) for r in rows],
        "goals_met": all(r.met for r in rows if r.met is not None),
    }
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    progress(f"wrote {args.json} ({report['meta']['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
