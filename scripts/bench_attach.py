"""The same-host path on shared memory, and zero-copy attach.

Run as ``.venv/bin/python scripts/bench_attach.py [--json bench_attach.json]
[--quick]`` (``make bench`` runs it).  One real ``rpcbufd`` on this host
(``--device cpu:2GiB``), this process its client under uvloop, with two
contexts: the default one (same host: the staging area and attach) and one
on the UCX path (``same_host=False``).  Rows, each a ratio of two things
measured back to back in this run (medians of a few rounds; the machine is
shared, so absolute numbers are noise):

* attach a stored 1 GiB buffer (256 tensors of 4 MiB) and reach its tensors
  (``ctx.attach`` + ``view.tensors()`` + close): against ``load_tensors``
  into fresh arrays and one ``np.copyto`` of 1 GiB between pre-touched
  arrays;
* four reader processes attach that buffer and touch every page: the
  machine's used memory (``/proc/meminfo``) grows by far less than 4 GiB;
* a 64 MiB same-host store and read (``read_buffer(out=...)``, pre-touched
  arrays) against one ``np.copyto`` of 64 MiB in this process;
* a 4 KiB store p50 on the same-host path against the UCX path;
* ``request_buffer`` + ``release_buffer`` of 4 KiB and of 64 MiB, one at a
  time, on the same-host context (the per-buffer memfd's cost is in there:
  four system calls at request, two at release), and the arena's
  ``back`` + ``unback`` alone against the allocator's allocate + free alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import rpcbuf
from benchkit import loopback_ucx_env, procs
from benchkit.report import format_table, machine_meta, progress_printer, write_json
from rpcbuf.dataplane.allocator import BuddyAllocator
from rpcbuf.dataplane.arena import HostArena

progress = progress_printer("bench_attach")
GIB, MIB = 1 << 30, 1 << 20

READER = """
import asyncio, sys, numpy as np, rpcbuf
async def main():
    async with rpcbuf.connect(sys.argv[1], token=sys.argv[2]) as c:
        async with c.attach(await c.open_buffer(sys.argv[3])) as view:
            a = view.array()
            print(int(a[::4096].astype(np.uint64).sum()), flush=True)
            sys.stdin.readline()
asyncio.run(main())
"""


def readers_grow(d: procs.Daemon, n: int) -> int:
    """Used memory grown while ``n`` reader processes hold the GiB attached."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent / "src")}
    base = used_bytes()
    readers = [subprocess.Popen([sys.executable, "-c", READER, d.addr, d.token, "bench-gib"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                env=env) for _ in range(n)]
    try:
        for r in readers:
            assert r.stdout is not None and r.stdout.readline().strip()
        return used_bytes() - base
    finally:
        for r in readers:
            r.kill()
            r.wait()


def used_bytes() -> int:
    info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
    return (int(info["MemTotal"].split()[0]) - int(info["MemAvailable"].split()[0])) * 1024


async def timed(op: Callable[[], Awaitable[Any]], rounds: int) -> float:
    """Median seconds of ``rounds`` calls."""
    got = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        await op()
        got.append(time.perf_counter() - t0)
    return float(np.median(got))


def sync_timed(op: Callable[[], Any], rounds: int) -> float:
    got = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        op()
        got.append(time.perf_counter() - t0)
    return float(np.median(got))


def row(what: str, value: str, ref: str, ratio: float, goal: str, met: bool | None) -> list[str]:
    return [what, value, ref, f"{ratio:.3g}x", goal, "-" if met is None else
            ("yes" if met else "NO")]


async def bench(d: procs.Daemon, quick: bool) -> tuple[list[list[str]], dict[str, Any]]:
    rounds = 3 if quick else 7
    rows: list[list[str]] = []
    out: dict[str, Any] = {}
    local = await rpcbuf.connect(d.addr, token=d.token)
    net = await rpcbuf.connect(d.addr, token=d.token, same_host=False)
    try:
        if not local.same_host:
            raise SystemExit(f"no same-host path: {local.hello.get('same_host_why')}")
        # -- attach 1 GiB ----------------------------------------------------------------
        progress("storing 1 GiB as 256 tensors")
        tensors = {f"t{i}": np.full(MIB, i, np.float32) for i in range(256)}
        bid = await local.request_buffer(GIB + 256 * 256, name="bench-gib")
        await local.store_tensors(bid, tensors)

        async def attach() -> None:
            async with local.attach(bid) as view:
                ts = view.tensors()
                assert len(ts) == 256
                del ts

        async def load() -> None:
            got = await local.load_tensors(bid)
            assert len(got) == 256

        src = np.ones(GIB, np.uint8)
        dst = np.zeros(GIB, np.uint8)
        t_attach = await timed(attach, rounds * 3)
        t_load = await timed(load, max(2, rounds // 2))
        t_copy = sync_timed(lambda a=dst, b=src: np.copyto(a, b), max(2, rounds // 2))
        del src, dst, tensors
        rows.append(row("attach 1 GiB + tensors()", f"{t_attach * 1e3:.3f} ms",
                        f"load_tensors {t_load * 1e3:.0f} ms", t_attach / t_load,
                        "<= 1 ms", t_attach <= 1e-3))
        rows.append(row("  vs one np.copyto of 1 GiB", f"{t_attach * 1e3:.3f} ms",
                        f"copyto {t_copy * 1e3:.0f} ms", t_attach / t_copy, "no copy",
                        t_attach < t_copy / 20))
        out["attach_1g"] = {"attach_s": t_attach, "load_tensors_s": t_load, "copyto_s": t_copy}
        # -- N readers share one copy ---------------------------------------------------------
        n = 2 if quick else 4
        progress(f"{n} reader processes attach the GiB")
        grown = await asyncio.to_thread(readers_grow, d, n)
        rows.append(row(f"{n} readers attach 1 GiB: memory", f"+{grown / MIB:.0f} MiB",
                        f"{n} copies {n * 1024} MiB", grown / (n * GIB),
                        "<< 1 GiB (interpreters only)", grown < GIB // 2))
        out["readers"] = {"n": n, "grown_bytes": grown}
        await local.release_buffer(bid)
        # -- 64 MiB same-host ------------------------------------------------------------------
        progress("64 MiB same-host store and read vs np.copyto")
        b64 = await local.request_buffer(64 * MIB)
        data = np.random.default_rng(1).integers(0, 256, 64 * MIB, dtype=np.uint8)
        back = np.ones(64 * MIB, np.uint8)
        await local.store_tensor(b64, data)
        stores, reads, copies = [], [], []
        for _ in range(rounds):  # alternated, so every side sees the same drift
            stores.append(await timed(lambda: local.store_tensor(b64, data), 1))
            reads.append(await timed(lambda: local.read_buffer(b64, 0, out=back), 1))
            copies.append(sync_timed(lambda: np.copyto(back, data), 1))
        ts, tr, tc = (float(np.median(x)) for x in (stores, reads, copies))
        gb = 64 * MIB / 1e9
        for what, t in (("64 MiB store, same host", ts), ("64 MiB read, same host", tr)):
            rows.append(row(what, f"{gb / t:.2f} GB/s", f"np.copyto {gb / tc:.2f} GB/s",
                            tc / t, ">= 0.9x", tc / t >= 0.9))
        out["same_host_64m"] = {"store_s": ts, "read_s": tr, "copyto_s": tc}
        # -- 4 KiB p50 ----------------------------------------------------------------------
        progress("4 KiB stores, both paths")
        small = np.zeros(4096, np.uint8)
        bnet = await net.request_buffer(4096)
        lat: dict[str, list[float]] = {"same": [], "ucx": []}
        for _ in range(10 if quick else 30):
            for key, ctx, b in (("same", local, b64), ("ucx", net, bnet)):
                for _ in range(20):
                    t0 = time.perf_counter()
                    await ctx.store_tensor(b, small)
                    lat[key].append(time.perf_counter() - t0)
        p_same, p_ucx = (float(np.median(lat[k])) for k in ("same", "ucx"))
        rows.append(row("4 KiB store p50, same host", f"{p_same * 1e6:.0f} us",
                        f"UCX path {p_ucx * 1e6:.0f} us", p_same / p_ucx, "<= 0.5x",
                        p_same / p_ucx <= 0.5))
        out["store_4k_p50"] = {"same_host_s": p_same, "ucx_s": p_ucx}
        await net.release_buffer(bnet)
        await local.release_buffer(b64)
        # -- request + release ---------------------------------------------------------------
        progress("request_buffer + release_buffer")
        for size in (4096, 64 * MIB):
            async def pair(size: int = size) -> None:
                await local.release_buffer(await local.request_buffer(size))
            t = await timed(pair, 50 if quick else 200)
            rows.append(row(f"request+release {size // 1024} KiB", f"{t * 1e6:.0f} us",
                            "-", 1.0, "-", None))
            out[f"request_release_{size}"] = t
    finally:
        await local.close()
        await net.close()
    # -- the arena's own cost, in this process -----------------------------------------------
    arena = HostArena(256 * MIB)
    alloc = BuddyAllocator(256 * MIB, 4096)
    for size in (4096, 64 * MIB):
        def plain(size: int = size) -> None:
            alloc.free(alloc.allocate(size))  # type: ignore[arg-type]

        def backed(size: int = size) -> None:
            off = alloc.allocate(size)
            assert off is not None
            arena.back(off, size)
            arena.unback(off, size)
            alloc.free(off)
        t_plain = sync_timed(plain, 2000)
        t_backed = sync_timed(backed, 2000)
        rows.append(row(f"arena back+unback {size // 1024} KiB", f"{t_backed * 1e6:.1f} us",
                        f"allocator only {t_plain * 1e6:.1f} us", t_backed / t_plain, "-", None))
        out[f"back_unback_{size}"] = {"backed_s": t_backed, "plain_s": t_plain}
    return rows, out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--quick", action="store_true", help="fewer rounds (a smoke test)")
    args = p.parse_args()
    loopback_ucx_env()
    import uvloop

    with tempfile.TemporaryDirectory(prefix="bench-attach-") as tmp:
        with procs.Daemon(Path(tmp), "--device", "cpu:2GiB") as d:
            rows, out = uvloop.run(bench(d, args.quick))
    print(format_table(["what", "value", "reference", "ratio", "goal", "met"], rows,
                       right={1, 2, 3}))
    if args.json:
        write_json(args.json, {"machine": machine_meta(), "results": out,
                               "rows": [dict(zip(["what", "value", "reference", "ratio", "goal",
                                                  "met"], r, strict=True)) for r in rows]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
