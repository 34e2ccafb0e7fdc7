"""Node-local load against upload: the same model, one node, the same run.

Run as ``.venv/bin/python scripts/bench_nodeload.py [--json bench_nodeload.json] [--quick]``.

A llama-like float16 safetensors model (``--size`` MiB, 1000 by default, so
that one slot's buffer is one 1 GiB buddy block) is written into a
temporary ``--model-dir`` and hashed there (``rpcbuf hash``, timed); one
rpcbufd on loopback (``--prefault``, waited for) serves it.  Each round
times ``rpcbuf.load_model`` on a fresh name (released after) for:

1. *upload, UCX*: the driver reads, hashes (client hash cache off) and sends
   every byte over UCX (tcp on loopback: ``RPCBUF_SAME_HOST=0``);
2. *upload, same host*: the same over the same-host path (the daemon copies
   from the client's memory);
3. *node-local*: ``source="node"``: the daemon reads its own copy, hashing
   as it lands, the driver reads only the hash manifest;
4. *node-local, again*: the same name once more (in place: nothing read).

The rounds alternate the order of 1-3 (so neither side always finds the page
cache or the arena warmer).  Reported: median seconds, GB/s of model bytes,
bytes sent, and each row's time as a share of *upload, UCX* in the same
round.  Output: an aligned table on stdout, every number as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchkit

benchkit.loopback_ucx_env()  # before anything imports ucxx

import rpcbuf  # noqa: E402
from bench_dedup import write_model  # noqa: E402
from benchkit import SRC, MiB  # noqa: E402
from benchkit.procs import Daemon  # noqa: E402
from benchkit.report import format_table, machine_meta, progress_printer, write_json  # noqa: E402

progress = progress_printer("bench_nodeload")
ROWS = ("upload, UCX", "upload, same host", "node-local", "node-local, again")


async def timed(node: Daemon, model: Path, name: str, how: str) -> dict[str, Any]:
    same_host = how == "upload, same host"
    os.environ["RPCBUF_SAME_HOST"] = "1" if same_host else "0"
    async with rpcbuf.Cluster.connect(node.addr, node.token, timeout=120) as cluster:
        t = time.perf_counter()
        if how.startswith("node-local"):
            res = await rpcbuf.load_model(cluster, model, name=name, progress=False,
                                          source="node", node_path=model.name)
        else:
            res = await rpcbuf.load_model(cluster, model, name=name, progress=False,
                                          hash_cache=False)
        seconds = time.perf_counter() - t
        if how != "node-local":
            await rpcbuf.unload_model(cluster, name)
    return {"seconds": seconds, "bytes_sent": res.bytes_sent, "bytes_total": res.bytes_total}


async def one_round(node: Daemon, model: Path, k: int) -> dict[str, dict[str, Any]]:
    order = list(ROWS[:3]) if k % 2 == 0 else list(reversed(ROWS[:3]))
    out: dict[str, dict[str, Any]] = {}
    for how in order:
        out[how] = await timed(node, model, f"m{k}-{ROWS.index(how)}", how)
        if how == "node-local":
            out[ROWS[3]] = await timed(node, model, f"m{k}-{ROWS.index(how)}", ROWS[3])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", default="bench_nodeload.json", help="write every number here")
    p.add_argument("--size", type=int, default=1000, help="model size in MiB [%(default)s]")
    p.add_argument("--layers", type=int, default=32, help="[%(default)s]")
    p.add_argument("--rounds", type=int, default=2, help="[%(default)s]")
    p.add_argument("--quick", action="store_true", help="one round of a 64 MiB model")
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.rounds, args.layers = 64, 1, 4
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_nodeload-") as tmpdir:
        tmp = Path(tmpdir)
        models = tmp / "models"
        models.mkdir()
        model = models / "model.safetensors"
        nbytes = write_model(model, args.size * MiB, args.layers)
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "rpcbuf.cli", "hash", str(model),
                        "--no-hash-cache"], check=True, capture_output=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(SRC)})
        hash_seconds = time.perf_counter() - t
        os.environ["RPCBUF_CACHE_DIR"] = str(tmp / "hashes")
        arena = 1 << max(24, (2 * nbytes - 1).bit_length())
        # As root the daemon refuses the same-host path unless told (tests only):
        # the same-host row measures that path all the same.
        unsafe = ["--unsafe-privileged-same-host"] if os.geteuid() == 0 else []
        node = Daemon(tmp / "d", "--device", f"cpu:{arena}", "--prefault", "--model-dir",
                      str(models), *unsafe, tenant="bench", ready_timeout=30.0,
                      log_level=os.environ.get("BENCH_LOG", "WARNING"))
        node.start()
        try:
            time.sleep(min(10.0, arena / (1 << 30)))  # --prefault runs in the background
            rounds = []
            for k in range(args.rounds):
                t = time.perf_counter()
                rounds.append(asyncio.run(one_round(node, model, k)))
                progress(f"round {k + 1}/{args.rounds}: {time.perf_counter() - t:.1f} s")
        finally:
            node.stop()
    rows: dict[str, dict[str, Any]] = {}
    for name in ROWS:
        secs = [r[name]["seconds"] for r in rounds]
        rows[name] = {"seconds": statistics.median(secs),
                      "gbps": nbytes / statistics.median(secs) / 1e9,
                      "bytes_sent": statistics.median(r[name]["bytes_sent"] for r in rounds),
                      "of_upload": statistics.median(r[name]["seconds"]
                                                     / r["upload, UCX"]["seconds"]
                                                     for r in rounds),
                      "rounds": [r[name] for r in rounds]}
    print(f"model {nbytes / MiB:.0f} MiB ({args.layers} layers, float16, safetensors), one "
          f"node on loopback, rpcbufd --prefault, medians of {args.rounds} round(s); "
          f"rpcbuf hash of it: {hash_seconds:.2f} s")
    print(format_table(["how", "seconds", "GB/s", "sent", "of upload, UCX"],
                       [[n, f"{r['seconds']:.3f}", f"{r['gbps']:.2f}",
                         f"{r['bytes_sent'] / MiB:,.1f} MiB", f"{100 * r['of_upload']:.0f} %"]
                        for n, r in rows.items()]))
    write_json(args.json, {"meta": {"started_at": started, "seconds": time.time() - started,
                                    "model_bytes": nbytes, "layers": args.layers,
                                    "rounds": args.rounds, "hash_seconds": hash_seconds,
                                    **machine_meta()},
                           "rows": rows})
    progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
