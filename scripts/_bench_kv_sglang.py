"""rpcbuf as SGLang's HiCache storage backend beside SGLang's own, one run:
the third part of ``make bench-kv``, under the SGLang venv
(``.integrations/sglang/bin/python scripts/_bench_kv_sglang.py [--json
bench_kv_sglang.json] [--quick]``).

Rows: a batch set of 64 pages, then a batch get of the same 64 pages into
other slots of the host pool (every byte checked), fresh page hashes each
round, the median of ``--rounds``; pages of 64 tokens, bf16, at TP 1, in two
shapes (``tests/integrations/sglang_harness.SHAPES``): Qwen2.5-0.5B (24
layers, 2 KV heads of 64: 768 KiB a page) and Llama-3-8B (32 layers, 8 KV
heads of 128: 8 MiB a page).  Sides:

* ``rpcbuf same-host`` / ``rpcbuf ucx``: ``rpcbuf_sglang.RpcbufHiCacheStorage``
  made by SGLang's ``StorageBackendFactory`` from the extra_config a user
  pastes (``interface_v1``: the calls are ``batch_set_v1``/``batch_get_v1``,
  in place in the host pool), against a real rpcbufd on loopback;
* ``file /dev/shm``: SGLang's ``HiCacheFile`` (``file``) on tmpfs, through
  the calls its cache controller makes of it (``batch_set`` of the pool's
  data pages, ``batch_get`` into flat pages; the controller's copy of those
  into the pool is not timed);
* ``Mooncake tcp`` / ``Mooncake same-host``: the store calls SGLang's
  ``MooncakeStore`` makes for ``batch_set_v1``/``batch_get_v1``, against the
  master and holder the KV benchmark starts (``_bench_kv_sglang_mooncake.py``:
  SGLang's class itself does not import on the CPU).

rpcbuf runs as a serving engine's tier runs, full: untimed batch sets first
fill the tenant's quota (1 GiB), so each timed set evicts the oldest pages and
takes their slots (no new memory made on the set's path); the file backend is
cleared after each round (tmpfs has no eviction of its own); Mooncake's
segment is made at its start (2 GB), its keys removed after each round.  The
host pool is ``sglang_harness.HostPool`` (SGLang's own does not import on the
CPU).  Each side runs alone; GB/s is 64 pages over the median.
Goal (issue 36): rpcbuf at least as fast as the best of the others on every row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchkit
from benchkit.procs import Daemon
from benchkit.report import format_table, machine_meta, progress_printer, write_json

benchkit.loopback_ucx_env()
sys.path.insert(0, str(benchkit.ROOT / "tests" / "integrations"))

import torch  # noqa: E402
from sglang_harness import SHAPES, HostPool, file_extra, make, rpcbuf_extra  # noqa: E402

import _bench_peers_setup as setup  # noqa: E402
from bench_kv_store import unshare_cmd  # noqa: E402

progress = progress_printer("bench_kv sglang")
PAGES = 64
POOL = "2GiB"  # rpcbufd's pool
QUOTA = 1 << 30  # the benchmark tenant's bytes on it: the tier is full at that, and evicts
ROWS = ("qwen2.5-0.5b", "llama-3-8b")
CALL_TIMEOUT = 120


def page_bytes(shape: str) -> int:
    layers, heads, dim = SHAPES[shape]
    return 2 * 64 * layers * heads * dim * 2


def measure(backend: Any, pool: HostPool, shape: str, rounds: int, v1: bool,
            clear_each: bool, warm: int) -> dict[str, Any]:
    """Batch set then batch get of PAGES pages, ``rounds`` times after
    ``warm`` untimed batch sets (see the module); ``clear_each``: the
    backend's ``clear`` after each round (untimed), else once at the end."""
    sets, gets = [], []
    for w in range(warm):
        keys = [f"{shape}-warm{w}-{i:06d}-{os.getpid()}" for i in range(PAGES)]
        if v1:
            assert all(backend.batch_set_v1(keys, pool.slots(0, PAGES))), "a warm-up set failed"
        else:
            assert backend.batch_set(keys, [pool.get_data_page(i * pool.page_size)
                                            for i in range(PAGES)]), "a warm-up set failed"
        if clear_each:
            backend.clear()
    for r in range(rounds):
        pool.fill(0, PAGES, seed=r)
        pool.kv_buffer[:, PAGES * pool.page_size:] = 0
        keys = [f"{shape}-{r}-{i:06d}-{os.getpid()}" for i in range(PAGES)]
        ps = pool.page_size
        if v1:
            t0 = time.perf_counter()
            ok = backend.batch_set_v1(keys, pool.slots(0, PAGES))
            sets.append(time.perf_counter() - t0)
            assert all(ok), f"batch set: {ok.count(False)} of {PAGES} pages failed"
            t0 = time.perf_counter()
            ok = backend.batch_get_v1(keys, pool.slots(PAGES, PAGES))
            gets.append(time.perf_counter() - t0)
            assert all(ok), f"batch get: {ok.count(False)} of {PAGES} pages missed"
        else:
            data = [pool.get_data_page(i * ps) for i in range(PAGES)]
            t0 = time.perf_counter()
            assert backend.batch_set(keys, data), "batch set failed"
            sets.append(time.perf_counter() - t0)
            dst = [pool.get_dummy_flat_data_page() for _ in range(PAGES)]
            t0 = time.perf_counter()
            got = backend.batch_get(keys, dst)
            gets.append(time.perf_counter() - t0)
            assert all(g is not None for g in got), "batch get missed"
            for i, g in enumerate(got):  # (the controller's copy into the pool: not timed)
                pool.set_from_flat_data_page((PAGES + i) * ps, g)
        assert torch.equal(pool.pages(PAGES, PAGES), pool.pages(0, PAGES)), "bytes differ"
        if clear_each:
            backend.clear()
    backend.clear()
    return {"set_ms": statistics.median(sets) * 1e3, "get_ms": statistics.median(gets) * 1e3,
            "set_samples_ms": [s * 1e3 for s in sets], "get_samples_ms": [g * 1e3 for g in gets]}


def run_sglang_sides(rounds: int, tmp: Path) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    shm = Path(tempfile.mkdtemp(prefix="rpcbuf-bench-hicache-", dir="/dev/shm"))
    (tmp / "rpcbufd").mkdir()
    daemon = Daemon(tmp / "rpcbufd", "--device", f"cpu:{POOL}",
                    "--quota", "bench:1GiB:100000").start()
    try:
        for shape in ROWS:
            layers, heads, dim = SHAPES[shape]
            pool = HostPool(2 * PAGES, layers, heads, dim)
            sides: list[tuple[str, dict[str, Any], str, bool]] = [
                ("rpcbuf same-host", rpcbuf_extra(daemon.addr, daemon.token, same_host=True,
                                                  timeout=CALL_TIMEOUT), "dynamic", True),
                ("rpcbuf ucx", rpcbuf_extra(daemon.addr, daemon.token, same_host=False,
                                            timeout=CALL_TIMEOUT), "dynamic", True),
                ("file /dev/shm", file_extra(shm), "file", False)]
            for label, extra, kind, v1 in sides:
                # rpcbuf as a serving engine's tier runs: full, each set evicting the
                # oldest pages (warm-up sets fill the tenant's quota first); the file
                # backend is cleared after each round (tmpfs, no eviction of its own).
                warm = 1 if kind == "file" else -(-QUOTA // (PAGES * page_bytes(shape))) + 1
                progress(f"{label}, {shape} ...")
                backend = make(kind, pool, f"bench/{shape}", extra=extra)
                try:
                    results.setdefault(label, {})[shape] = measure(
                        backend, pool, shape, rounds, v1, clear_each=kind == "file",
                        warm=warm)
                except AssertionError as exc:
                    results.setdefault(label, {})[shape] = {"error": str(exc)[:300]}
                finally:
                    close = getattr(backend, "close", None)
                    if close is not None:
                        close()
            del pool
    finally:
        daemon.stop()
        for f in shm.iterdir():
            f.unlink()
        shm.rmdir()
    return results


def run_mooncake(rounds: int, tmp: Path) -> tuple[dict[str, Any], list[str]]:
    names = ["Mooncake tcp", "Mooncake same-host"]
    env = setup.ensure(setup.PACKAGES[0], progress=progress)
    if env.python is None:
        return {}, [f"{n}: not measured: {env.reason}" for n in names]
    ns = unshare_cmd()
    if ns is None:
        return {}, [f"{n}: not measured: no network namespace here (unshare -n / -rn "
                    "failed)" for n in names]
    logs = tmp / "mooncake"
    logs.mkdir()
    result = logs / "result.json"
    cmd = [*ns, str(env.python), str(benchkit.SCRIPTS / "_bench_kv_sglang_mooncake.py"),
           "--bin", str(env.python.parent), "--out", str(result), "--logs", str(logs),
           "--shapes", json.dumps({s: page_bytes(s) for s in ROWS}),
           "--pages", str(PAGES), "--rounds", str(rounds), "--segment-gb", "2"]
    progress(f"Mooncake Store {env.version} in a network namespace ({' '.join(ns)}) ...")
    with open(logs / "child.log", "wb") as log:
        try:
            rc = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(benchkit.SCRIPTS)},
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                timeout=600).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if not result.exists():
        tail = (logs / "child.log").read_text(errors="replace").splitlines()[-3:]
        return {}, [f"Mooncake: no result ({'timed out' if rc == -1 else f'exit {rc}'}): "
                    f"{' | '.join(tail)}"]
    got = json.loads(result.read_text())
    return got["sides"], [*got.get("notes", []), f"Mooncake Store {env.version}"]


def render(report: dict[str, Any]) -> str:
    res = report["results"]
    rows = []
    for label, by_shape in res.items():
        for shape in ROWS:
            r = by_shape.get(shape) if isinstance(by_shape, dict) else None
            if not r or "error" in r:
                why = (r or {}).get("error", "not measured") if isinstance(r, dict) else "-"
                rows.append([label, shape, "-", "-", "-", "-", str(why)[:60]])
                continue
            nbytes = PAGES * page_bytes(shape)
            rows.append([label, shape, f"{r['set_ms']:.2f}", f"{nbytes / r['set_ms'] / 1e6:.2f}",
                         f"{r['get_ms']:.2f}", f"{nbytes / r['get_ms'] / 1e6:.2f}", ""])
    text = [format_table(["side", f"{PAGES} pages of", "set ms", "set GB/s", "get ms",
                          "get GB/s", "note"], rows, right=range(2, 6))]
    goal = []
    for ours, peer in (("rpcbuf same-host", "Mooncake same-host"),
                       ("rpcbuf ucx", "Mooncake tcp")):  # like for like first
        for shape in ROWS:
            mine, theirs = res.get(ours, {}).get(shape, {}), res.get(peer, {}).get(shape, {})
            if "set_ms" in mine and "set_ms" in theirs:
                st, gt = theirs["set_ms"] / mine["set_ms"], theirs["get_ms"] / mine["get_ms"]
                goal.append(f"{ours} / {peer}, {shape}: set {st:.2f}x, get {gt:.2f}x its speed")
    for ours in ("rpcbuf same-host", "rpcbuf ucx"):
        for shape in ROWS:
            mine = res.get(ours, {}).get(shape, {})
            if "set_ms" not in mine:
                continue
            for op in ("set", "get"):
                others = {k: v[shape][f"{op}_ms"] for k, v in res.items()
                          if not k.startswith("rpcbuf") and f"{op}_ms" in v.get(shape, {})}
                if not others:
                    continue
                best = min(others, key=lambda k: others[k])
                ratio = others[best] / mine[f"{op}_ms"]
                goal.append(f"{ours} {shape} batch {op}: {ratio:.2f}x the speed of {best} "
                            f"(the best other): {'met' if ratio >= 1 else 'missed'}")
    return "\n".join([*text, "", *goal, *report.get("notes", [])])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="bench_kv_sglang.json", help="write every number here")
    p.add_argument("--quick", action="store_true", help="2 rounds instead of 5")
    p.add_argument("--no-mooncake", action="store_true", help="leave Mooncake out")
    args = p.parse_args()
    rounds = 2 if args.quick else 5
    with tempfile.TemporaryDirectory(prefix="rpcbuf-bench-kv-sglang-") as tmpdir:
        tmp = Path(tmpdir)
        notes: list[str] = []
        results: dict[str, Any] = {}
        if not args.no_mooncake:  # first, and stopped before rpcbufd starts
            sides, notes = run_mooncake(rounds, tmp)
            results.update(sides)
        results = {**run_sglang_sides(rounds, tmp), **results}
    report = {"results": results, "notes": notes,
              "meta": {**machine_meta(), "rounds": rounds, "pages": PAGES,
                       "page_bytes": {s: page_bytes(s) for s in ROWS},
                       "shapes": {s: SHAPES[s] for s in ROWS}}}
    write_json(args.json, report)
    print(render(report))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
