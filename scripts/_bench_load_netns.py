"""bench_load.py's three-node row, in a process of its own (its UCX uses the veths).

``python scripts/_bench_load_netns.py MODEL TMPDIR OUT.json REPS`` (as root):
three network namespaces joined to this one by veth pairs (the harness of
``tests/netns.py``: ``plan``, ``setup``, ``teardown``), one rpcbufd in each
(UCX over tcp on its veth, a 2 GiB arena), this process the client over the
three root ends.  Per repetition: each node's single ``store_tensor`` of a
third of the model's bytes, alone (warm buffers: each stored once before
timing), then ``load_model`` across the three with an empty client hash
cache (placement by free memory: about a third per node), then unloaded.
Writes ``{"bytes", "single": [[s1, s2, s3], ...] (seconds), "sum_single"
(bytes/s), "load" (seconds), "per_node"}`` to OUT.json.  Teardown always
stops the daemons and deletes the namespaces.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import benchkit  # src/ on sys.path

sys.path.insert(0, str(benchkit.ROOT / "tests"))
import netns  # the tests' harness: namespaces, veths, teardown

ARENA = "cpu:2GiB"


def spawn(host: netns.Host, secret: Path) -> None:
    ready, logf = host.tmp / "ready", host.tmp / "daemon.log"
    ready.unlink(missing_ok=True)
    env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": host.veth_ns,
           "UCX_WARN_UNUSED_ENV_VARS": "n", "PYTHONPATH": str(benchkit.SRC)}
    cmd = ["ip", "netns", "exec", host.ns, sys.executable, "-m", "rpcbuf.control.daemon",
           "--listen", host.addr, "--ucx-port", "0", "--device", ARENA,
           "--secret-file", str(secret), "--ready-file", str(ready),
           "--node-id", f"host{host.index}", "--log-level", "WARNING"]
    with open(logf, "wb") as log:
        host.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    host.log_file = logf


async def measure(c: netns.NetnsCluster, model: Path, tmp: Path, reps: int) -> dict[str, Any]:
    import numpy as np

    import rpcbuf
    from bench_load import model_bytes

    data = model_bytes(model)
    parts = np.array_split(data, 3)
    out: dict[str, Any] = {"bytes": int(data.nbytes), "single": [], "load": [], "per_node": []}
    # Plain TCP to the namespaces' addresses: private veths (insecure=True).
    async with rpcbuf.Cluster.connect(c.endpoints, c.token, timeout=120,
                                      insecure=True) as cluster:
        ctxs = [cluster[h.addr] for h in c.hosts]
        bids = [await ctx.request_buffer(int(p.nbytes)) for ctx, p in zip(ctxs, parts,
                                                                           strict=True)]
        for ctx, bid, part in zip(ctxs, bids, parts, strict=True):
            await ctx.store_tensor(bid, part)  # warm
        os.environ["RPCBUF_CACHE_DIR"] = str(tmp / "hashes-warm")
        await rpcbuf.load_model(cluster, model, name="m", progress=False)
        await rpcbuf.unload_model(cluster, "m")
        for r in range(reps):
            single = []
            for ctx, bid, part in zip(ctxs, bids, parts, strict=True):
                t = time.perf_counter()
                await ctx.store_tensor(bid, part)
                single.append(time.perf_counter() - t)
            out["single"].append(single)
            os.environ["RPCBUF_CACHE_DIR"] = str(tmp / f"hashes-{r}")
            t = time.perf_counter()
            res = await rpcbuf.load_model(cluster, model, name="m", progress=False)
            out["load"].append(time.perf_counter() - t)
            out["per_node"].append({a: n.to_json() for a, n in res.nodes.items()})
            await rpcbuf.unload_model(cluster, "m")
            print(f"[bench_load] netns: repetition {r + 1}/{reps}: single stores "
                  f"{', '.join(f'{s:.3f}' for s in single)} s, load {out['load'][-1]:.3f} s",
                  file=sys.stderr, flush=True)
        for ctx, bid in zip(ctxs, bids, strict=True):
            await ctx.release_buffer(bid)
    sizes = [int(p.nbytes) for p in parts]
    out["sum_single"] = [sum(n / s for n, s in zip(sizes, single, strict=True))
                         for single in out["single"]]
    return out


def main(model: str, tmpdir: str, out: str, reps: str) -> int:
    reason = netns.unavailable()
    if reason:
        Path(out).write_text(json.dumps({"skipped": reason}))
        return 0
    netns.remove_leftovers()
    tmp = Path(tmpdir)
    tmp.mkdir(parents=True, exist_ok=True)
    cluster = netns.plan(tmp)
    # This process is the client: its UCX must use the three root ends.
    os.environ.update({"UCX_TLS": "tcp", "UCX_WARN_UNUSED_ENV_VARS": "n",
                       "UCX_NET_DEVICES": ",".join(h.veth_root for h in cluster.hosts)})
    try:
        netns.setup(cluster)
        for h in cluster.hosts:
            spawn(h, cluster.secret)
        for h in cluster.hosts:
            h.wait_ready(60)
        import uvloop

        result = uvloop.run(measure(cluster, Path(model), tmp, int(reps)))
    finally:
        netns.teardown(cluster)
    Path(out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:5]))
