"""rpcbuf benchmark: data ops against raw ucxx, control ops against a bare echo.

Run as ``.venv/bin/python scripts/bench.py [--json bench.json] [--quick]``.

What runs where (all on 127.0.0.1, one run, so the ratios compare like with
like; DESIGN.md "Performance goals" says the ratios are what count):

* this process, the client, under uvloop: ``rpcbuf.connect`` to the daemon,
  plus a raw ucxx endpoint and a bare echo connection to the reference peer;
* a real ``rpcbufd`` (``--device cpu:1GiB``, free ports, ``--ready-file``);
* ``scripts/_bench_peer.py``, the reference peer: a raw ucxx listener that
  receives into / sends from a preallocated numpy buffer, and a msgpack echo
  server using the daemon's framing (``control.protocol``).

All three processes get the same UCX settings: ``UCX_TLS=tcp``,
``UCX_NET_DEVICES=lo`` and ``dataplane.ucx.apply_defaults()`` (blocking
progress, put_zcopy rendezvous, 2 MiB tcp segments), each only where the
environment does not already set it.  So raw ucxx runs with the fastest
settings found (DESIGN.md "Facts measured here"), as the goal demands.

Measured, for 4 KiB, 1 MiB and 64 MiB uint8 arrays: rpcbuf ``store_tensor``
(one control round trip, payload over UCX) against raw "send N bytes, recv a
1-byte ack"; rpcbuf ``read_buffer(out=...)`` against raw "send an 8-byte
request, recv N bytes".  Control ops: ``request_buffer(4096)`` +
``release_buffer`` pairs one at a time against two sequential echos of the
same two messages (same bytes on the wire, same framing, same uvloop TCP), and
pipelined with ``asyncio.gather`` of many workers against the same for echos.

Batching, last, with the peer's connections closed (its posted ucxx receive
is polled with ``sleep(0)`` and would keep a core busy; client and daemon
only): 10,000 separate 4 KiB uint8 arrays against one 40 MiB uint8 array, as
the issue words the goal (the tensors are copies of its first 40,960,000
bytes; it has 41,943,040).  Each call is timed whole (median), in rounds of
one call alternating with the reference, after warm-up:

* ``store_tensors(bid, {"t0": a0, ...})`` into a buffer sized by
  ``calculate_buffer_size`` (a ``get_buffer_meta`` round trip for the
  manifest, then one ``store_batch`` round trip whose touching tensors
  coalesce into one UCX message; each call overwrites the same names in
  place) against one 40 MiB ``store_tensor``;
* ``store_batch(bid, [(offset, array), ...])``, no manifest, against the same;
* the naive loop, one ``store_tensor`` per array (with ``--quick`` only the
  first 2,000 are timed and the time is scaled to 10,000), against the same;
* ``load_tensors(bid)`` (one batch read, checksums verified, the default)
  against one 40 MiB ``read_buffer(out=...)``.

Each batched write is checked once to read back as the arrays it stored.
For these rows the ratio is time / reference time: lower is better.

Each measurement warms up first (the first store touches fresh arena pages),
then runs rpcbuf and its reference in alternating rounds, so drift on a busy
2-core machine hits both alike.  The garbage collector is off while timing.
Latency is per operation (median and p99); throughput is bytes / median, so
a throughput ratio is the inverse of the latency ratio.

Output: one aligned table on stdout and every number (including each sample,
in microseconds) as JSON at ``--json`` (the batching rows under "batching").
Goals (from the issues): 64 MiB store and read >= 0.9 x raw ucxx throughput;
request+release p50 <= 2 x the bare echo p50 (a pair against a pair of echos,
i.e. per op against one echo); storing 10,000 x 4 KiB tensors with
``store_tensors`` takes <= 3 x the time of storing one 40 MiB tensor.
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
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable, Iterator  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

from dataplane import ucx  # noqa: E402

ucx.apply_defaults()  # blocking progress, put_zcopy, 2 MiB segments: for us and our children

import numpy as np  # noqa: E402
import uvloop  # noqa: E402

import rpcbuf  # noqa: E402
from _bench_peer import MODE_QUIT, MODE_READ, MODE_STORE, PHASE, TAG_DATA, TAG_REPLY  # noqa: E402
from control import auth  # noqa: E402
from control import protocol as P  # noqa: E402

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


FULL = Plan(iters={4 * KiB: 3000, 1 * MiB: 300, 64 * MiB: 30},
            warmup={4 * KiB: 200, 1 * MiB: 20, 64 * MiB: 3},
            rounds=10, control_pairs=3000, pipelined_pairs=20000, concurrency=64,
            batch_reps=7, batch_warmup=2, naive_tensors=10_000, naive_reps=3)
QUICK = Plan(iters={4 * KiB: 300, 1 * MiB: 40, 64 * MiB: 6},
             warmup={4 * KiB: 50, 1 * MiB: 5, 64 * MiB: 2},
             rounds=4, control_pairs=300, pipelined_pairs=2000, concurrency=64,
             batch_reps=3, batch_warmup=1, naive_tensors=2_000, naive_reps=1)
BATCH_TENSORS = 10_000  # the issue's batch: 10,000 tensors of 4 KiB
BATCH_TENSOR_BYTES = 4 * KiB
ONE_TENSOR_BYTES = 40 * MiB  # the issue's reference: "one 40 MiB tensor"


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


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def timed(op: Callable[[], Awaitable[Any]], iters: int) -> list[float]:
    samples = []
    clock = time.perf_counter
    for _ in range(iters):
        check_interrupted()
        t0 = clock()
        await op()
        samples.append(clock() - t0)
    return samples


async def alternate(ours: Round, ref: Round, iters: int, rounds: int,
                    warm: bool = False) -> tuple[list[float], list[float]]:
    """Run ``iters`` of each in ``rounds`` chunks, swapping who goes first.

    With ``warm`` each chunk starts with one untimed operation: both sides measure steady
    traffic.  (The raw peer has its receive posted, and so keeps polling,
    through a whole chunk; rpcbufd sleeps on epoll after 10 ms without
    traffic, and the first transfer after such a lull pays a UCX wake-up:
    that cost is real but belongs to another row than steady throughput.)"""
    a: list[float] = []
    b: list[float] = []
    rounds = max(1, min(rounds, iters))
    w = 1 if warm else 0
    for r in range(rounds):
        n = iters // rounds + (1 if r < iters % rounds else 0)
        with no_gc():
            if r % 2 == 0:
                a += (await ours(n + w))[w:]
                b += (await ref(n + w))[w:]
            else:
                b += (await ref(n + w))[w:]
                a += (await ours(n + w))[w:]
    return a, b


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


async def bench_data(ctx: rpcbuf.RpcContext, raw: RawPeer, plan: Plan) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {}
    for nbytes, iters in plan.iters.items():
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        out = np.empty(nbytes, dtype=np.uint8)
        out.fill(0)  # touch every page before anything is timed
        bid = await ctx.request_buffer(nbytes)
        try:
            async def rp_store(n: int, bid: str = bid, data: np.ndarray = data) -> list[float]:
                return await timed(lambda: ctx.store_tensor(bid, data), n)

            async def rp_read(n: int, bid: str = bid, out: np.ndarray = out) -> list[float]:
                return await timed(lambda: ctx.read_buffer(bid, out=out), n)

            async def raw_store(n: int, data: np.ndarray = data) -> list[float]:
                return await raw.store(data, n)

            async def raw_read(n: int, out: np.ndarray = out) -> list[float]:
                return await raw.read(out, n)

            warm = plan.warmup[nbytes]
            await rp_store(warm)
            await rp_read(warm)
            if not np.array_equal(out, data):
                raise RuntimeError(f"rpcbuf read back different bytes ({size_name(nbytes)})")
            await raw_store(warm)
            await raw_read(warm)
            name = size_name(nbytes)
            s_ours, s_ref = await alternate(rp_store, raw_store, iters, plan.rounds, warm=True)
            r_ours, r_ref = await alternate(rp_read, raw_read, iters, plan.rounds, warm=True)
            results[name] = {
                "store": {"rpcbuf": summarize(s_ours, nbytes),
                          "raw_ucxx": summarize(s_ref, nbytes)},
                "read": {"rpcbuf": summarize(r_ours, nbytes),
                         "raw_ucxx": summarize(r_ref, nbytes)},
            }
        finally:
            await ctx.release_buffer(bid)
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


async def bench_batching(ctx: rpcbuf.RpcContext, plan: Plan) -> dict[str, Any]:
    """10,000 x 4 KiB tensors: batched (store_tensors, store_batch), naive
    (one store_tensor each) and load_tensors, each against one store / read
    of a single 40 MiB array (whose first 10,000 x 4 KiB are the tensors)."""
    count, size = BATCH_TENSORS, BATCH_TENSOR_BYTES
    total = count * size  # 40,960,000 bytes: the issue's "40 MiB" is 41,943,040
    big = np.random.default_rng(1).integers(0, 256, ONE_TENSOR_BYTES, dtype=np.uint8)
    arrays = [row.copy() for row in big[:total].reshape(count, size)]  # separate allocations
    tensors = {f"t{i}": a for i, a in enumerate(arrays)}
    items = [(i * size, a) for i, a in enumerate(arrays)]
    out = np.empty(ONE_TENSOR_BYTES, dtype=np.uint8)
    out.fill(0)  # touch every page before anything is timed
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

        # Warm every op up (fresh arena pages, the first manifest) and check the
        # bytes once: each batched write must read back as the arrays it stored.
        warm = plan.batch_warmup
        for op in (one_store, one_read, store_tensors, load_tensors):
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
        st, st_ref = await alternate(store_tensors, one_store, reps, reps)
        sb, sb_ref = await alternate(store_batch, one_store, reps, reps)
        nv, nv_ref = await alternate(naive_loop, one_store, plan.naive_reps, plan.naive_reps)
        lt, lt_ref = await alternate(load_tensors, one_read, reps, reps)
    finally:
        await ctx.release_buffer(tensors_bid)
        await ctx.release_buffer(plain_bid)

    def pair(ours: list[float], ref: list[float], ref_name: str) -> dict[str, Any]:
        return {"rpcbuf": summarize(ours, total), ref_name: summarize(ref, ONE_TENSOR_BYTES)}

    return {
        "tensors": count,
        "tensor_bytes": size,
        "total_bytes": total,
        "one_tensor_bytes": ONE_TENSOR_BYTES,
        "buffer_size": buffer_size,
        "manifest_entries": manifest_entries,
        "store_batch_answer": answer,  # nbytes, items, UCX messages
        "store_tensors": pair(st, st_ref, "one_store"),
        "store_batch": pair(sb, sb_ref, "one_store"),
        "naive_loop": {**pair(nv, nv_ref, "one_store"), "timed_tensors": naive_n,
                       "scaled_by": scale,
                       "per_store_us": float(np.median(nv)) / count * 1e6},
        "load_tensors": {**pair(lt, lt_ref, "one_read"), "verify": True},
        "seconds": clock() - started,  # the whole section, warm-ups and checks included
    }


async def run_all(addr: str, token: str, peer_ucx_port: int, echo_port: int, phase_port: int,
                  plan: Plan) -> dict[str, Any]:
    ctx: rpcbuf.RpcContext | None = None
    raw: RawPeer | None = None
    echo: EchoClient | None = None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _note_signal, sig)
    try:
        ctx = await rpcbuf.connect(addr, token=token)
        raw = await RawPeer.connect(peer_ucx_port, phase_port)
        echo = await EchoClient.connect(echo_port)
        progress("data ops: rpcbuf vs raw ucxx ...")
        data = await bench_data(ctx, raw, plan)
        progress("control ops: rpcbuf vs msgpack echo ...")
        control = await bench_control(ctx, echo, plan)
        # Done with the peer (its phases come over TCP, so an idle peer has no
        # UCX receive posted and uses no CPU; closing it is just tidy).
        await raw.close()
        raw = None
        echo.close()
        echo = None
        progress(f"batching: {BATCH_TENSORS:,} x {size_name(BATCH_TENSOR_BYTES)} "
                 f"vs one {size_name(ONE_TENSOR_BYTES)} tensor ...")
        batching = await bench_batching(ctx, plan)
        return {"data": data, "control": control, "batching": batching,
                "daemon_limits": ctx.hello["limits"]}
    finally:
        if echo is not None:
            echo.close()
        if raw is not None:
            await raw.close()
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


def build_rows(results: dict[str, Any]) -> list[Row]:
    rows: list[Row] = []
    refs = {"store": "raw ucxx send+ack", "read": "raw ucxx req+recv"}
    for name, ops in results["data"].items():
        for op in ("store", "read"):
            ours, ref = ops[op]["rpcbuf"], ops[op]["raw_ucxx"]
            rows.append(Row(f"{op} {name} latency p50", _lat(ours), refs[op], _lat(ref),
                            ours["p50_us"] / ref["p50_us"]))
            ratio = ours["gbps_p50"] / ref["gbps_p50"]
            row = Row(f"{op} {name} throughput", f"{ours['gbps_p50']:.3f} GB/s", refs[op],
                      f"{ref['gbps_p50']:.3f} GB/s", ratio)
            if ours["nbytes"] == 64 * MiB:
                row.goal, row.met = ">= 0.9x", ratio >= 0.9
            rows.append(row)
    seq = results["control"]["sequential"]
    ours, ref = seq["rpcbuf"], seq["echo"]
    ratio = ours["pair"]["p50_us"] / ref["pair"]["p50_us"]
    rows.append(Row("request+release pair p50", _lat(ours["pair"]), "2 msgpack echos",
                    _lat(ref["pair"]), ratio, "<= 2x", ratio <= 2.0))
    for op, echo in (("request_buffer", "first"), ("release_buffer", "second")):
        rows.append(Row(f"{op} p50", _lat(ours[op]), "1 msgpack echo", _lat(ref[echo]),
                        ours[op]["p50_us"] / ref[echo]["p50_us"]))
    pipe = results["control"]["pipelined"]
    rows.append(Row(f"pipelined ops ({pipe['concurrency']} in flight)",
                    f"{pipe['rpcbuf']['ops_per_s']:,.0f} ops/s", "pipelined echos",
                    f"{pipe['echo']['echos_per_s']:,.0f} /s",
                    pipe["rpcbuf"]["ops_per_s"] / pipe["echo"]["echos_per_s"]))
    rows += batching_rows(results["batching"])
    return rows


def _took(s: dict[str, Any]) -> str:
    return f"{_us(s['p50_us'])} ({s['gbps_p50']:.2f} GB/s)"


def batching_rows(b: dict[str, Any]) -> list[Row]:
    """Time of the batched op / time of one op on a single array: lower is better."""
    n, size = b["tensors"], size_name(b["tensor_bytes"])
    one = f"one {size_name(b['one_tensor_bytes'])}"
    naive = b["naive_loop"]
    naive_name = f"naive loop {n:,} x store_tensor"
    if naive["timed_tensors"] != n:
        naive_name += f" ({naive['timed_tensors']:,} timed, x{naive['scaled_by']:g})"
    rows = []
    for what, key, ref_key, ref, goal in (
            (f"{n:,} x {size} store_tensors", "store_tensors", "one_store", f"{one} store", 3.0),
            (f"{n:,} x {size} store_batch", "store_batch", "one_store", f"{one} store", None),
            (naive_name, "naive_loop", "one_store", f"{one} store", None),
            (f"{n:,} x {size} load_tensors", "load_tensors", "one_read", f"{one} read_buffer",
             None)):
        ours, theirs = b[key]["rpcbuf"], b[key][ref_key]
        ratio = ours["p50_us"] / theirs["p50_us"]
        row = Row(what, _took(ours), ref, _took(theirs), ratio)
        if goal is not None:
            row.goal, row.met = f"<= {goal:g}x", ratio <= goal
        rows.append(row)
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
        peer_ucx, echo_port, phase_port = wait_ready(tmp / "peer.ready", peer, peer_log,
                                                     "bench peer").split()
        progress(f"rpcbufd at {addr}, reference peer ucx={peer_ucx} echo={echo_port}")
        results = uvloop.run(run_all(addr, token, int(peer_ucx), int(echo_port),
                                     int(phase_port), plan))
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
                   help="fewer iterations: a smoke run, well under 30 s")
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
