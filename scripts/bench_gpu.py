"""GPU benchmark: rpcbuf stores and reads of device memory against CuPy's own
copies, in one run on one machine (``scripts/gpu_check.sh`` runs it).

Rows (median of ``--rounds`` after a warm-up; bytes / median time):

* device-to-device store: a CuPy array in this process -> a GPU buffer of a
  real ``rpcbufd`` (another process), against CuPy's on-device copy
  (``dst[...] = src``, same size, same GPU).  Goal: >= 0.5 x (DESIGN.md).
* device-to-device read: the GPU buffer -> a CuPy array, same reference.
* host -> device store (NumPy array -> GPU buffer) against CuPy's H2D copy
  (``dev.set(host)``); device -> host read against CuPy's D2H
  (``dev.get(out=host)``); both with pageable host memory, as a client has.
* wire fp16 store of a float32 CuPy array (half the bytes cross) against the
  plain store.
* device checksum (``devsum``) throughput.

The daemon gets ``--device cuda:0:SIZE`` and the UCX settings of
``rpcbuf.dataplane.ucx`` (CUDA defaults, each overridable by the environment).
Writes JSON (``--json``) naming the GPU, the driver and every number.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import benchkit  # noqa: F401  (puts this checkout's src/ on sys.path)
from rpcbuf.dataplane import ucx

ucx.apply_defaults(cuda=True)

import cupy as cp  # noqa: E402

import rpcbuf  # noqa: E402
from benchkit.procs import Daemon  # noqa: E402
from benchkit.report import format_table, write_json  # noqa: E402
from rpcbuf.dataplane.devsum import device_devsum  # noqa: E402


def gpu_time(fn: Any, rounds: int) -> list[float]:
    """Seconds per call, timed with CUDA events."""
    fn()
    out = []
    for _ in range(rounds):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        end.record()
        end.synchronize()
        out.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return out


def wall_time(fn: Any, rounds: int) -> list[float]:
    fn()
    cp.cuda.Device().synchronize()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        cp.cuda.Device().synchronize()
        out.append(time.perf_counter() - t)
    return out


async def async_time(fn: Any, rounds: int) -> list[float]:
    await fn()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        await fn()
        out.append(time.perf_counter() - t)
    return out


def row(name: str, nbytes: int, samples: list[float], ref: str | None = None) -> dict[str, Any]:
    med = statistics.median(samples)
    return {"name": name, "bytes": nbytes, "median_s": med, "gbps": nbytes / med / 1e9,
            "samples_s": samples, "reference": ref}


def driver_info() -> dict[str, Any]:
    props = cp.cuda.runtime.getDeviceProperties(0)
    info: dict[str, Any] = {
        "gpu": props["name"].decode(errors="replace"),
        "cuda_driver_version": cp.cuda.runtime.driverGetVersion(),
        "cuda_runtime_version": cp.cuda.runtime.runtimeGetVersion(),
        "cupy": cp.__version__,
        "python": platform.python_version(),
    }
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"unavailable: {exc}"
    try:
        import ucxx

        info["ucxx"] = ucxx.__version__
    except Exception as exc:
        info["ucxx"] = f"unavailable: {exc}"
    info["ucx_env"] = {k: v for k, v in os.environ.items() if k.startswith(("UCX", "UCXPY"))}
    return info


async def bench(addr: str, token: str, size: int, rounds: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    src = cp.random.standard_normal(size // 4, dtype=cp.float32).view(cp.uint8)
    dst = cp.empty_like(src)
    host = np.empty(size, np.uint8)
    host[:] = 1

    def d2d() -> None:
        dst[...] = src

    rows.append(row("cupy on-device copy", size, gpu_time(d2d, rounds)))
    rows.append(row("cupy H2D copy (dev.set)", size, wall_time(lambda: dst.set(host), rounds)))
    rows.append(row("cupy D2H copy (dev.get)", size,
                    wall_time(lambda: dst.get(out=host), rounds)))
    rows.append(row("devsum on device", size, gpu_time(lambda: device_devsum(src), rounds)))
    async with rpcbuf.connect(addr, token=token, timeout=120) as c:
        buf = await c.request_buffer(size, device_type="GPU", device=0)
        try:
            rows.append(row("store D2D (cupy -> GPU buffer)", size, await async_time(
                lambda: c.store_tensor(buf, src), rounds), "cupy on-device copy"))
            rows.append(row("read D2D (GPU buffer -> cupy)", size, await async_time(
                lambda: c.read_buffer(buf, out=dst), rounds), "cupy on-device copy"))
            rows.append(row("store H2D (numpy -> GPU buffer)", size, await async_time(
                lambda: c.store_tensor(buf, host), rounds), "cupy H2D copy (dev.set)"))
            rows.append(row("read D2H (GPU buffer -> numpy)", size, await async_time(
                lambda: c.read_buffer(buf, out=host), rounds), "cupy D2H copy (dev.get)"))
            rows.append(row("store D2D verify=checksum", size, await async_time(
                lambda: c.store_tensor(buf, src, verify="checksum"), rounds),
                "cupy on-device copy"))
            f32 = src.view(cp.float32)
            rows.append(row("store D2D wire fp16 (float32 size)", size, await async_time(
                lambda: c.store_tensor(buf, f32, wire_dtype="float16"), rounds),
                "store D2D (cupy -> GPU buffer)"))
        finally:
            await c.release_buffer(buf)
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        if r["reference"]:
            r["ratio"] = r["gbps"] / by_name[r["reference"]]["gbps"]
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", type=int, default=256 << 20, help="bytes per transfer [256 MiB]")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--json", type=Path, help="write the report here")
    args = p.parse_args()
    info = driver_info()
    with tempfile.TemporaryDirectory() as tmp, \
            Daemon(Path(tmp), "--device", "cpu:1GiB", "--device", f"cuda:0:{4 * args.size}",
                   tenant="bench", ready_timeout=120.0, stop_timeout=60.0) as daemon:
        import uvloop

        rows = uvloop.run(bench(daemon.addr, daemon.token, args.size, args.rounds))
    d2d = next(r for r in rows if r["name"].startswith("store D2D (cupy"))
    goal = {"what": "device-to-device store >= 0.5 x on-device copy bandwidth",
            "ratio": d2d["ratio"], "met": d2d["ratio"] >= 0.5}
    print(f"{info['gpu']}  driver {info['nvidia_smi']}")
    print(format_table(("row", "GB/s", "ratio", "reference"),
                       [(r["name"], f"{r['gbps']:.2f}",
                         f"{r['ratio']:.2f}" if "ratio" in r else "", r["reference"] or "")
                        for r in rows], right={1, 2}, rule=False))
    print(f"goal: {goal['what']}: {goal['ratio']:.2f} -> {'met' if goal['met'] else 'NOT met'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_json(args.json, {"info": info, "rows": rows, "goal": goal,
                               "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
