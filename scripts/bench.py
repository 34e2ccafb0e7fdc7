"""rpcbuf benchmark: data ops against raw ucxx, a raw socket and memcpy,
control ops against a bare echo, and the daemon's idle CPU.

Run as ``.venv/bin/python scripts/bench.py [--json bench.json] [--quick]
[--only data,control,batching,idle]`` (``make bench`` runs it whole;
``--only`` runs those sections alone, for a quick look at one kind of row);
``--render bench.json`` prints a stored run's table again and measures nothing.

The pieces: ``_bench_plan`` (how much, the sizes and goals), ``_bench_refs``
(the references' clients), ``_bench_data`` (store/read and batching rows),
``_bench_control`` (control ops, idle CPU), ``_bench_rows`` (the table);
``_bench_peer.py`` is the reference peer; ``benchkit`` starts and stops the
processes, times, and writes the table and the JSON.

What runs where (all on 127.0.0.1, one run, so the ratios compare like with
like; DESIGN.md "Performance goals" says the ratios are what count):

* this process, the client, under uvloop: two rpcbuf contexts on the daemon,
  ``rpcbuf.connect(addr, token=..., same_host=False)`` (the UCX path over
  loopback TCP, "tcp" in the table) and ``rpcbuf.connect(addr, token=...)``,
  the default, which on the daemon's own host is the same-host path (this
  process copies into or out of the session's staging area, the daemon
  between it and its arena; "same-host" in the table; a loopback client
  gets it by default).  Which
  path each got is printed, and a note under the table says so when the
  default one did not get the same-host path (its rows then measure UCX).
  Plus bare echo connections (TCP, and a Unix socket for the same-host
  context, whose control channel is one) and a plain blocking socket to the
  reference peer;
* a real ``rpcbufd`` (``--device cpu:1GiB``, free ports, ``--ready-file``,
  its same-host socket left at ``auto``);
* ``scripts/_bench_peer.py``, the reference peer: a msgpack echo server
  using the daemon's framing (``control.wire.protocol``), on TCP and on a Unix
  socket in the run's temporary directory, and a raw blocking TCP
  socket server in its own thread (not asyncio) with its own preallocated
  buffer;
* the raw ucxx reference, both ends in processes of their own
  (``scripts/_bench_rawucx.py``, driven by ``_bench_refs.RawUcxx``): a
  server that receives into / sends from a preallocated numpy buffer and a
  client that times the exchanges, each plain ucxx under ``asyncio.run``
  with ucxx's own blocking progress (which keeps polling once it has seen
  traffic: the pair is kept SIGSTOPped between its rounds so it takes no
  CPU from the others).

Every process gets the same UCX settings: ``UCX_TLS=tcp``,
``UCX_NET_DEVICES=lo`` and ``rpcbuf.dataplane.ucx.UCX_DEFAULTS`` (blocking
progress, auto rendezvous, 2 MiB tcp segments), each only where the
environment does not already set it.  So raw ucxx runs with the fastest
settings found (DESIGN.md "Facts measured here"), as the goal demands.
Why the reference is built this way (it used to be a client in this process,
through rpcbuf's own ``AdaptiveProgress``, which made it about as slow as
rpcbuf wherever progress is the limit): docs/performance.md "The raw ucxx
reference".

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
framing, uvloop to the echo server over the same kind of connection as the
context's control channel: a Unix socket for the same-host context, TCP for
the other), and pipelined with ``asyncio.gather`` of many workers against
the same for echos.

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

Goals (``_bench_plan``; each shows in the row it applies to, and a row with
two goals is two rows).  The first round's (DESIGN.md "Performance goals"
as it stood then; they still apply):

* 64 MiB store and read over tcp: >= 0.9 x raw ucxx throughput (foundation;
  issue 15 repeats it) and >= 1.5 x the raw blocking socket's;
* 64 MiB store and read, same-host: >= 0.6 x ``np.copyto`` throughput;
* one 4 KiB store: p50 <= 2 x the raw socket's 40-byte round trip p50, on
  both paths (the same-host one is the default on this host);
* request+release: pair p50 <= 2 x the bare echo p50 (a pair against a pair
  of echos, i.e. per op against one echo); pipelined on one connection
  >= 20,000 ops/s (absolute);
* 10,000 x 4 KiB ``store_tensors``: <= 3 x the time of one 40 MiB store
  (foundation) and >= 0.5 x the raw socket stream's throughput (store_batch
  and load_tensors show both ratios without a goal);
* daemon idle: ~0 % CPU, met below 2 % of one core.

Issue 15's (performance round 2), marked "(15)" in the table; those that
need a peer (Mooncake, NIXL) are ``bench_peers.py``'s, the load_model ones
``bench_load.py``'s:

* one 4 KiB store over tcp: p50 <= 1.5 x raw ucxx send+ack;
* one 4 KiB store, same-host: p50 <= 0.5 x the tcp path's (the read's
  ratio is shown without a goal), with the daemon's idle CPU still ~0 %;
* 64 MiB store and read, same-host: >= 1.0 x ``np.copyto``;
* pipelined request+release: >= 0.8 x pipelined echos over the same kind
  of connection.

Issue 35's (performance round 3: the owner's stores and reads in place),
marked "(35)": the same-host context writes its own buffers in place
(docs/dataplane.md, "Writing in place"), so its rows are one copy each:

* 1 MiB store and read, same-host: >= 0.9 x ``np.copyto`` throughput;
* one 4 KiB store, same-host: p50 <= 12.5 x ``np.copyto``'s of 4 KiB (the
  issue's "at least 0.08 x"; about 5 us here);
* 64 MiB, same-host: >= 1.0 x ``np.copyto`` (issue 15's row).

Output: one aligned table on stdout (value, reference, ratio, goal, met;
medians, within about 100 columns, the words its rows share in notes under
it) and every number (including each sample, in microseconds) as JSON at
``--json``: "paths" (which path each context got), "data" (per size and
direction, keyed rpcbuf_tcp, rpcbuf_same_host, raw_ucxx, raw_socket,
memcpy, raw_socket_rtt_40B), "control" (each path's, with "echo_over":
unix or tcp) and "batching" (each per path), "idle", "rows".
Missing a goal does not change the exit status; errors do (SIGINT/SIGTERM:
128 + signal).  The daemon and the peer are stopped with SIGTERM (bounded,
then SIGKILL) however the run ends, and get SIGTERM from the kernel should
this process die first (PR_SET_PDEATHSIG).  The share of CPU that other
processes took during the run is printed when it is large, and always stored.
"""

from __future__ import annotations

import benchkit

# UCX reads its environment when ucxx is imported: set ours before anything can.
benchkit.loopback_ucx_env()

from rpcbuf.dataplane import ucx  # noqa: E402

ucx.apply_defaults()  # blocking progress, auto rendezvous, tcp PUT off: us and our children

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import uvloop  # noqa: E402

import rpcbuf  # noqa: E402
from _bench_control import bench_control, idle_cpu  # noqa: E402
from _bench_data import Batch, bench_batching, bench_data  # noqa: E402
from _bench_plan import (  # noqa: E402
    BATCH_TENSOR_BYTES,
    BATCH_TENSORS,
    FULL,
    ONE_TENSOR_BYTES,
    QUICK,
    SECTIONS,
    Plan,
)
from _bench_refs import EchoClient, RawUcxx, SockPeer  # noqa: E402
from _bench_rows import build_rows, notes, render  # noqa: E402
from benchkit import procs, size_name  # noqa: E402
from benchkit.interrupt import Interrupted, interruptible, note_signals  # noqa: E402
from benchkit.report import machine_meta, progress_printer, read_stored, write_json  # noqa: E402
from benchkit.timing import cpu_split  # noqa: E402

progress = progress_printer("bench")


def path_name(ctx: rpcbuf.RpcContext) -> str:
    return "same-host" if ctx.same_host else "UCX (tcp)"


async def run_all(addr: str, token: str, daemon_pid: int, raw: RawUcxx | None, echo_port: int,
                  echo_unix: str, sock_port: int, plan: Plan,
                  sections: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    tcp: rpcbuf.RpcContext | None = None
    local: rpcbuf.RpcContext | None = None
    echo: EchoClient | None = None
    unix_echo: EchoClient | None = None
    sock: SockPeer | None = None
    note_signals(asyncio.get_running_loop())
    out: dict[str, Any] = {}
    try:
        if "idle" in sections:
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
        out["paths"] = paths
        echo = await EchoClient.connect(echo_port)
        sock = SockPeer.connect(sock_port)
        if "data" in sections:
            assert raw is not None, "measure() starts the raw ucxx pair for the data section"
            progress("data ops: rpcbuf (tcp, same-host) vs raw ucxx, raw socket, memcpy ...")
            out["data"] = await bench_data(tcp, local, raw, sock, plan)
        if "control" in sections:
            # Each context against an echo over its own kind of connection: the
            # same-host path's control channel is the daemon's Unix socket.
            over = "unix" if local.same_host else "tcp"
            if local.same_host:
                unix_echo = await EchoClient.connect_unix(echo_unix)
            progress(f"control ops: rpcbuf (default path, then tcp) vs msgpack echo "
                     f"({over}, then tcp) ...")
            out["control"] = {
                "same_host": {**await bench_control(local, unix_echo or echo, plan),
                              "echo_over": over},
                "tcp": {**await bench_control(tcp, echo, plan), "echo_over": "tcp"}}
        # Done with the echos (closing them is just tidy; the raw ucxx pair is
        # stopped between its rounds and ended by measure()).  The raw socket
        # stays: it is the batching reference.
        for client in (echo, unix_echo):
            if client is not None:
                client.close()
        echo = unix_echo = None
        if "batching" in sections:
            progress(f"batching: {BATCH_TENSORS:,} x {size_name(BATCH_TENSOR_BYTES)} "
                     f"vs one {size_name(ONE_TENSOR_BYTES)} tensor and the raw socket ...")
            batch = Batch.make()
            out["batching"] = {"same_host": await bench_batching(local, batch, sock, plan),
                               "tcp": await bench_batching(tcp, batch, sock, plan)}
            del batch
        sock.close()
        sock = None
        if "idle" in sections:
            progress(f"daemon idle CPU, both contexts connected ({plan.idle_seconds:g} s) ...")
            gc.collect()
            idle_after = await idle_cpu(daemon_pid, plan.idle_seconds)
            out["idle"] = {"before_clients": idle_before, "connected": idle_after}
        out["daemon_limits"] = local.hello["limits"]
        return out
    finally:
        if sock is not None:
            sock.close()
        for client in (echo, unix_echo):
            if client is not None:
                client.close()
        for ctx in (tcp, local):
            if ctx is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(ctx.close(), 10)


def measure(plan: Plan, tmp: Path,
            sections: tuple[str, ...] = SECTIONS) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start the daemon and the peer, measure, stop both (always, bounded)."""
    flags = ["--device", "cpu:1GiB"]
    daemon = procs.Daemon(tmp, *flags, tenant="bench")
    peer_log = tmp / "peer.log"
    peer: subprocess.Popen[bytes] | None = None
    raw: RawUcxx | None = None
    exits: dict[str, Any] = {}

    def cleanup() -> None:
        nonlocal raw
        if raw is not None:
            raw.close()
            raw = None
        exits["daemon_exit"] = daemon.stop()
        exits["peer_exit"] = procs.stop(peer)
        exits["daemon_log"] = procs.tail(daemon.log, 50)
        exits["peer_log"] = procs.tail(peer_log, 50)
        for name in ("daemon", "peer"):
            if exits[f"{name}_exit"] not in (0, None, -signal.SIGTERM):  # the tail is in the JSON
                progress(f"{name} exited {exits[f'{name}_exit']}; log tail:\n"
                         f"{exits[f'{name}_log']}")

    echo_unix = str(tmp / "echo.sock")
    with interruptible(cleanup):
        peer = procs.spawn([sys.executable, str(benchkit.SCRIPTS / "_bench_peer.py"),
                            "--ready-file", str(tmp / "peer.ready"), "--echo-unix", echo_unix,
                            "--max-bytes", str(max(plan.iters))], peer_log)
        daemon.start()
        echo_port, sock_port = procs.wait_ready(
            tmp / "peer.ready", peer, peer_log, "bench peer").split()
        if "data" in sections:
            raw = RawUcxx.start(tmp, max(plan.iters))
        progress(f"rpcbufd at {daemon.addr} (pid {daemon.pid}), reference peer "
                 f"echo={echo_port} socket={sock_port}, raw ucxx pair "
                 f"{'started' if raw is not None else 'not needed'}")
        results = uvloop.run(run_all(daemon.addr, daemon.token, daemon.pid, raw,
                                     int(echo_port), echo_unix, int(sock_port), plan, sections))
    return results, exits


def print_path_note(results: dict[str, Any]) -> None:
    if results.get("paths", {}).get("default") is False:
        print("note: the default context did not get the same-host path: its rows "
              "(\"same-host\") measure the UCX (tcp) path")


def render_stored(path: str) -> int:
    """``--render``: the table of a stored run, rebuilt from its numbers (an
    older file's missing numbers drop their rows or read "not measured")."""
    results = read_stored(path, "bench.py")
    if results is None:
        return 2
    print(render(build_rows(results), notes(results)))
    print_path_note(results)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", default="bench.json", help="write every number here [%(default)s]")
    p.add_argument("--quick", action="store_true",
                   help="fewer iterations: a smoke run, about half a minute")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help="comma-separated sections to measure [%(default)s]")
    p.add_argument("--render", metavar="JSON",
                   help="print the table of a stored run (its --json file) and exit; "
                        "measures nothing")
    args = p.parse_args(argv)
    if args.render:
        return render_stored(args.render)
    sections = tuple(s for s in SECTIONS if s in args.only.split(","))
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown or not sections:
        p.error(f"--only: unknown section(s) {', '.join(sorted(unknown)) or '(none)'}; "
                f"choose from {', '.join(SECTIONS)}")
    plan = QUICK if args.quick else FULL
    started = time.time()
    before = cpu_split()
    try:
        with tempfile.TemporaryDirectory(prefix="rpcbuf-bench-") as tmpdir:
            results, exits = measure(plan, Path(tmpdir), sections)
    except Interrupted as exc:
        progress(f"{exc}; daemon and peer stopped")
        return 128 + exc.signum
    after = cpu_split()
    wall = time.time() - started
    rows = build_rows(results)
    print(render(rows, notes(results)))
    print_path_note(results)
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
            "sections": list(sections),
            **machine_meta(),
            "other_processes_cpus": others,
            "ucxx": getattr(ucx.ucxx(), "__version__", None),
            "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX")},
            "plan": {**asdict(plan),
                     "iters": {size_name(k): v for k, v in plan.iters.items()},
                     "warmup": {size_name(k): v for k, v in plan.warmup.items()}},
        },
        **results,
        **exits,
        "rows": [asdict(r) for r in rows],
        "goals_met": all(r.met for r in rows if r.met is not None),
    }
    write_json(args.json, report)
    progress(f"wrote {args.json} ({report['meta']['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
