"""rpcbuf's block tier beside Mooncake Store and memcpy, block by block, one run.

Run as ``make bench-kv-store`` (``.venv/bin/python scripts/bench_kv_store.py
[--json bench_kv_store.json] [--quick] [--hold-n N] [--hold-s S]``).  Where
``bench_kv.py`` measures KV chunks through LMCache's connector interface,
this measures the stores themselves, at their own block API, with the same
rows for every side (``_bench_kv_store_rows.py``):

* ``rpcbuf same-host`` / ``rpcbuf ucx``: ``put_blocks``/``get_blocks`` of a
  real rpcbufd on loopback (``--device cpu:6GiB``, the tenant's quota the
  whole pool), the same-host path and UCX over tcp (``same_host=False``),
  this process its client on a uvloop loop;
* ``Mooncake tcp`` / ``Mooncake same-host``: Mooncake Store from the
  ``mooncake-transfer-engine-non-cuda`` wheel, in its own venv
  (``.peers/mooncake``, made on first use as ``make bench-peers`` makes it)
  and its own network namespace (``unshare -n``: some of its listeners bind
  0.0.0.0), a master, a ``mooncake_client`` holding the segment, and its
  tcp and same-host clients (``_bench_kv_store_mooncake.py``);
* ``memcpy``: numpy copies into and out of a warm pool in this process.

Rows: one block of 256 KiB, 2 MiB and 16 MiB put and got (p50), 256 blocks
of 256 KiB in one call each, a 4 KiB hit, and ``--hold-n`` blocks of
16 KiB (250,000 by default) put in batches of 512 and read back, bounded
by ``--hold-s`` seconds each way, with the server's open fds.  Every get
is checked byte for byte by the rows; rpcbuf also verifies each put's
xxh3-64 on the daemon; Mooncake checks nothing of the content.  Mooncake
runs first and is stopped before rpcbufd starts, so the two never share the
machine's memory.  Prints three tables (timings, blocks held, ratios and
issue 40's goals) and writes every number to the JSON file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchkit
from benchkit.procs import Daemon
from benchkit.report import machine_meta, progress_printer, write_json

benchkit.loopback_ucx_env()

import numpy as np  # noqa: E402
import uvloop  # noqa: E402

import _bench_kv_store_rows as rows  # noqa: E402
import _bench_kv_store_table as table  # noqa: E402
import _bench_peers_setup as setup  # noqa: E402

progress = progress_printer("bench_kv_store")
POOL = "6GiB"
RPCBUF_CHECKS = ("each put's xxh3-64, on the daemon, before it commits; "
                 "each get's bytes here")


class Rpcbuf:
    """rpcbuf's block tier as a ``rows.Side``: one context on a uvloop loop."""

    def __init__(self, name: str, ctx: Any, loop: asyncio.AbstractEventLoop,
                 daemon_pid: int) -> None:
        self.name, self.ctx, self.loop, self.pid = name, ctx, loop, daemon_pid
        self.checks = RPCBUF_CHECKS

    def regions(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8)

    def put(self, keys: list[str], blocks: list[np.ndarray]) -> None:
        self.loop.run_until_complete(self.ctx.put_blocks(list(zip(keys, blocks, strict=True))))

    def get(self, keys: list[str], out: list[np.ndarray]) -> list[bool]:
        return list(self.loop.run_until_complete(self.ctx.get_blocks(keys, out)))

    def remove(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 4096):
            self.loop.run_until_complete(self.ctx.remove_blocks(keys[i:i + 4096]))

    def server_fds(self) -> int | None:
        with contextlib.suppress(OSError):
            return len(os.listdir(f"/proc/{self.pid}/fd"))
        return None


def run_rpcbuf(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], list[str]]:
    import rpcbuf

    out: dict[str, Any] = {}
    notes: list[str] = []
    (tmp / "rpcbufd").mkdir()
    daemon = Daemon(tmp / "rpcbufd", "--device", f"cpu:{POOL}",
                    "--quota", f"bench:{POOL}:{max(args.hold_n, 1) + 4096}")
    daemon.start()
    loop = uvloop.new_event_loop()
    try:
        for name, same in (("rpcbuf same-host", True), ("rpcbuf ucx", False)):
            if name not in args.sides:
                continue
            try:
                ctx = loop.run_until_complete(
                    rpcbuf.connect(daemon.addr, daemon.token, timeout=120.0, same_host=same))
            except Exception as exc:
                out[name] = {"error": f"connect: {type(exc).__name__}: {exc}"[:300]}
                continue
            try:
                out[name] = rows.run_side(Rpcbuf(name, ctx, loop, daemon.pid), name.split()[1],
                                          args.hold_n, args.hold_s, progress)
            finally:
                loop.run_until_complete(ctx.close())
        log = daemon.log.read_text(errors="replace") if daemon.log.exists() else ""
        emfile = log.count("Too many open files")
        if emfile:
            notes.append(f"rpcbufd logged 'Too many open files' {emfile:,} times")
    finally:
        loop.close()
        daemon.stop()
    return out, notes


def unshare_cmd() -> list[str] | None:
    """``unshare -n`` as root, ``unshare -rn`` (a user namespace) otherwise; None
    if neither works here."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    for cmd in ([exe, "-n"], [exe, "-rn"]) if os.geteuid() == 0 else ([exe, "-rn"],):
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            if subprocess.run([*cmd, "true"], timeout=30, capture_output=True).returncode == 0:
                return cmd
    return None


def run_mooncake(args: argparse.Namespace, tmp: Path) -> tuple[dict[str, Any], dict[str, str],
                                                                dict[str, Any]]:
    """(sides, missing {side: why}, extra facts) from the Mooncake child."""
    names = [n for n in ("Mooncake tcp", "Mooncake same-host") if n in args.sides]
    if not names:
        return {}, {}, {}
    env = setup.ensure(setup.PACKAGES[0], progress=progress)
    if env.python is None:
        return {}, dict.fromkeys(names, env.reason), {}
    ns = unshare_cmd()
    if ns is None:
        return {}, dict.fromkeys(names, "no network namespace here (unshare -n / -rn failed): "
                                 "Mooncake binds 0.0.0.0, so it is not run outside one"), {}
    logs = tmp / "mooncake"
    logs.mkdir()
    result = logs / "result.json"
    seg_gb = max(2, -(-(args.hold_n * rows.HOLD_BLOCK * 3 // 2 + 2 * rows.REGION) // (1 << 30)))
    limit = 2 * (150 + 2 * args.hold_s)
    cmd = [*ns, str(env.python), str(benchkit.SCRIPTS / "_bench_kv_store_mooncake.py"),
           "--bin", str(env.python.parent), "--out", str(result), "--logs", str(logs),
           "--hold-n", str(args.hold_n), "--hold-s", str(args.hold_s),
           "--segment-gb", str(seg_gb),
           "--sides", ",".join("tcp" if n.endswith("tcp") else "same-host" for n in names)]
    progress(f"Mooncake Store {env.version} in a network namespace ({' '.join(ns)}), "
             f"segment {seg_gb} GB ...")
    child_env = {**os.environ, "PYTHONPATH": str(benchkit.SCRIPTS)}
    with open(logs / "child.log", "wb") as log:
        try:
            rc = subprocess.run(cmd, env=child_env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, timeout=limit).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if not result.exists():
        tail = [ln for ln in (logs / "child.log").read_text(errors="replace").splitlines()
                if ln.startswith(("E", "Traceback", "RuntimeError"))][-3:]
        why = f"the Mooncake run ended ({'timed out' if rc == -1 else f'exit {rc}'}) " \
              f"without a result: {' | '.join(tail)}"
        return {}, dict.fromkeys(names, why), {}
    got = json.loads(result.read_text())
    facts = {"version": env.version, "segment_gb": got.get("segment_gb"),
             "holder_rss_mib_at_start": got.get("holder_rss_mib_at_start"),
             "notes": got.get("notes", [])}
    missing = {n: "no result (see notes)" for n in names if n not in got["sides"]}
    return got["sides"], missing, facts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="bench_kv_store.json", help="write every number here")
    p.add_argument("--quick", action="store_true",
                   help="hold 20,000 blocks for at most 30 s (the other rows as always)")
    p.add_argument("--hold-n", type=int, default=250_000, help="16 KiB blocks to hold")
    p.add_argument("--hold-s", type=float, default=120.0,
                   help="seconds each side may spend putting them (and again reading them)")
    p.add_argument("--sides", default=",".join(table.ORDER),
                   help="comma-separated, of: " + ", ".join(table.ORDER))
    args = p.parse_args()
    if args.quick:
        args.hold_n, args.hold_s = min(args.hold_n, 20_000), min(args.hold_s, 30.0)
    args.sides = [s.strip() for s in args.sides.split(",")]
    report: dict[str, Any] = {"sides": {}, "missing": {}, "notes": []}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rpcbuf-bench-kv-store-") as tmpdir:
        tmp = Path(tmpdir)
        sides, missing, facts = run_mooncake(args, tmp)
        report["sides"].update(sides)
        report["missing"].update(missing)
        report["notes"] += [str(n) for n in facts.pop("notes", [])]
        report["mooncake"] = facts
        ours, notes = run_rpcbuf(args, tmp)
        report["sides"].update(ours)
        report["notes"] += notes
    if "memcpy" in args.sides:
        progress("memcpy ...")
        report["sides"]["memcpy"] = rows.run_side(rows.Memcpy(), "memcpy", 0, 0, progress)
    report["meta"] = {**machine_meta(), "hold_n": args.hold_n, "hold_s": args.hold_s,
                      "pool": POOL, "iters": {rows.size_name(k): v for k, v in rows.ITERS.items()},
                      "batch": rows.BATCH, "batch_iters": rows.BATCH_ITERS,
                      "hit_iters": rows.HIT_ITERS, "seconds": round(time.monotonic() - t0, 1)}
    write_json(args.json, report)
    print(table.render(report))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
