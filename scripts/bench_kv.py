"""rpcbuf as LMCache's remote tier beside what LMCache users pick today, one run.

Run as ``make bench-kv`` (under the LMCache venv, ``.integrations/lmcache``:
``.integrations/lmcache/bin/python scripts/bench_kv.py [--json bench_kv.json]
[--quick]``).  Every side is driven through LMCache's own code, at its
connector interface, the calls its RemoteBackend makes (``put``, ``get``,
``exists``, ``batched_put``, ``batched_get``), on a loop thread of its own as
RemoteBackend runs one, with memory objects from a real ``LocalCPUBackend`` of
the chunk's shape:

* ``rpcbuf same-host`` / ``rpcbuf ucx``: ``rpcbuf_lmcache.RpcbufConnector``
  against a real rpcbufd on loopback (the same-host path, and UCX over tcp);
* ``redis``: LMCache's built-in ``RedisConnector`` against Debian's
  ``redis-server`` (started here on loopback, no persistence);
* ``local cpu``: LMCache's ``LocalCPUBackend`` itself (``submit_put_task``,
  ``get_blocking``, ``contains``): a reference kept in the same process, no
  copy, the ceiling that any remote tier sits behind.

Chunks of 256 tokens, bf16, head_dim 128: 256 KiB (1 layer, 2 heads),
2 MiB (2 layers, 8 heads), 4 MiB (4 layers, 8 heads).  Reported: put and get
p50 and GB/s (size / p50), a batch of 256 chunks put and got in one call each,
and hit latency (``exists`` of a stored key, p50).  Every get is checked byte
for byte against what was put.  Shutdown is bounded: LMCache 0.5.6's
``RedisConnector.close()`` hangs (it awaits a blocking executor shutdown on
its own loop), so each close gets 5 s and is then abandoned.

Goal (issue 29): rpcbuf's chunk get >= 3x the Redis connector's GB/s.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import benchkit
from benchkit import KiB, MiB, size_name
from benchkit.procs import Daemon
from benchkit.report import format_table, machine_meta, progress_printer, write_json

benchkit.loopback_ucx_env()
os.environ.setdefault("PYTHONHASHSEED", "0")
sys.path.insert(0, str(benchkit.ROOT / "tests" / "integrations"))

import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache_harness import CHUNK, destroy, make_engine  # noqa: E402

progress = progress_printer("bench_kv")
SHAPES = {256 * KiB: (1, 2), 2 * MiB: (2, 8), 4 * MiB: (4, 8)}  # chunk bytes: (layers, heads)
BATCH = 256
CLOSE_TIMEOUT = 5.0
CALL_TIMEOUT = 120.0


class LoopThread:
    """An event loop on a thread of its own (as LMCache's RemoteBackend runs one)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Any, timeout: float = CALL_TIMEOUT) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CLOSE_TIMEOUT)


def _keys(n: int, tag: str) -> list[CacheEngineKey]:
    base = hash(tag) & 0xFFFFFFFF
    return [CacheEngineKey("tiny", 1, 0, (base << 20) + i, torch.bfloat16) for i in range(n)]


def _filled(backend: Any, n: int, seed: int) -> list[Any]:
    md = backend.metadata
    shapes, dtypes = md.get_shapes(), md.get_dtypes()
    g = torch.Generator().manual_seed(seed)
    objs = []
    for _ in range(n):
        obj = backend.allocate(shapes, dtypes)
        assert obj is not None, "the local CPU backend is full"
        obj.tensor.copy_(torch.randn(obj.tensor.shape, generator=g).to(obj.tensor.dtype))
        objs.append(obj)
    return objs


def _same(a: Any, b: Any) -> bool:
    return bytes(memoryview(a.byte_array).cast("B")) == bytes(memoryview(b.byte_array).cast("B"))


def _p50(samples: list[float]) -> float:
    return statistics.median(samples)


class Remote:
    """A RemoteConnector on its loop thread: the calls RemoteBackend makes."""

    def __init__(self, conn: Any, lt: LoopThread) -> None:
        self.conn, self.lt = conn, lt

    def put(self, key: Any, obj: Any) -> None:
        self.lt.run(self.conn.put(key, obj))

    def get(self, key: Any) -> Any:
        return self.lt.run(self.conn.get(key))

    def exists(self, key: Any) -> bool:
        return bool(self.lt.run(self.conn.exists(key)))

    def batched_put(self, keys: list[Any], objs: list[Any]) -> None:
        if self.conn.support_batched_put():
            self.lt.run(self.conn.batched_put(keys, objs))
        else:  # as RemoteBackend falls back: one put each, all at once
            self.lt.run(_gather(*(self.conn.put(k, o) for k, o in zip(keys, objs, strict=True))))

    def batched_get(self, keys: list[Any]) -> list[Any]:
        if self.conn.support_batched_get():
            return list(self.lt.run(self.conn.batched_get(keys)))
        return list(self.lt.run(_gather(*(self.conn.get(k) for k in keys))))

    def close(self) -> str:
        try:
            self.lt.run(self.conn.close(), CLOSE_TIMEOUT)
            return ""
        except TimeoutError:
            return f"close() hung; abandoned after {CLOSE_TIMEOUT:.0f} s"


async def _gather(*coros: Any) -> list[Any]:
    return list(await asyncio.gather(*coros))


class Local:
    """LMCache's LocalCPUBackend itself: the object is kept, not copied."""

    def __init__(self, backend: Any) -> None:
        self.b = backend

    def put(self, key: Any, obj: Any) -> None:
        self.b.submit_put_task(key, obj)

    def get(self, key: Any) -> Any:
        return self.b.get_blocking(key)

    def exists(self, key: Any) -> bool:
        return bool(self.b.contains(key))

    def batched_put(self, keys: list[Any], objs: list[Any]) -> None:
        for k, o in zip(keys, objs, strict=True):
            self.b.submit_put_task(k, o)

    def batched_get(self, keys: list[Any]) -> list[Any]:
        return [self.b.get_blocking(k) for k in keys]

    def close(self) -> str:
        return ""


def measure(side: Any, backend: Any, size: int, iters: int, batch: bool,
            tag: str) -> dict[str, Any]:
    objs = _filled(backend, iters, seed=size % 9973)
    keys = _keys(iters, f"{tag}/{size}")
    out: dict[str, Any] = {}
    puts, gets, hits = [], [], []
    for k, o in zip(keys, objs, strict=True):
        t0 = time.perf_counter()
        side.put(k, o)
        puts.append(time.perf_counter() - t0)
    for k, o in zip(keys, objs, strict=True):
        t0 = time.perf_counter()
        got = side.get(k)
        gets.append(time.perf_counter() - t0)
        assert got is not None and _same(got, o), f"{tag}: chunk {k} came back different"
        if got is not o:
            got.ref_count_down()
    for k in keys:
        t0 = time.perf_counter()
        assert side.exists(k)
        hits.append(time.perf_counter() - t0)
    out.update(put_p50_ms=_p50(puts) * 1e3, put_gb_s=size / _p50(puts) / 1e9,
               get_p50_ms=_p50(gets) * 1e3, get_gb_s=size / _p50(gets) / 1e9,
               hit_p50_us=_p50(hits) * 1e6, iters=iters)
    for o in objs:
        o.ref_count_down()
    if batch:
        bobjs = _filled(backend, BATCH, seed=7)
        bkeys = _keys(BATCH, f"{tag}/{size}/batch")
        t0 = time.perf_counter()
        side.batched_put(bkeys, bobjs)
        tp = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = side.batched_get(bkeys)
        tg = time.perf_counter() - t0
        assert all(g is not None for g in got), f"{tag}: a batch chunk went missing"
        assert _same(got[0], bobjs[0]) and _same(got[-1], bobjs[-1])
        for g, o in zip(got, bobjs, strict=True):
            if g is not o:
                g.ref_count_down()
            o.ref_count_down()
        out.update(batch_put_ms=tp * 1e3, batch_put_gb_s=BATCH * size / tp / 1e9,
                   batch_get_ms=tg * 1e3, batch_get_gb_s=BATCH * size / tg / 1e9)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(tmp: Path) -> tuple[subprocess.Popen[bytes] | None, str]:
    exe = shutil.which("redis-server")
    if exe is None:
        return None, "redis-server is not installed (Debian: apt-get install redis-server)"
    port = _free_port()
    proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, f"redis://127.0.0.1:{port}"
        time.sleep(0.05)
    proc.kill()
    return None, "redis-server did not start"


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector

    from rpcbuf_lmcache import RpcbufConnector

    iters = 5 if args.quick else 30
    results: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    redis_proc, redis_url = start_redis(tmp)
    if redis_proc is None:
        notes.append(f"redis: not measured: {redis_url}")
    (tmp / "rpcbufd").mkdir()
    daemon = Daemon(tmp / "rpcbufd", "--device", "cpu:3GiB").start()
    try:
        for size, (layers, heads) in SHAPES.items():
            batch = size <= 2 * MiB  # 256 chunks of 4 MiB would be 1 GiB a side
            engine, instance = make_engine(layers=layers, heads=heads,
                                           local_cpu_bytes=3 << 30)
            backend = engine.storage_manager.local_cpu_backend
            assert backend.metadata.get_shapes()[0].numel() * 2 == size
            try:
                sides: list[tuple[str, Any]] = [("local cpu", lambda b=backend: Local(b))]
                for label, same in (("rpcbuf same-host", True), ("rpcbuf ucx", False)):
                    def make(same: bool = same, backend: Any = backend) -> Any:
                        lt = LoopThread()
                        backend.config.extra_config = {
                            "remote_storage_plugin.rpcbuf.class_name": "RpcbufConnector",
                            "remote_storage_plugin.rpcbuf.endpoint": daemon.addr,
                            "remote_storage_plugin.rpcbuf.token": daemon.token,
                            "remote_storage_plugin.rpcbuf.same_host": same}
                        return Remote(RpcbufConnector(loop=lt.loop, local_cpu_backend=backend,
                                                      config=backend.config), lt)
                    sides.append((label, make))
                if redis_proc is not None:
                    def make_redis(backend: Any = backend) -> Any:
                        lt = LoopThread()
                        return Remote(RedisConnector(redis_url, lt.loop, backend), lt)
                    sides.append(("redis", make_redis))
                for label, factory in sides:
                    progress(f"{label}, {size_name(size)} chunks ...")
                    side = factory()
                    try:
                        row = measure(side, backend, size, iters, batch, label)
                    finally:
                        why = side.close()
                        if isinstance(side, Remote):
                            side.lt.stop()
                        if why and f"{label}: {why}" not in notes:
                            notes.append(f"{label}: {why}")
                    results.setdefault(label, {})[size_name(size)] = row
            finally:
                destroy(instance)
    finally:
        daemon.stop()
        if redis_proc is not None:
            redis_proc.terminate()
            try:
                redis_proc.wait(5)
            except subprocess.TimeoutExpired:
                redis_proc.kill()
    return {"results": results, "notes": notes}


def render(report: dict[str, Any]) -> str:
    res = report["results"]
    rows = []
    for label, by_size in res.items():
        for size, r in by_size.items():
            batch = (f"{r['batch_put_gb_s']:.2f} / {r['batch_get_gb_s']:.2f}"
                     if "batch_get_gb_s" in r else "-")
            rows.append([label, size, f"{r['put_p50_ms']:.3f}", f"{r['put_gb_s']:.2f}",
                         f"{r['get_p50_ms']:.3f}", f"{r['get_gb_s']:.2f}", batch,
                         f"{r['hit_p50_us']:.0f}"])
    text = [format_table(["side", "chunk", "put p50 ms", "put GB/s", "get p50 ms", "get GB/s",
                          f"batch of {BATCH} put / get GB/s", "hit p50 us"], rows,
                         right=range(2, 8))]
    redis = res.get("redis", {})
    goal = []
    for label in ("rpcbuf same-host", "rpcbuf ucx"):
        for size, r in res.get(label, {}).items():
            if size in redis:
                ratio = r["get_gb_s"] / redis[size]["get_gb_s"]
                goal.append(f"{label} {size} get: {ratio:.1f}x redis "
                            f"({'meets' if ratio >= 3 else 'misses'} the 3x goal)")
    return "\n".join([*text, "", *goal, *report.get("notes", [])])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="bench_kv.json", help="write every number here")
    p.add_argument("--quick", action="store_true", help="5 chunks per size instead of 30")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="rpcbuf-bench-kv-") as tmpdir:
        report = run(args, Path(tmpdir))
    report["meta"] = {**machine_meta(), "iters": 5 if args.quick else 30, "batch": BATCH,
                      "chunk_tokens": CHUNK}
    write_json(args.json, report)
    print(render(report))
    sys.stdout.flush()
    # Threads LMCache left behind (the Redis connector's executor after its
    # hung close) must not keep the process alive: everything is written.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
