"""UCX knobs for rpcbuf's data plane, measured: ucxx progress modes, the
rendezvous scheme, tcp segment and socket buffer sizes, UCX shared memory
against process_vm_readv, send_multi, and the ucxx core API.

Run as ``.venv/bin/python scripts/bench_ucx.py [--json bench_ucx.json] [--quick]``
(``make bench-ucx``).  About 2-3.5 minutes on 2 cores (``--quick``: about
1); ``--only KEY,KEY`` and ``--rounds N`` narrow it.  It holds every
configuration's process pair at once: about 0.45 GB each, 5-6 GB in all.

The pieces: ``_bench_ucx_config`` (configurations, plans, the pair's phase
protocol), ``_bench_ucx_child`` (both ends of a pair), ``_bench_ucx_pairs``
(starting, pausing and asking the pairs; the rounds), ``_bench_ucx_report``
(summaries, tables, UCX_PROTO_INFO); ``benchkit`` for processes, signals,
timing and the JSON.  This file is also each child's entry point
(``--role``).

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
``rpcbuf.dataplane.ucx.UCX_DEFAULTS``: ``UCXPY_PROGRESS_MODE=blocking``,
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
* ``rpcbuf``: the reference: rpcbuf env, ``rpcbuf.dataplane.ucx.ucxx()`` (so
  ``AdaptiveProgress`` replaces ucxx's blocking mode) and every transfer in
  ``progress.busy()``, as rpcbufd does;
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
  with ``process_vm_readv``/``writev`` (a small helper in the child; what
  rpcbuf's same-host path did before it shared memory by handle; the client
  sends its array's address; timed by the client including one TCP round
  trip) and ``np.copyto`` in the client
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
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np

import benchkit  # noqa: F401  (puts this checkout's src/ on sys.path)
from _bench_ucx_child import child
from _bench_ucx_config import BIG, CONFIGS, FULL, QUICK, REF, child_env
from _bench_ucx_pairs import measure, progress
from _bench_ucx_report import Agg, report, summarize
from benchkit.interrupt import Interrupted, interruptible
from benchkit.procs import stop_all
from benchkit.report import machine_meta, write_json


def parent(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    if args.rounds:
        plan = replace(plan, rounds=args.rounds)
    plan = replace(plan, generations=max(1, min(plan.generations, plan.rounds)))
    configs = [c for c in CONFIGS if not args.only or c.key in args.only.split(",")]
    started = time.time()
    aggs = {c.key: Agg(c) for c in configs}
    dead: dict[str, Any] = {}
    others: list[float] = []
    try:
        with interruptible(stop_all), \
                tempfile.TemporaryDirectory(prefix="rpcbuf-bench-ucx-") as tmpdir:
            measure(configs, plan, Path(tmpdir), aggs, dead, others)
    except Interrupted as exc:
        progress(f"{exc}; children stopped")
        return 128 + exc.signum
    summary = {key: summarize(agg, aggs.get(REF)) for key, agg in aggs.items()}
    print(report(summary, dead))
    mean_others = float(np.mean(others)) if others else 0.0
    print(f"\nother processes kept {mean_others:.1f} of {os.cpu_count()} CPUs busy on "
          "average while measuring (per round: "
          + ", ".join(f"{o:.1f}" for o in others) + ")")
    if args.json:
        doc = {
            "meta": {"started_at": started, "seconds": time.time() - started,
                     "plan": asdict(plan), **machine_meta(),
                     "others_cpus_per_round": others,
                     "env": {c.key: {k: v for k, v in sorted(child_env(c).items())
                                     if k.startswith(("UCX", "RPCBUF"))} for c in configs}},
            "summary": summary,
            "dead_peer": dead,
            "samples_s": {key: agg.by_round for key, agg in aggs.items()},
        }
        write_json(args.json, doc, default=str)
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
