"""Model-load benchmark: ``load_model`` against one plain store of the same bytes.

Run as ``.venv/bin/python scripts/bench_load.py [--json bench_load.json] [--quick]
[--only one,cold,netns] [--paths ucx,same-host] [--reps 5]`` (``make bench`` runs
it whole).

A llama-like float16 safetensors model (``--size``, 1 GiB by default, 256
tensors: ``bench_dedup.write_model`` with 28 layers) is written to a
temporary directory, and its tensor bytes are read back into one contiguous,
touched array: "the same bytes" the stores send.  Clients take the UCX path
(``RPCBUF_SAME_HOST=0``: what a client on another host gets), over loopback
tcp, in this process under uvloop; section *one* runs again over the
same-host path (``RPCBUF_SAME_HOST=1``, rows marked "same host").  Each
comparison runs back to back in one run, ``--reps`` times, and the table
shows medians; ratios are of the same repetition.

The daemon's state is the same for both sides of a comparison (``Quiet``):
before each timed operation the daemon's background zeroer is idle (a
released 1 GiB block is zeroed in the background, and that competed with
whichever row came next), the garbage collector has run and ``SETTLE_S``
passed; the warm store, the checksum store and the first load run in
alternating order (even repetitions in that order, odd ones reversed); and
every timed first load lands on a block an earlier first load released
(the warm-up ends with one more such load: the block the warm-up's clone
shared was never kept, and the first repetition paid ~0.12 s of fresh
pages on it).  The JSON records, per repetition, the order, whether the
first load got a kept block (``first_kept``) and how long the zeroer kept
it waiting (``zeroer_wait``).

* **one** (a daemon with a 4 GiB arena, kept for all repetitions, warmed
  up first: one store and one load of each kind before timing): per
  repetition, one ``store_tensor`` of the whole array into a warm buffer
  (``verify=None``: the reference; ``verify="checksum"`` too, shown), then
  ``load_model`` with an empty client hash cache (*first load*: the slot
  buffer requested, on the block the previous repetition's load released,
  which the daemon kept backed and zeroed, ``--keep-freed``, so it backs no
  fresh memory; *cold* below measures fresh memory; every byte read,
  hashed, sent, verified), the same model again under the same name
  (*re-load, same name*), again under a new name while the first copy is
  held (*re-load, new name*: a ``clone_buffer`` of the first copy, since the
  hash cache knows every tensor), the same without the client's hash cache
  (*re-load, new name, no hash cache*), and, as a breakdown, the new-name
  re-load and the first load into a slot buffer requested just before
  (which the load reuses: the load's time without backing fresh memory,
  the request timed apart).  Goals: first load >= 0.8 x the warm store
  and (issue 15) >= 2.1 GB/s absolute, ten times llama.cpp ``rpc-server``'s
  0.21 GB/s (the issue's figure; the issue names the 1 GiB model, so a
  ``--quick`` run's 256 MiB says less); re-loads <= 10 % of the first load's
  time and <= 1 % of its bytes.
* **cold** (a fresh daemon per measurement, no ``--prefault``): the
  ``request_buffer`` of never-touched memory (which backs a new buffer's
  pages before it answers, ``control/daemon/accounting/prefault.py``) and the first
  ``store_tensor`` into it, against a second store into the same, now warm,
  buffer of the same daemon (goal: the first store not below 1/6 of warm);
  ``load_model`` into a fresh daemon against the warm store of *one*; and a
  daemon started with ``--prefault``: its ``request_buffer`` (which backs
  the new buffer, whatever its size) and the first store into it.  A fresh
  daemon often gets memory
  another process just freed, which faults in faster than memory nobody
  touched for a while: the first repetition is usually the coldest (the
  JSON keeps each).
* **netns** (root only: three daemons in network namespaces, the client in
  a child process, ``scripts/_bench_load_netns.py``, whose UCX uses the
  veths): each node's single store of its share of the bytes, alone, then
  ``load_model`` across the three (placement by free memory: a third each);
  goal: aggregate >= 0.8 x the sum of the three nodes' single-store speeds.
  Skipped with a message when not root or when namespaces are unavailable.

Output: an aligned table (value, reference, ratio, goal, met; built by
``_bench_load_rows``) on stdout and every sample as JSON.  Missing a goal
does not change the exit status.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import benchkit

benchkit.loopback_ucx_env()  # before anything imports ucxx
os.environ.setdefault("RPCBUF_SAME_HOST", "0")  # the UCX path, as a remote client

import numpy as np  # noqa: E402
import uvloop  # noqa: E402

import rpcbuf  # noqa: E402
from _bench_load_rows import build_rows, render  # noqa: E402
from bench_dedup import write_model  # noqa: E402
from benchkit import GiB, MiB  # noqa: E402
from benchkit.procs import Daemon  # noqa: E402
from benchkit.report import machine_meta, progress_printer, write_json  # noqa: E402

progress = progress_printer("bench_load")
SECTIONS = ("one", "cold", "netns")
LAYERS = 28  # 28 x 9 + 4 = 256 tensors
PATHS = ("ucx", "same-host")
ONE_KEYS = {"ucx": "one", "same-host": "one_same_host"}  # the results' key of each
SETTLE_S = 0.3  # of rest before each timed operation, once the daemon's zeroer is idle


def model_bytes(path: Path) -> np.ndarray:
    """The file's tensor bytes (everything after the header), read into fresh,
    touched memory: what a plain store of "the same bytes" sends."""
    with open(path, "rb") as f:
        head = int.from_bytes(f.read(8), "little")
        f.seek(8 + head)
        data = np.fromfile(f, dtype=np.uint8)
    return data


class Client:
    """One cluster connection to a daemon and the helpers the rows time."""

    def __init__(self, cluster: rpcbuf.Cluster, model: Path, tmp: Path) -> None:
        self.cluster, self.model, self.tmp = cluster, model, tmp
        self.ctx = cluster[cluster.endpoints[0]]
        self._caches = 0

    def fresh_hash_cache(self) -> None:
        self._caches += 1
        os.environ["RPCBUF_CACHE_DIR"] = str(self.tmp / f"hashes-{self._caches}")

    async def load(self, name: str, hash_cache: bool = True) -> dict[str, Any]:
        t = time.perf_counter()
        res = await rpcbuf.load_model(self.cluster, self.model, name=name, progress=False,
                                      hash_cache=hash_cache)
        return {"seconds": time.perf_counter() - t, "bytes_sent": res.bytes_sent,
                "bytes_total": res.bytes_total}

    async def unload(self, name: str) -> None:
        await rpcbuf.unload_model(self.cluster, name)

    async def slot_size(self, name: str) -> int:
        """The size of the (one) slot buffer a load of ``name`` made."""
        return next(int(b["size"]) for b in await self.ctx.list_buffers()
                    if b["name"] == f"{name}/slot0")

    async def load_requested(self, name: str, size: int) -> dict[str, Any]:
        """``load`` into the slot buffer requested (and so pre-faulted) first,
        which the load reuses: the load without backing fresh memory; the
        request's seconds apart."""
        t = time.perf_counter()
        await self.ctx.request_buffer(size, name=f"{name}/slot0")
        request = time.perf_counter() - t
        return {**await self.load(name), "request_seconds": request}


async def store_time(ctx: rpcbuf.RpcContext, bid: str, data: np.ndarray,
                     verify: str | None = None) -> float:
    """Seconds one ``store_tensor`` of ``data`` takes."""
    t = time.perf_counter()
    await ctx.store_tensor(bid, data, verify=verify)
    return time.perf_counter() - t


class Quiet:
    """The daemon's state before each timed operation, made the same for
    every row: its background zeroer idle (a released block is zeroed in
    the background, which competes with whatever runs next; ``--metrics``'s
    ``rpcbuf_pool_zeroing_bytes``), the garbage collector run, then
    ``SETTLE_S`` of nothing.  ``reused`` counts the new buffers a kept block
    backed (``rpcbuf_pool_reused_blocks``), so each first load records
    whether it landed on a kept block, as the timed ones should."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/metrics"

    def read(self) -> dict[str, float]:
        """Each series' value, summed over its labels (devices)."""
        with urllib.request.urlopen(self.url, timeout=10) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                key = name.split("{")[0]
                out[key] = out.get(key, 0.0) + float(value)
        return out

    async def settle(self, timeout: float = 60.0) -> float:
        """Wait until the zeroer is idle (at most ``timeout``), collect, rest;
        the seconds it waited for the zeroer."""
        t = time.perf_counter()
        for _ in range(int(timeout / 0.02)):  # polled: the metrics page is all it says
            if (await asyncio.to_thread(self.read)).get("rpcbuf_pool_zeroing_bytes", 0) <= 0:
                break
            await asyncio.sleep(0.02)
        waited = time.perf_counter() - t
        gc.collect()
        await asyncio.sleep(SETTLE_S)
        return waited

    async def reused(self) -> int:
        got = await asyncio.to_thread(self.read)
        return int(got.get("rpcbuf_pool_reused_blocks_total",
                           got.get("rpcbuf_pool_reused_blocks", 0)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def section_one(tmp: Path, model: Path, data: np.ndarray, reps: int,
                      path: str = "ucx") -> dict[str, Any]:
    """The paired rows on one daemon, over ``path`` (``ucx``: RPCBUF_SAME_HOST=0,
    ``same-host``: =1).  Each repetition times the warm store, the checksum
    store and the first load in turn, in alternating order (even
    repetitions in that order, odd ones reversed), each after ``Quiet.settle``."""
    nbytes = int(data.nbytes)
    arena = 4 * GiB if nbytes > 512 * MiB else 1 << max(24, (4 * nbytes - 1).bit_length())
    port = free_port()
    os.environ["RPCBUF_SAME_HOST"] = "0" if path == "ucx" else "1"
    with Daemon(tmp / f"one-{path}", "--device", f"cpu:{arena}", "--metrics",
                f"127.0.0.1:{port}", ready_timeout=60, stop_timeout=60) as daemon:
        async with rpcbuf.Cluster.connect(daemon.addr, daemon.token, timeout=120) as cluster:
            c = Client(cluster, model, tmp)
            quiet = Quiet(port)
            ctx = c.ctx
            bid = await ctx.request_buffer(nbytes)
            progress(f"one ({path}): warm-up (a store, a load of each kind, a first load "
                     "on a kept block)")
            await ctx.store_tensor(bid, data)
            c.fresh_hash_cache()
            await c.load("m")
            slot = await c.slot_size("m")
            await c.load("m2")
            await c.unload("m2")
            await c.unload("m")
            # Once more, so that the first timed load lands on a block a
            # first load released, as every later one does (the block the
            # clone above shared was never kept: fresh pages to back).
            c.fresh_hash_cache()
            await c.load("m")
            await c.unload("m")
            rows: dict[str, list[Any]] = {k: [] for k in (
                "store", "store_checksum", "first", "same_name", "new_name",
                "new_name_no_hash_cache", "first_requested", "new_name_requested",
                "order", "first_kept", "zeroer_wait")}

            async def first() -> dict[str, Any]:
                c.fresh_hash_cache()
                before = await quiet.reused()
                got = await c.load("m")
                rows["first_kept"].append(await quiet.reused() - before)
                return got

            timed = {"store": lambda: store_time(ctx, bid, data),
                     "store_checksum": lambda: store_time(ctx, bid, data, "checksum"),
                     "first": first}
            for r in range(reps):
                order = list(timed) if r % 2 == 0 else list(reversed(timed))
                rows["order"].append(order)
                waited = 0.0
                for key in order:
                    waited += await quiet.settle()
                    rows[key].append(await timed[key]())
                    if key == "first":
                        await c.unload("m")
                rows["zeroer_wait"].append(waited)
                await quiet.settle()
                c.fresh_hash_cache()
                await c.load("m")
                await quiet.settle()
                rows["same_name"].append(await c.load("m"))
                await quiet.settle()
                rows["new_name"].append(await c.load("m2"))
                await c.unload("m2")
                await quiet.settle()
                rows["new_name_no_hash_cache"].append(await c.load("m2", hash_cache=False))
                await c.unload("m2")
                await quiet.settle()
                rows["new_name_requested"].append(await c.load_requested("m2", slot))
                await c.unload("m2")
                await c.unload("m")
                await quiet.settle()
                c.fresh_hash_cache()
                rows["first_requested"].append(await c.load_requested("m", slot))
                await c.unload("m")
                progress(f"one ({path}): repetition {r + 1}/{reps} ({', '.join(order)}): "
                         f"store {rows['store'][-1]:.3f} s, checksum store "
                         f"{rows['store_checksum'][-1]:.3f} s, first load "
                         f"{rows['first'][-1]['seconds']:.3f} s (kept block: "
                         f"{rows['first_kept'][-1]}), same name "
                         f"{rows['same_name'][-1]['seconds']:.3f} s, new name "
                         f"{rows['new_name'][-1]['seconds']:.3f} s")
            await ctx.release_buffer(bid)
    return rows


async def section_cold(tmp: Path, model: Path, data: np.ndarray, reps: int) -> dict[str, Any]:
    nbytes = int(data.nbytes)
    arena = 1 << max(24, (2 * nbytes - 1).bit_length())
    out: dict[str, list[Any]] = {"request": [], "cold_store": [], "warm_store": [],
                                 "cold_load": [], "prefault_request": [],
                                 "after_prefault_store": [], "arena": [arena]}
    for r in range(reps):
        with Daemon(tmp / f"cold-store-{r}", "--device", f"cpu:{arena}") as daemon:
            async with rpcbuf.connect(daemon.addr, token=daemon.token, timeout=120) as ctx:
                t = time.perf_counter()
                bid = await ctx.request_buffer(nbytes)
                out["request"].append(time.perf_counter() - t)
                out["cold_store"].append(await store_time(ctx, bid, data))
                out["warm_store"].append(await store_time(ctx, bid, data))
        with Daemon(tmp / f"cold-load-{r}", "--device", f"cpu:{arena}") as daemon:
            async with rpcbuf.Cluster.connect(daemon.addr, daemon.token,
                                              timeout=120) as cluster:
                c = Client(cluster, model, tmp)
                c.fresh_hash_cache()
                out["cold_load"].append(await c.load("m"))
        # --prefault: every new buffer backed before request_buffer answers
        # (per-buffer memory: nothing is backed at start any more)
        with Daemon(tmp / f"prefault-{r}", "--device", f"cpu:{arena}", "--prefault") as daemon:
            async with rpcbuf.connect(daemon.addr, token=daemon.token, timeout=120) as ctx:
                t = time.perf_counter()
                bid = await ctx.request_buffer(nbytes)
                out["prefault_request"].append(time.perf_counter() - t)
                out["after_prefault_store"].append(await store_time(ctx, bid, data))
        progress(f"cold: repetition {r + 1}/{reps}: request {out['request'][-1]:.3f} s, first "
                 f"store {out['cold_store'][-1]:.3f} s, second {out['warm_store'][-1]:.3f} s, "
                 f"cold load {out['cold_load'][-1]['seconds']:.3f} s, --prefault request "
                 f"{out['prefault_request'][-1]:.3f} s")
    return out


def section_netns(tmp: Path, model: Path, reps: int) -> dict[str, Any]:
    """The three-node row, in a child process (its UCX uses the veths)."""
    if os.geteuid() != 0:
        return {"skipped": "needs root for network namespaces (ip netns); run as root"}
    out = tmp / "netns.json"
    cmd = [sys.executable, str(benchkit.SCRIPTS / "_bench_load_netns.py"), str(model),
           str(tmp / "netns"), str(out), str(reps)]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                             env={**os.environ, "PYTHONPATH": str(benchkit.SRC)})
    except subprocess.TimeoutExpired:
        return {"skipped": "the netns child did not finish within 900 s"}
    sys.stderr.write(res.stderr)
    if res.returncode != 0 or not out.exists():
        return {"skipped": f"the netns child failed (exit {res.returncode}): "
                           f"{(res.stderr.strip().splitlines() or ['?'])[-1]}"}
    import json

    got: dict[str, Any] = json.loads(out.read_text())
    return got


async def run(tmp: Path, model: Path, data: np.ndarray, reps: int,
              sections: tuple[str, ...], paths: tuple[str, ...] = ("ucx",)) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "one" in sections:
        for path in paths:
            try:
                out[ONE_KEYS[path]] = await section_one(tmp, model, data, reps, path)
            finally:
                os.environ["RPCBUF_SAME_HOST"] = "0"  # what the other sections measure
    if "cold" in sections:
        out["cold"] = await section_cold(tmp, model, data, reps)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", default="bench_load.json", help="write every number here")
    p.add_argument("--size", type=int, default=1024, help="model size in MiB [%(default)s]")
    p.add_argument("--reps", type=int, default=5, help="[%(default)s]")
    p.add_argument("--paths", default=",".join(PATHS),
                   help="comma-separated paths the section 'one' runs over [%(default)s]")
    p.add_argument("--quick", action="store_true", help="one repetition of a 256 MiB model")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help="comma-separated sections [%(default)s]")
    args = p.parse_args(argv)
    sections = tuple(s for s in SECTIONS if s in args.only.split(","))
    if not sections or set(args.only.split(",")) - set(SECTIONS):
        p.error(f"--only: choose from {', '.join(SECTIONS)}")
    paths = tuple(x for x in PATHS if x in args.paths.split(","))
    if not paths or set(args.paths.split(",")) - set(PATHS):
        p.error(f"--paths: choose from {', '.join(PATHS)}")
    if args.quick:
        args.size, args.reps = 256, 1
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_load-") as tmpdir:
        tmp = Path(tmpdir)
        model = tmp / "model.safetensors"
        write_model(model, args.size * MiB, LAYERS)
        data = model_bytes(model)
        nbytes = int(data.nbytes)
        progress(f"model {nbytes / MiB:.0f} MiB, {LAYERS * 9 + 4} tensors")
        results = uvloop.run(run(tmp, model, data, args.reps, sections, paths))
        del data
        if "netns" in sections:
            progress("netns: three namespaced daemons, the client in a child process")
            results["netns"] = section_netns(tmp, model, args.reps)
    rows = build_rows(results, nbytes)
    print(f"model {nbytes / MiB:.0f} MiB ({LAYERS * 9 + 4} tensors, float16 safetensors), "
          f"UCX path over loopback tcp (rows marked 'same host': the same-host path), "
          f"medians of {args.reps} repetition(s), the paired rows in alternating order, "
          "each after the daemon's zeroer went idle")
    print(render(rows))
    write_json(args.json, {"meta": {"started_at": started, "seconds": time.time() - started,
                                    "model_bytes": nbytes, "reps": args.reps,
                                    "sections": list(sections), "paths": list(paths),
                                    "settle_seconds": SETTLE_S, **machine_meta()},
                           "results": results, "rows": rows})
    progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
