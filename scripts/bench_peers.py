"""rpcbuf against its peers (Mooncake's transfer engine, NIXL) and the raw references, one run.

Run as ``make bench-peers`` (or ``.venv/bin/python scripts/bench_peers.py
[--json bench_peers.json] [--quick] [--no-install] [--reinstall]``;
``--render bench_peers.json`` prints a stored run's tables again and
measures nothing).  It prints a table of rpcbuf / peer ratios, then a short
one of the goals (below), and writes every sample and summary, and the goal
rows ("goals"), as JSON.  Never part of ``make test``.

The peers (``_bench_peers_setup``): ``mooncake-transfer-engine-non-cuda``
and ``nixl`` from PyPI, each in its own virtualenv under ``.peers/``
(ignored by git), installed on first use; the peers run under those venvs'
python, in processes of their own, two per configuration (a target that
registers a buffer and an initiator that writes into it:
``_bench_peers_mooncake.py``, ``_bench_peers_nixl.py``, the frame in
``_bench_peers_child.py``), each used through its documented Python API the
way its own examples use it (the modules' docstrings say exactly how).  The
configurations (``_bench_peers_run``): Mooncake TE over tcp, NIXL over UCX
tcp (UCX defaults), NIXL over UCX tcp with 2 MiB segments, NIXL over UCX
shared memory.

rpcbuf's side (``_bench_peers_ours``), first, with the peers' processes not
yet started: a real ``rpcbufd`` (``--device cpu:1GiB``) and this process as
the client under uvloop, one context on the UCX path over loopback tcp
(``same_host=False``) and one default context (the same-host path),
beside the raw ucxx reference in
two processes of its own (``_bench_rawucx.py``: ucxx's blocking progress,
auto rendezvous, 2 MiB tcp segments, tcp PUT off) and ``np.copyto``.

Measured on every side: a 4 KiB write and its acknowledgement (p50), 1 MiB
and 64 MiB writes (GB/s at the median), and 10,000 x 4 KiB in one batch
(rpcbuf: ``store_tensors`` of 10,000 separate arrays; Mooncake:
``batch_transfer_sync_write`` of 10,000 slices; NIXL: one WRITE handle of
10,000 descriptors).  Each side runs the same counts (``PeerPlan``).
rpcbuf's sides alternate with the raw references in rounds; the peers run
one configuration after another afterwards (their processes cannot be
interleaved with ours), so compare ratios within one run, never absolute
times across runs.  A peer that fails to install or run is a table line
with the reason; the exit status is non-zero only when rpcbuf's own side
fails.  Every child process is bounded in time and stopped however the run
ends.

Goals (issue 15, performance round 2; ``_bench_peers_table.GOALS``), each a
row with rpcbuf's value, the reference's, the ratio, the goal and whether it
is met, or "not measured" and why (a peer that failed or is missing):

* 4 KiB write+ack p50 over tcp: <= Mooncake TE's, and <= 1.5 x raw ucxx;
  same-host: <= 0.5 x rpcbuf over tcp;
* 64 MiB write over tcp: >= 0.9 x raw ucxx, >= 2 x Mooncake TE, >= 2 x NIXL
  tcp (both NIXL tcp configurations); same-host: >= 1.0 x ``np.copyto``;
* 10,000 x 4 KiB ``store_tensors`` over tcp: <= 0.33 x NIXL tcp's batch
  time (both configurations); same-host: <= NIXL shm's.

``bench.py`` has the goals it can measure without a peer, ``bench_load.py``
the ``load_model`` ones.
"""

from __future__ import annotations

import benchkit

benchkit.loopback_ucx_env()

from rpcbuf.dataplane import ucx  # noqa: E402

ucx.apply_defaults()  # rpcbuf's UCX defaults, for us and the daemon (the peers get their own)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import uvloop  # noqa: E402

import rpcbuf  # noqa: E402
from _bench_peers_child import REGION, PeerPlan  # noqa: E402
from _bench_peers_ours import measure, nbytes_of  # noqa: E402
from _bench_peers_run import CONFIGS, run_config  # noqa: E402
from _bench_peers_setup import PACKAGES, PeerEnv, ensure  # noqa: E402
from _bench_peers_table import goals_json, render  # noqa: E402
from _bench_refs import RawUcxx  # noqa: E402
from benchkit import procs  # noqa: E402
from benchkit.interrupt import Interrupted, interruptible, note_signals  # noqa: E402
from benchkit.report import machine_meta, progress_printer, read_stored, write_json  # noqa: E402
from benchkit.timing import summarize  # noqa: E402

progress = progress_printer("bench_peers")
FULL = PeerPlan()
QUICK = PeerPlan(small=300, small_warm=50, mid=40, mid_warm=5, big=5, big_warm=2,
                 batch=3, batch_warm=1)
CAP_SYS_PTRACE = 19


async def ours(daemon: procs.Daemon, raw: RawUcxx | None,
               plan: PeerPlan) -> tuple[dict[str, Any], dict[str, Any]]:
    note_signals(asyncio.get_running_loop())
    tcp = await rpcbuf.connect(daemon.addr, token=daemon.token, same_host=False)
    local = await rpcbuf.connect(daemon.addr, token=daemon.token)
    try:
        paths = {"tcp": "same-host" if tcp.same_host else "UCX (tcp)",
                 "default": "same-host" if local.same_host else "UCX (tcp)"}
        progress(f"contexts: same_host=False got {paths['tcp']}, the default got "
                 f"{paths['default']}")
        samples = await measure({"rpcbuf_tcp": tcp, "rpcbuf_same_host": local}, raw, plan)
        return paths, samples
    finally:
        for ctx in (tcp, local):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ctx.close(), 10)


def measure_ours(tmp: Path, plan: PeerPlan) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """rpcbuf and the raw references: (paths, samples, notes)."""
    notes: list[str] = []
    flags = ["--device", "cpu:1GiB"]
    daemon = procs.Daemon(tmp, *flags, tenant="bench")
    raw: RawUcxx | None = None

    def cleanup() -> None:
        if raw is not None:
            raw.close()
        daemon.stop()

    with interruptible(cleanup):
        daemon.start()
        try:
            raw = RawUcxx.start(tmp, REGION)
        except RuntimeError as exc:
            notes.append(f"note: the raw ucxx reference did not start: {exc}")
            progress(notes[-1])
        progress(f"rpcbufd at {daemon.addr} (pid {daemon.pid}); rpcbuf and the raw "
                 "references ...")
        try:
            paths, samples = uvloop.run(ours(daemon, raw, plan))
        finally:
            cleanup()
            raw = None
    return paths, samples, notes


def measure_peers(tmp: Path, plan: PeerPlan, envs: dict[str, PeerEnv]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for cfg in CONFIGS:
        env = envs[cfg.peer]
        if env.python is None:
            out[cfg.key] = {"ok": False, "label": cfg.label, "reason": env.reason}
            continue
        progress(f"{cfg.label} ({env.name} {env.version}) ...")
        with interruptible(procs.stop_all):
            result = run_config(cfg, env.python, tmp, plan)
        result["label"] = cfg.label
        result["version"] = env.version
        if not result["ok"]:
            progress(f"{cfg.label}: failed: {result['reason']}")
        out[cfg.key] = result
    return out


def summaries(samples: dict[str, Any], peers: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {side: {k: summarize(v, nbytes_of(k)) for k, v in rows.items()}
                           for side, rows in samples.items()}
    for key, result in peers.items():
        if result["ok"]:
            out[key] = {k: summarize(result[k], nbytes_of(k))
                        for k in ("write_4k", "write_1m", "write_64m", "batch_10000x4k")}
    return out


def render_stored(path: str) -> int:
    """``--render``: the tables of a stored run, rebuilt from its numbers."""
    report = read_stored(path, "bench_peers.py")
    if report is None:
        return 2
    print(render(report))
    for note in report.get("notes") or []:
        print(note)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", default="bench_peers.json", help="write every number here "
                   "[%(default)s]")
    p.add_argument("--quick", action="store_true", help="fewer operations: a smoke run")
    p.add_argument("--no-install", action="store_true",
                   help="use the peers' venvs as they are; a missing one is reported")
    p.add_argument("--reinstall", action="store_true", help="make the peers' venvs afresh")
    p.add_argument("--render", metavar="JSON",
                   help="print the tables of a stored run (its --json file) and exit; "
                        "measures and installs nothing")
    args = p.parse_args(argv)
    if args.render:
        return render_stored(args.render)
    plan = QUICK if args.quick else FULL
    started = time.time()
    envs = {pkg.name: ensure(pkg, install=not args.no_install, reinstall=args.reinstall,
                             progress=progress) for pkg in PACKAGES}
    for env in envs.values():
        progress(f"{env.name}: {env.version or 'unusable: ' + env.reason}")
    try:
        with tempfile.TemporaryDirectory(prefix="rpcbuf-bench-peers-") as tmpdir:
            paths, samples, notes = measure_ours(Path(tmpdir), plan)
            peers = measure_peers(Path(tmpdir), plan, envs)
    except Interrupted as exc:
        progress(f"{exc}; every child stopped")
        return 128 + exc.signum
    report: dict[str, Any] = {
        "meta": {"started_at": started, "seconds": time.time() - started, "quick": args.quick,
                 **machine_meta(), "plan": asdict(plan), "paths": paths,
                 "peer_versions": {k: e.version for k, e in envs.items()},
                 "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX")}},
        "summaries": summaries(samples, peers),
        "samples": samples,
        "peers": {k: {kk: vv for kk, vv in v.items()} for k, v in peers.items()},
        "notes": notes,
    }
    report["goals"] = goals_json(report)
    print(render(report))
    for note in notes:
        print(note)
    if paths["default"] != "same-host":
        print("note: the default context did not get the same-host path: its rows "
              "(\"same-host\") measure the UCX (tcp) path")
    write_json(args.json, report)
    progress(f"wrote {args.json} ({report['meta']['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
