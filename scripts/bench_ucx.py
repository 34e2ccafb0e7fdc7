"""UCX knobs for rpcbuf's data plane, measured: ucxx progress modes, the
rendezvous scheme, tcp segment and socket buffer sizes, UCX shared memory
against process_vm_readv, send_multi, and the ucxx core API.

Run as ``.venv/bin/python scripts/bench_ucx.py [--json bench_ucx.json] [--quick]``
(``make bench-ucx``).  About 2-3.5 minutes on 2 cores (``--quick``: about
1); ``--only KEY,KEY`` and ``--rounds N`` narrow it.  It holds every
configuration's process pair at once: about 0.45 GB each, 5-6 GB in all.

How it measures
---------------
UCX reads its environment when ucxx is imported, so each configuration gets
its own pair of processes, started by this one with that configuration's
environment: a *server* (a ucxx listener; receives into / sends from one
preallocated, pre-touched 64 MiB numpy buffer; it stands for rpcbufd) and a
*client* under uvloop that measures on command.  Phase headers travel over a
plain TCP connection, not UCX, so between phases the server has no UCX
receive posted (as rpcbufd, whose requests come over its control socket).
The pattern is ``scripts/_bench_peer.py``'s: a store sends N bytes and waits
for a 1-byte ack; a read sends an 8-byte request and receives N bytes.

All pairs are started first (each alone), then paused with SIGSTOP; a round
wakes each pair in turn (SIGCONT), has it run one *chunk* of every
measurement, and pauses it again, so configurations alternate every second
or so and drift on the shared machine hits all alike.  The order rotates
each round and reverses every other one.  The rounds are split over two
*generations* of fresh pairs (one with ``--quick``), so a pair that happens
to be slow (memory placement, which core it landed on) does not decide a
row.  Each timed phase starts with one untimed operation.

Every configuration runs with ``UCX_TLS=tcp`` (``sm,self`` where named),
``UCX_NET_DEVICES=lo``, ``UCX_WARN_UNUSED_ENV_VARS=n``, ``UCX_PROTO_INFO=y``
(the protocols UCX selected land in the logs and are parsed) and
``RPCBUF_UCX_CUDA=0``; any other ``UCX_*``/``UCXPY_*`` variable of the
caller's environment is dropped, so runs are comparable.  "rpcbuf env" means
``dataplane.ucx.UCX_DEFAULTS``: ``UCXPY_PROGRESS_MODE=blocking``,
``UCX_RNDV_SCHEME=put_zcopy``, ``UCX_TCP_TX_SEG_SIZE``/``RX_SEG_SIZE=2m``,
``UCX_RNDV_FRAG_MEM_TYPE=host`` (UCX 1.21 takes it as an alias of
``UCX_RNDV_FRAG_MEM_TYPES``).  ucxx sets ``UCX_RNDV_THRESH=8192`` when
imported, so 4 KiB always goes eager and 1 MiB / 64 MiB may go rendezvous.

Configurations (``key``: what it is)
------------------------------------
* ``ucxx-default``: ucxx as installed: ``thread`` progress and UCX's
  defaults (auto rendezvous scheme, 8 KiB / 64 KiB tcp segments, ucxx's
  ``UCX_RNDV_FRAG_MEM_TYPE=cuda``);
* ``thread``, ``polling``, ``ucxx-blocking``: rpcbuf env with that ucxx
  progress mode, driven by ucxx alone (``ucxx-blocking`` is ucxx 0.52's own
  ``BlockingMode``, *without* rpcbuf's ``AdaptiveProgress``);
* ``rpcbuf``: the reference: rpcbuf env, ``dataplane.ucx.ucxx()`` (so
  ``AdaptiveProgress`` replaces ucxx's blocking mode) and every transfer in
  ``ucx.busy()``, as rpcbufd does;
* ``rpcbuf-drain``: ``rpcbuf`` whose polling turns also call
  ``worker.progress()`` (drain every event) after a ``progress_once()`` that
  found work: a copy of AdaptiveProgress's loop with that one change,
  patched in by this script (ucxx's PollingMode drains, AdaptiveProgress
  does one ``ucp_worker_progress`` per event-loop turn);
* ``rndv-get``, ``rndv-auto``: ``rpcbuf`` with ``UCX_RNDV_SCHEME`` =
  ``get_zcopy`` / ``auto``;
* ``seg-default``, ``seg-8m``: ``rpcbuf`` with tcp segments at UCX's default
  (TX 8k / RX 64k, set explicitly) / at 8m;
* ``sockbuf-16m``: ``rpcbuf`` + ``UCX_TCP_SNDBUF``/``RCVBUF=16m`` (UCX's
  default ``auto`` leaves the kernel's autotuning on);
* ``sm``: ``rpcbuf`` with ``UCX_TLS=sm,self`` and endpoints created from
  each other's worker addresses (swapped over the TCP connection) with
  endpoint error handling *off*, the only way UCX picks shared memory.  In
  the same pair, alternating with it: the same 64 MiB copied by the server
  with ``process_vm_readv``/``writev`` (``dataplane.cma.Peer``, what rpcbuf's
  same-host path does; the client sends its array's address; timed by the
  client including one TCP round trip) and ``np.copyto`` in the client
  (memcpy, one core).

What is measured
----------------
* ``4K us``: 4 KiB store round trip, back to back, p50;
* ``4K cold`` / ``1M cold``: one 4 KiB / 1 MiB store after 25 ms of quiet on
  both sides, the phase header sent over TCP just before it (rpcbufd's
  shape: control message, then payload), p50 in us: a sleeping progress
  mode pays its wake-up here;
* ``1M``/``64M`` ``st``/``rd``: store / read GB/s at the median time;
* ``idle``: CPU of the server (utime+stime of all its threads, from
  ``/proc/PID/stat``) and of the client over ``idle_seconds`` while connected
  and quiet, after they measured, each pair alone, in % of one core;
* on ``rpcbuf``: 10,000 x 4 KiB by ``send_multi`` (server: ``recv_multi``,
  which allocates its own buffers), by a loop of 10,000 awaited ``send``,
  and one 40,960,000-byte ``send``, alternating; and the 4 KiB round trip
  through ucxx's core API (``ep._ep.tag_send``/``tag_recv``, prebuilt
  ``Array``/``Tag``; the asyncio ``Endpoint`` wrapper checks, wraps and
  sha1-hashes the tag on every call) alternating with the wrapper's;
* dead peer, on the last generation's ``rpcbuf`` (tcp, error handling on)
  and ``sm`` (error handling off): the server posts 64 MiB receives (each
  bounded by ``dead_timeout``), the client starts sending and SIGKILLs
  itself mid-transfer; how the server's receive ended, and when.

How to read it
--------------
Absolute numbers swing with the machine's load; read the ratios.  ``x ref``
is the median, over rounds, of the ratio to the ``rpcbuf`` row measured in
the same round (for times lower is better, for GB/s higher is better);
``64M wins`` counts the rounds in which this row's 64 MiB store, read beat
``rpcbuf``'s.  A ratio within about 10 % of 1, or won in about half the
rounds, is a tie.  On a loaded 2-core machine results are bimodal per
chunk: when other processes keep a core busy, a process that spins
(polling, or any mode while a transfer is in flight) waits for a scheduler
tick (4 ms here) at every hand-off, and a 4 KiB round trip takes ~8 ms
instead of ~45 us; the line under the table says how busy other processes
kept the CPUs.  Per-round samples are in the JSON (``samples_s``), with
every protocol table UCX printed (``summary.*.proto_info``).

Process hygiene: children run in their own session, get SIGKILL from the
kernel if this process dies (PR_SET_PDEATHSIG), and are stopped (SIGCONT,
SIGTERM, bounded wait, SIGKILL) on every exit path; every wait is bounded;
SIGINT/SIGTERM here exit 128 + signal after cleaning up.

Findings on the development VM (UCX 1.21, ucxx 0.52, 2 shared cores)
--------------------------------------------------------------------
Two full runs (12 rounds each; other processes kept 0.3 and 0.1 of the 2
CPUs busy); ranges span both.  Rerun before relying on a number.  ``x ref``
is against ``rpcbuf``:

* Progress: ``thread`` (ucxx's default) loses: 4 KiB round trip 4x slower
  (183-190 vs 45-46 us), 64 MiB at 0.45-0.49x, 1 MiB at 0.1-0.6x.
  ``polling`` is at best ~10 % faster: 4 KiB 0.92x, 64 MiB 1.00-1.12x (a tie
  on the quiet run, 1.11-1.12x in 10-11 of 12 rounds on the other), and
  burns ~100 % of a core per process while idle; ``ucxx-blocking`` is as
  fast and burns as much (its epoll fd is never re-armed).  ``rpcbuf``
  (AdaptiveProgress) keeps that speed at 0-1.3 % idle CPU: it stays.
  ``rpcbuf-drain`` is 1.04-1.08x at 64 MiB (won 8-9 of 12 rounds), mixed at
  1 MiB (0.86-1.23x): small, worth a closer look, not a clear win.
* Rendezvous scheme: ``auto`` picks the same protocol as ``put_zcopy`` when
  the segments are 2m (a tie), but with UCX's default segments it picks
  "rendezvous fragmented copy-in copy-out" above 16 KiB, the slow pipeline
  of ``ucxx-default``; ``UCX_RNDV_FRAG_MEM_TYPE=host`` alone does not change
  that.  ``get_zcopy`` has no rendezvous protocol over tcp at all: UCX falls
  back to eager ("multi-frag eager zero-copy" above 2 MiB): 64 MiB
  1.10-1.21x (10-11 of 12 rounds) but 1 MiB 0.74-0.86x, and eager means a
  receiver that is not ready buffers the whole payload and a refused store
  (the 1-byte receive rpcbufd posts) still moves every byte.  ``put_zcopy``
  stays.
* tcp segments (default 8k/64k, 2m, 8m) and ``UCX_TCP_SNDBUF/RCVBUF=16m``
  (UCX 1.21 has both; default ``auto``): ties under ``put_zcopy``: 64 MiB
  0.94-1.08x, 1 MiB scattered both ways with no consistent direction.  The
  2m segments matter only to ``auto``'s choice above.
* Protocols (UCX_PROTO_INFO, tag send from host memory): 4 KiB is "eager
  zero-copy copy-out" on tcp in every configuration; 1 MiB and 64 MiB are
  "rendezvous zero-copy fenced write to remote" (put) wherever
  ``put_zcopy`` or 2m segments are set, "rendezvous fragmented copy-in
  copy-out" with ucxx's defaults, eager with ``get_zcopy``.  On ``sm``:
  eager short to 92 B, "eager copy-in copy-out" over sysv to 8 KiB, then
  "rendezvous zero-copy flushed write to remote" over cma.  UCX marks
  rendezvous rows "(?)": their performance is an estimate.
* Same host: UCX ``sm`` beats tcp (64 MiB 1.9-2.1x, 1 MiB 2.2-3.3x, 4 KiB
  round trip 0.52-0.54x) and runs at memcpy speed (0.97-1.02x
  ``np.copyto``), but ``process_vm_readv``/``writev`` done by the server,
  rpcbuf's same-host path, moved the same 64 MiB at 10.4-12.1 GB/s: ~2x UCX
  ``sm`` and 2.0-2.3x a one-core ``np.copyto``.  And with endpoint error
  handling off (which ``sm`` needs), a client killed mid-send leaves the
  server's receive pending for ever (still pending at the 4 s bound, both
  runs), while tcp with error handling on fails it with
  ``UCXXConnectionResetError`` 15-25 ms after the kill.  The cma path stays.
* ``send_multi`` of 10,000 x 4 KiB took 8.6-9.1x one 40 MB send, no better
  than a plain loop of 10,000 ``send`` (8.0-8.9x): coalescing into one
  transfer is what wins.
* ucxx core API: 4 KiB round trip 0.82-0.83x the asyncio ``Endpoint``'s (38
  vs 45-46 us, both in ``busy()``); it means private attributes
  (``ep._ep``, ``ep._tags``).
* Cold (after 25 ms quiet), p50: AdaptiveProgress rows 0.8-1.0 ms for 4 KiB
  and 1.6-2.5 ms for 1 MiB, polling 0.6-1.0 / 1.5-1.9 ms, thread 2.6-4.2 /
  5.9-6.8 ms; under load all of these turn into multiples of the 4 ms tick.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import platform
import re
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from _benchkit import cpu_ticks, no_gc

KiB, MiB = 1 << 10, 1 << 20
HERE = Path(__file__).resolve().parent
BIG = 64 * MiB
MULTI_COUNT, MULTI_BYTES = 10_000, 4 * KiB
TAG_DATA, TAG_REPLY = 2, 3

# Control messages over TCP: header (mode, nbytes, iters, arg).
HDR = struct.Struct("<qqqq")
LEN = struct.Struct("<q")
(M_QUIT, M_HELLO, M_STORE, M_READ, M_STORE_MANY, M_MULTI, M_CMA_STORE, M_CMA_READ,
 M_DEADPEER) = range(9)

BASE_ENV = {
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "lo",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_PROTO_INFO": "y",
    "RPCBUF_UCX_CUDA": "0",
}


@dataclass(frozen=True)
class Config:
    key: str
    what: str
    env: dict[str, str | None] = field(default_factory=dict)  # over BASE_ENV; None: unset
    rpcbuf_env: bool = True  # dataplane.ucx.UCX_DEFAULTS in the environment
    adaptive: bool = True  # dataplane.ucx.ucxx() (AdaptiveProgress) + ucx.busy()
    same_host: bool = False  # worker-address endpoints, error handling off; cma, memcpy
    drain: bool = False  # AdaptiveProgress variant: worker.progress() after progress_once()


REF = "rpcbuf"
CONFIGS = (
    Config("ucxx-default", "ucxx as installed: thread progress, UCX defaults",
           {"UCXPY_PROGRESS_MODE": None}, rpcbuf_env=False, adaptive=False),
    Config("thread", "rpcbuf env, ucxx thread progress",
           {"UCXPY_PROGRESS_MODE": "thread"}, adaptive=False),
    Config("polling", "rpcbuf env, ucxx polling progress",
           {"UCXPY_PROGRESS_MODE": "polling"}, adaptive=False),
    Config("ucxx-blocking", "rpcbuf env, ucxx's own blocking mode",
           {"UCXPY_PROGRESS_MODE": "blocking"}, adaptive=False),
    Config(REF, "rpcbuf defaults (AdaptiveProgress + busy())"),
    Config("rpcbuf-drain", "rpcbuf, polling turns drain the worker (progress())",
           drain=True),
    Config("rndv-get", "rpcbuf, UCX_RNDV_SCHEME=get_zcopy", {"UCX_RNDV_SCHEME": "get_zcopy"}),
    Config("rndv-auto", "rpcbuf, UCX_RNDV_SCHEME=auto", {"UCX_RNDV_SCHEME": "auto"}),
    Config("seg-default", "rpcbuf, tcp segments at UCX default (8k/64k)",
           {"UCX_TCP_TX_SEG_SIZE": "8k", "UCX_TCP_RX_SEG_SIZE": "64k"}),
    Config("seg-8m", "rpcbuf, tcp segments 8m",
           {"UCX_TCP_TX_SEG_SIZE": "8m", "UCX_TCP_RX_SEG_SIZE": "8m"}),
    Config("sockbuf-16m", "rpcbuf, UCX_TCP_SNDBUF/RCVBUF=16m",
           {"UCX_TCP_SNDBUF": "16m", "UCX_TCP_RCVBUF": "16m"}),
    Config("sm", "rpcbuf, UCX_TLS=sm,self, worker-address eps, no error handling",
           {"UCX_TLS": "sm,self"}, same_host=True),
)
BY_KEY = {c.key: c for c in CONFIGS}


@dataclass(frozen=True)
class Plan:
    """How much to measure. Counts are per round (one chunk per configuration)."""

    name: str
    rounds: int
    lat_iters: int  # 4 KiB back-to-back round trips
    cold_iters: int  # 4 KiB, and 1 MiB, stores after a quiet gap
    cold_gap: float
    mid_iters: int  # 1 MiB transfers per direction
    big_iters: int  # 64 MiB transfers per direction (and cma, memcpy on ``sm``)
    idle_seconds: float
    multi_reps: int  # rounds of the three batching variants (``rpcbuf`` only)
    dead_timeout: float  # the server's bound on one receive in the dead-peer test
    command_timeout: float  # bound on one command (setup, a chunk, ...)
    generations: int  # fresh sets of pairs the rounds are split over


FULL = Plan("full", rounds=12, lat_iters=100, cold_iters=2, cold_gap=0.025, mid_iters=4,
            big_iters=2, idle_seconds=1.5, multi_reps=3, dead_timeout=4.0,
            command_timeout=60.0, generations=2)
QUICK = Plan("quick", rounds=3, lat_iters=60, cold_iters=2, cold_gap=0.025, mid_iters=3,
             big_iters=2, idle_seconds=1.0, multi_reps=2, dead_timeout=3.0,
             command_timeout=60.0, generations=1)
PLANS = {p.name: p for p in (FULL, QUICK)}


# -- shared helpers -----------------------------------------------------------------


def write_json(path: str | Path, obj: Any) -> None:
    """Atomically, so a reader never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def load_ucxx(cfg: Config) -> tuple[Any, Callable[[], Any]]:
    """ucxx (imported only now: the environment is ours) and the busy() marker."""
    if cfg.adaptive:
        from dataplane import ucx

        mod = ucx.ucxx()
        if cfg.drain:
            _drain_each_turn()
        return mod, ucx.busy
    import ucxx

    return ucxx, contextlib.nullcontext


def _drain_each_turn() -> None:
    """The ``rpcbuf-drain`` variant: AdaptiveProgress's polling loop (a copy of
    ``dataplane.ucx``'s ``_poll_until_armed``) with one change: a turn that made
    progress also calls ``worker.progress()``, which repeats
    ``ucp_worker_progress`` until nothing is left (ucxx's PollingMode calls only
    that), instead of one ``progress_once()`` per event-loop turn."""
    from ucxx._lib_async import application_context

    async def _poll_until_armed(self: Any) -> None:
        worker = self.worker
        while worker is not None and not self.stopped:
            try:
                if worker.progress_once():
                    worker.progress()
                    self._until = time.monotonic() + self.GRACE
                elif not self.busy and time.monotonic() >= self._until:
                    if worker.arm():
                        return
                    continue
            except Exception:
                pass
            await asyncio.sleep(0)
            worker = self.worker

    application_context.BlockingMode._poll_until_armed = _poll_until_armed


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


async def server_main(args: argparse.Namespace) -> None:
    cfg = BY_KEY[args.config]
    U, busy = load_ucxx(cfg)
    from dataplane import cma

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
                    peer = cma.Peer(arg)
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
    with open(args.ready_file + ".tmp", "w") as f:
        f.write(f"{port} {ucx_port}\n")
    os.replace(args.ready_file + ".tmp", args.ready_file)
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


# -- client -------------------------------------------------------------------------

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


def rotated(keys: list[str], r: int) -> list[str]:
    r %= max(1, len(keys))
    return keys[r:] + keys[:r]


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


# -- parent -------------------------------------------------------------------------

_prctl = ctypes.CDLL(None, use_errno=True).prctl
PR_SET_PDEATHSIG = 1
_children: list[subprocess.Popen[bytes]] = []


class Interrupted(BaseException):  # not an Exception: no handler below swallows it
    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


def _raise_interrupted(signum: int, _frame: Any) -> None:
    raise Interrupted(signum)


def _die_with_parent() -> None:
    """In each child before exec: SIGKILL from the kernel if the parent dies."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def progress(msg: str) -> None:
    print(f"[bench_ucx] {msg}", file=sys.stderr, flush=True)


def child_env(cfg: Config) -> dict[str, str]:
    from dataplane.ucx import UCX_DEFAULTS  # does not import ucxx

    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "UCXPY_"))}
    env.update(BASE_ENV)
    if cfg.rpcbuf_env:
        env.update(UCX_DEFAULTS)
    env.update({k: v for k, v in cfg.env.items() if v is not None})
    for k in [k for k, v in cfg.env.items() if v is None]:
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE.parent / "src"), env.get("PYTHONPATH", "")) if p)
    return env


def spawn(cmd: list[str], env: dict[str, str], log: Path,
          **kw: Any) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_die_with_parent, **kw)
    _children.append(proc)
    return proc


def stop(proc: subprocess.Popen[bytes] | None, timeout: float = 3.0) -> int | None:
    """SIGCONT (it may be paused), SIGTERM, bounded wait, then SIGKILL."""
    if proc is None:
        return None
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGCONT)
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    if proc in _children:
        _children.remove(proc)
    return proc.returncode


def tail(path: Path, n: int = 8) -> str:
    """The log's last lines, without UCX_PROTO_INFO's tables."""
    with contextlib.suppress(OSError):
        lines = [ln for ln in path.read_text(errors="replace").splitlines()
                 if "ucp_context" not in ln and not ln.rstrip().endswith(("|", "+"))]
        return "\n".join(lines[-n:])
    return ""


def wait_file(path: Path, proc: subprocess.Popen[bytes] | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if proc is not None and proc.poll() is not None:
            return path.exists()
        time.sleep(0.02)
    return False


def machine_cpu() -> tuple[float, float]:
    """(CPU seconds the whole machine has used, CPU seconds of this process and
    its children), to tell how much other processes took meanwhile."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:9]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    ours = sum(cpu_ticks(p.pid) or 0 for p in _children)
    t = os.times()
    return (busy / os.sysconf("SC_CLK_TCK"),
            t.user + t.system + ours / os.sysconf("SC_CLK_TCK"))


class Pair:
    """One configuration's server and client, kept alive (and paused with
    SIGSTOP while the other configurations measure) for the whole run."""

    def __init__(self, cfg: Config, plan: Plan, d: Path, extras: set[str]) -> None:
        self.cfg, self.plan, self.d, self.extras = cfg, plan, d, extras
        self.server: subprocess.Popen[bytes] | None = None
        self.client: subprocess.Popen[bytes] | None = None
        self._fd = -1
        self._buf = b""
        self.alive = False
        self.errors: list[str] = []

    def start(self) -> None:
        d, cfg = self.d, self.cfg
        d.mkdir()
        env = child_env(cfg)
        me = [sys.executable, str(Path(__file__).resolve()), "--config", cfg.key,
              "--plan", self.plan.name]
        self.server = spawn([*me, "--role", "server", "--ready-file", str(d / "ready"),
                             "--result-file", str(d / "server.json"), "--max-bytes", str(BIG)],
                            env, d / "server.log", stdin=subprocess.DEVNULL)
        if not wait_file(d / "ready", self.server, 60):
            raise RuntimeError(f"server not ready (exit {self.server.poll()}):\n"
                               f"{tail(d / 'server.log')}")
        ctrl_port, ucx_port = (d / "ready").read_text().split()
        r, w = os.pipe()
        try:
            self.client = spawn(
                [*me, "--role", "client", "--ctrl-port", ctrl_port, "--ucx-port", ucx_port,
                 "--server-pid", str(self.server.pid), "--result-fd", str(w),
                 "--extras", ",".join(sorted(self.extras))],
                env, d / "client.log", stdin=subprocess.PIPE, pass_fds=(w,))
        finally:
            os.close(w)
        self._fd = r
        answer = self.answer(self.plan.command_timeout + 10)
        if not answer.get("ready"):
            raise RuntimeError(f"client: {answer.get('error')}\n{tail(d / 'client.log')}")
        self.alive = True

    def answer(self, timeout: float) -> dict[str, Any]:
        """The client's next JSON line (bounded; EOF: it exited)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from the client in {timeout:.0f} s")
            ready, _, _ = select.select([self._fd], [], [], left)
            if ready:
                got = os.read(self._fd, 1 << 16)
                if not got:
                    code = None if self.client is None else self.client.poll()
                    raise EOFError(f"client exited ({code}):\n{tail(self.d / 'client.log')}")
                self._buf += got
        line, self._buf = self._buf.split(b"\n", 1)
        result: dict[str, Any] = json.loads(line)
        return result

    def send(self, command: str) -> None:
        assert self.client is not None and self.client.stdin is not None
        self.client.stdin.write(command.encode() + b"\n")
        self.client.stdin.flush()

    def ask(self, command: str) -> dict[str, Any]:
        """Run one command with the pair awake; pause it again after. A failed
        pair is stopped and asked nothing more."""
        if not self.alive:
            return {}
        self.signal(signal.SIGCONT)
        try:
            self.send(command)
            answer = self.answer(self.plan.command_timeout + 10)
        except Exception as exc:
            answer = {"error": f"{command}: {type(exc).__name__}: {exc}"}
        if "error" in answer:
            self.errors.append(answer["error"])
            self.close()
        else:
            self.signal(signal.SIGSTOP)
        return answer

    def signal(self, sig: int) -> None:
        for proc in (self.server, self.client):
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, sig)

    def dead_peer(self) -> dict[str, Any]:
        """The client SIGKILLs itself mid-send: how does the server's receive end?"""
        info: dict[str, Any] = {}
        if not self.alive or self.server is None or self.client is None:
            return {"outcome": "pair not running"}
        self.signal(signal.SIGCONT)
        self.alive = False
        try:
            self.send("deadpeer")
            info.update(self.answer(self.plan.command_timeout))
            died = float(info.pop("killed_at"))
            info["send_done_at_kill"] = info.pop("send_done", None)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.client.wait(5)
            info["client_exit"] = self.client.poll()
            path = self.d / "server.json"
            if wait_file(path, self.server, self.plan.dead_timeout + 5):
                r = json.loads(path.read_text())["dead_peer"]
                info.update(r)
                info["ended_after_kill_s"] = r["ended"] - died
            else:
                code = self.server.poll()
                info["outcome"] = (f"server exited with {code}" if code is not None
                                   else "no answer from the server")
            # The server ends by itself once the client's TCP connection is gone:
            # 0 is a clean exit, a negative status the signal that ended it (-6: abort).
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.wait(3)
            info["server_exit"] = self.server.poll()
        except Exception as exc:
            info["outcome"] = f"test failed: {type(exc).__name__}: {exc}"
        return info

    def close(self) -> None:
        self.alive = False
        stop(self.client)
        stop(self.server)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# -- UCX_PROTO_INFO ---------------------------------------------------------------

_TITLE = re.compile(r"\|\s*(ucp_context_\d+ .*?cfg#\d+)\s*\|\s*(.+?)\s*\|\s*$")
_ROW = re.compile(r"\|\s*([0-9KMGTinf]+\.\.[0-9KMGTinf]+)\s*\|\s*(.+?)\s*\|\s*(.+?)\s*\|\s*$")
TAG_SEND = "tagged message by ucp_tag_send* from host memory"


def parse_proto_info(log: Path) -> dict[str, list[list[str]]]:
    """``{"<scope>: <operation>": [[range, protocol, transport], ...]}``."""
    tables: dict[str, list[list[str]]] = {}
    current: list[list[str]] | None = None
    with contextlib.suppress(OSError):
        for line in log.read_text(errors="replace").splitlines():
            if m := _TITLE.search(line):
                current = tables.setdefault(f"{m[1]}: {m[2]}", [])
            elif current is not None and (m := _ROW.search(line)):
                if [m[1], m[2], m[3]] not in current:
                    current.append([m[1], m[2], m[3]])
    return tables


def _size(tok: str) -> float:
    if tok == "inf":
        return float("inf")
    units = {"K": KiB, "M": MiB, "G": 1 << 30, "T": 1 << 40}
    return float(tok[:-1]) * units[tok[-1]] if tok[-1] in units else float(tok)


def protocol_for(tables: dict[str, list[list[str]]], nbytes: int) -> str:
    """The tag-send protocol (and transport) UCX picked for ``nbytes``."""
    for title, rows in tables.items():
        if title.endswith(": " + TAG_SEND):
            for rng, proto, tl in rows:
                lo, hi = rng.split("..")
                if _size(lo) <= nbytes <= _size(hi):
                    return f"{proto} [{tl}]"
    return "?"


# -- summary --------------------------------------------------------------------------


def p50(xs: list[float]) -> float | None:
    return float(np.median(xs)) if xs else None


# (sample key, "time" or "rate"): how its "x ref" reads (rate: higher is better)
COMPARED = (("lat_4k", "time"), ("cold_4k", "time"), ("cold_1m", "time"),
            ("store_1m", "rate"), ("read_1m", "rate"), ("store_64m", "rate"),
            ("read_64m", "rate"))


@dataclass
class Agg:
    """Everything measured for one configuration, over all rounds and pairs."""

    cfg: Config
    samples: dict[str, list[float]] = field(default_factory=dict)
    by_round: dict[int, dict[str, list[float]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    idle: dict[str, float] | None = None
    proto_info: dict[str, dict[str, list[list[str]]]] = field(default_factory=dict)

    def add(self, rnd: int, samples: dict[str, list[float]]) -> None:
        for k, v in samples.items():
            self.samples.setdefault(k, []).extend(v)
            self.by_round.setdefault(rnd, {}).setdefault(k, []).extend(v)


def summarize(agg: Agg, ref: Agg | None) -> dict[str, Any]:
    """Medians of the pooled samples; against the reference, the median over
    rounds of the per-round ratio (both measured in the same round), and in how
    many rounds this configuration beat it."""
    s: dict[str, Any] = {"what": agg.cfg.what,
                         "n": {k: len(v) for k, v in agg.samples.items()}}
    for k, v in agg.samples.items():
        m = p50(v)
        if m is None:
            continue
        s[f"{k}_p50_us"] = m * 1e6
        nbytes = {"1m": MiB, "64m": BIG}.get(k.rsplit("_", 1)[-1])
        if nbytes is not None and not k.startswith("cold"):
            s[f"{k}_gbps"] = nbytes / m / 1e9
    for k, kind in COMPARED:
        if ref is None:
            break
        ratios = []
        for rnd, mine in agg.by_round.items():
            a, b = p50(mine.get(k, [])), p50(ref.by_round.get(rnd, {}).get(k, []))
            if a and b:
                ratios.append(a / b if kind == "time" else b / a)
        if ratios:
            s[f"{k}_x_ref"] = float(np.median(ratios))
            better = sum(r < 1 if kind == "time" else r > 1 for r in ratios)
            s[f"{k}_rounds_better"] = f"{better}/{len(ratios)}"
    if agg.idle:
        s["idle_server_pct"] = agg.idle["server_pct"]
        s["idle_client_pct"] = agg.idle["client_pct"]
    s["errors"] = agg.errors
    s["proto_info"] = agg.proto_info
    s["protocols"] = {name: protocol_for(agg.proto_info.get("client", {}), n)
                      for name, n in (("4K", 4 * KiB), ("1M", MiB), ("64M", BIG))}
    return s


def fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def ratio(v: float | None, ref: float | None) -> str:
    return "-" if v is None or not ref else f"{v / ref:.2f}x"


def table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]], text: bool = False) -> str:
    widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]

    def line(r: tuple[str, ...]) -> str:
        return "  ".join(c.ljust(w) if i == 0 or text else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
    return "\n".join([line(header), "  ".join("-" * w for w in widths),
                      *(line(r) for r in rows)])


def wins(s: dict[str, Any]) -> str:
    """Rounds in which 64 MiB store, read beat the reference: "st,rd/rounds"."""
    st, rd = s.get("store_64m_rounds_better"), s.get("read_64m_rounds_better")
    if not st or not rd:
        return "-"
    return f"{st.split('/')[0]},{rd}"


def report(summary: dict[str, dict[str, Any]], dead: dict[str, Any]) -> str:
    ref = summary.get(REF, {})
    rows = []
    for key, s in summary.items():
        g = s.get

        def x(k: str, g: Callable[[str], Any] = g) -> str:
            return fmt(g(f"{k}_x_ref"), ".2f") + "x" if g(f"{k}_x_ref") is not None else "-"
        rows.append((
            key, fmt(g("lat_4k_p50_us"), ".0f"), x("lat_4k"),
            fmt(g("cold_4k_p50_us"), ".0f"), fmt(g("cold_1m_p50_us"), ".0f"),
            fmt(g("store_1m_gbps"), ".2f"), x("store_1m"), fmt(g("read_1m_gbps"), ".2f"),
            x("read_1m"), fmt(g("store_64m_gbps"), ".2f"), x("store_64m"),
            fmt(g("read_64m_gbps"), ".2f"), x("read_64m"),
            wins(s), fmt(g("idle_server_pct"), ".1f"), fmt(g("idle_client_pct"), ".1f"),
            "ERR" if s["errors"] else ""))
    out = [table(("config", "4K us", "x ref", "4K cold", "1M cold", "1M st", "x ref", "1M rd",
                  "x ref", "64M st", "x ref", "64M rd", "x ref", "64M wins", "idle srv%",
                  "idle cli%", ""), rows)]
    out.append("\n4K us: 4 KiB store round trip p50; cold: the same (and 1 MiB) after 25 ms "
               "quiet, p50 us; st/rd: GB/s at the median; x ref: median over rounds of the\n"
               "ratio to the rpcbuf row's in the same round (time: lower is better; GB/s: "
               "higher is better); 64M wins: rounds in which store, read beat rpcbuf's;\n"
               "idle: % of one core, server and client, connected and quiet")

    sm = summary.get("sm")
    if sm and sm.get("memcpy_64m_gbps"):
        mc = sm["memcpy_64m_gbps"]
        rows2 = [(name, fmt(sm.get(f"{k}_gbps"), ".2f"), ratio(sm.get(f"{k}_gbps"), mc))
                 for name, k in (("UCX sm store", "store_64m"), ("UCX sm read", "read_64m"),
                                 ("process_vm_readv (store)", "cma_store_64m"),
                                 ("process_vm_writev (read)", "cma_read_64m"),
                                 ("np.copyto (memcpy)", "memcpy_64m"))]
        out += ["", "same host, 64 MiB, one process pair, alternating:",
                table(("path", "GB/s", "x memcpy"), rows2)]
    if ref.get("multi_one_send_p50_us"):
        one = ref["multi_one_send_p50_us"]
        rows3 = [(name, fmt(ref.get(f"{k}_p50_us", 0) / 1e3, ".1f"),
                  ratio(ref.get(f"{k}_p50_us"), one))
                 for name, k in (("send_multi 10,000 x 4 KiB", "multi_send_multi"),
                                 ("loop of 10,000 send()", "multi_send_loop"),
                                 ("one 40,960,000 B send", "multi_one_send"))]
        out += ["", "batching on rpcbuf (tcp), time per batch incl. 1-byte ack:",
                table(("how", "ms p50", "x one send"), rows3)]
    if ref.get("lat_4k_core_p50_us"):
        out.append(f"\n4 KiB round trip, ucxx core API {ref['lat_4k_core_p50_us']:.0f} us vs "
                   f"asyncio Endpoint {ref['lat_4k_p50_us']:.0f} us "
                   f"({ratio(ref['lat_4k_core_p50_us'], ref['lat_4k_p50_us'])})")
    out += ["", "protocol UCX chose for tag send (UCX_PROTO_INFO):"]
    out.append(table(("config", "4 KiB", "1 MiB", "64 MiB"),
                     [(k, s["protocols"]["4K"], s["protocols"]["1M"], s["protocols"]["64M"])
                      for k, s in summary.items()], text=True))
    if dead:
        out += ["", "dead peer (client SIGKILLed mid-send; server receive bounded):"]
        for k, info in dead.items():
            after = info.get("ended_after_kill_s")
            timed_out = "timed out" in str(info.get("outcome"))
            out.append(f"  {k}: {info.get('completed_before', 0)} receives done, then "
                       f"{info.get('outcome')}"
                       + ("" if after is None or timed_out else f", {after:.3f} s after the kill")
                       + f"; server exit status {info.get('server_exit')}")
    errs = [(k, e) for k, s in summary.items() for e in s["errors"]]
    if errs:
        out += ["", "errors:"] + [f"  {k}: {e}" for k, e in errs]
    return "\n".join(out)


def start_pairs(configs: list[Config], plan: Plan, base: Path,
                aggs: dict[str, Agg]) -> dict[str, Pair]:
    """Start every configuration's pair, each alone, and pause it once ready."""
    base.mkdir()
    pairs: dict[str, Pair] = {}
    for cfg in configs:
        extras = {"multi", "core"} if cfg.key == REF else set()
        pair = pairs[cfg.key] = Pair(cfg, plan, base / cfg.key, extras)
        t0 = time.monotonic()
        try:
            pair.start()
            pair.signal(signal.SIGSTOP)
        except Exception as exc:
            pair.errors.append(f"start: {type(exc).__name__}: {exc}")
            pair.close()
        aggs[cfg.key].errors += pair.errors
        pair.errors = []
        progress(f"started {cfg.key} ({time.monotonic() - t0:.1f} s)"
                 + ("" if pair.alive else f" ERROR {aggs[cfg.key].errors[-1]}"))
    return pairs


def measure(configs: list[Config], plan: Plan, tmp: Path, aggs: dict[str, Agg],
            dead: dict[str, Any], others: list[float]) -> None:
    """Rounds over fresh pairs per generation; then idle CPU, batching and the
    dead-peer test on the last generation's pairs."""
    rnd = 0
    for gen in range(plan.generations):
        pairs = start_pairs(configs, plan, tmp / f"gen{gen}", aggs)
        try:
            n = plan.rounds // plan.generations + (gen < plan.rounds % plan.generations)
            for _ in range(n):
                keys = rotated(list(pairs), rnd * (len(pairs) // plan.rounds + 1))
                if rnd % 2:
                    keys.reverse()
                cpu0, t0 = machine_cpu(), time.monotonic()
                for key in keys:
                    aggs[key].add(rnd, pairs[key].ask(f"chunk {rnd}").get("samples", {}))
                cpu1, wall = machine_cpu(), time.monotonic() - t0
                others.append(((cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])) / wall)
                progress(f"round {rnd + 1}/{plan.rounds}: {wall:.1f} s, other processes "
                         f"kept {others[-1]:.1f} CPUs busy")
                rnd += 1
            if gen == plan.generations - 1:
                for key, pair in pairs.items():  # idle CPU, each pair alone
                    aggs[key].idle = pair.ask("idle").get("idle")
                if REF in pairs:
                    aggs[REF].add(-1, pairs[REF].ask("multi").get("samples", {}))
                for key in (REF, "sm"):
                    if key in pairs:
                        dead[key] = pairs[key].dead_peer()
        finally:
            for key, pair in pairs.items():
                pair.close()
                aggs[key].errors += pair.errors
                aggs[key].proto_info = {who: parse_proto_info(pair.d / f"{who}.log")
                                        for who in ("client", "server")}


def parent(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    if args.rounds:
        plan = replace(plan, rounds=args.rounds)
    plan = replace(plan, generations=max(1, min(plan.generations, plan.rounds)))
    configs = [c for c in CONFIGS if not args.only or c.key in args.only.split(",")]
    started = time.time()
    handlers = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGINT, signal.SIGTERM)}
    aggs = {c.key: Agg(c) for c in configs}
    dead: dict[str, Any] = {}
    others: list[float] = []
    try:
        with tempfile.TemporaryDirectory(prefix="rpcbuf-bench-ucx-") as tmpdir:
            measure(configs, plan, Path(tmpdir), aggs, dead, others)
    except Interrupted as exc:
        progress(f"{exc}; children stopped")
        return 128 + exc.signum
    finally:
        for s in handlers:
            signal.signal(s, signal.SIG_IGN)
        for proc in list(_children):
            stop(proc)
        for s, h in handlers.items():
            signal.signal(s, h)
    summary = {key: summarize(agg, aggs.get(REF)) for key, agg in aggs.items()}
    print(report(summary, dead))
    mean_others = float(np.mean(others)) if others else 0.0
    print(f"\nother processes kept {mean_others:.1f} of {os.cpu_count()} CPUs busy on "
          "average while measuring (per round: "
          + ", ".join(f"{o:.1f}" for o in others) + ")")
    if args.json:
        doc = {
            "meta": {"started_at": started, "seconds": time.time() - started,
                     "plan": asdict(plan), "python": sys.version.split()[0],
                     "platform": platform.platform(), "cpus": os.cpu_count(),
                     "others_cpus_per_round": others,
                     "env": {c.key: {k: v for k, v in sorted(child_env(c).items())
                                     if k.startswith(("UCX", "RPCBUF"))} for c in configs}},
            "summary": summary,
            "dead_peer": dead,
            "samples_s": {key: agg.by_round for key, agg in aggs.items()},
        }
        Path(args.json).write_text(json.dumps(doc, indent=1, default=str) + "\n")
        progress(f"wrote {args.json} ({time.time() - started:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", default="bench_ucx.json", help="write every number here "
                   "[%(default)s]; '' for none")
    p.add_argument("--quick", action="store_true", help="one round, fewer iterations")
    p.add_argument("--only", default="", help="comma-separated config keys (default: all)")
    p.add_argument("--rounds", type=int, default=0, help="rounds over the configurations "
                   f"(default: {FULL.rounds}, {QUICK.rounds} with --quick)")
    # the children's arguments
    p.add_argument("--role", choices=("server", "client"), help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--plan", default="full", help=argparse.SUPPRESS)
    p.add_argument("--ready-file", help=argparse.SUPPRESS)
    p.add_argument("--result-file", help=argparse.SUPPRESS)
    p.add_argument("--max-bytes", type=int, default=BIG, help=argparse.SUPPRESS)
    p.add_argument("--ctrl-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ucx-port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)
    p.add_argument("--extras", default="", help=argparse.SUPPRESS)
    p.add_argument("--result-fd", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role:
        return child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
