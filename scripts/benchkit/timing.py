"""Timing: loops that time one operation, rounds that alternate sides, statistics, CPU time.

A *round* (``Round``) takes a count and returns that many samples in
seconds.  ``alternate_many`` runs several rounds in chunks that rotate who
goes first, with the garbage collector off, so drift on a busy machine hits
every side alike: the ratios between sides are what a benchmark here reports.
``summarize`` turns samples into the latency statistics every JSON file
stores (microseconds, and GB/s at the median when the size is known).
CPU time comes from ``/proc``: a process's (all threads), and the whole
machine's, to say how much other processes competed with a run.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

import numpy as np

from benchkit.interrupt import check_interrupted

Round = Callable[[int], Awaitable[list[float]]]


@contextlib.contextmanager
def no_gc() -> Iterator[None]:
    """The garbage collector off while timing (after one collection)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def timed(op: Callable[[], Awaitable[Any]], iters: int) -> list[float]:
    """Seconds each of ``iters`` awaits of ``op()`` took."""
    samples = []
    clock = time.perf_counter
    for _ in range(iters):
        check_interrupted()
        t0 = clock()
        await op()
        samples.append(clock() - t0)
    return samples


def timed_sync(op: Callable[[], object], iters: int) -> list[float]:
    """``timed`` for blocking operations (a raw socket, memcpy)."""
    samples = []
    clock = time.perf_counter
    for _ in range(iters):
        t0 = clock()
        op()
        samples.append(clock() - t0)
    check_interrupted()
    return samples


def blocking(fn: Callable[[int], list[float]]) -> Round:
    """A blocking round as a ``Round``: it runs on the event loop's thread,
    stalling the loop, which is fine here: nothing else runs while measuring."""
    async def run(n: int) -> list[float]:
        return fn(n)
    return run


async def alternate_many(sides: Sequence[Round], iters: int, rounds: int,
                         warm: bool = False) -> list[list[float]]:
    """Run ``iters`` of each side in ``rounds`` chunks, rotating who goes first.

    With ``warm`` each chunk starts with one untimed operation: every side measures
    steady traffic.  (A raw peer has its receive posted, and so keeps polling,
    through a whole chunk; rpcbufd sleeps on epoll after 10 ms without
    traffic, and the first transfer after such a lull pays a UCX wake-up:
    that cost is real but belongs to another row than steady throughput.)"""
    out: list[list[float]] = [[] for _ in sides]
    rounds = max(1, min(rounds, iters))
    w = 1 if warm else 0
    k = len(sides)
    for r in range(rounds):
        n = iters // rounds + (1 if r < iters % rounds else 0)
        with no_gc():
            for j in range(k):
                i = (r + j) % k
                out[i] += (await sides[i](n + w))[w:]
    return out


async def alternate(ours: Round, ref: Round, iters: int, rounds: int,
                    warm: bool = False) -> tuple[list[float], list[float]]:
    a, b = await alternate_many((ours, ref), iters, rounds, warm)
    return a, b


def rotated(keys: list[str], r: int) -> list[str]:
    """``keys`` rotated left by ``r``: who goes first in round ``r``."""
    r %= max(1, len(keys))
    return keys[r:] + keys[:r]


def summarize(samples: list[float], nbytes: int | None = None) -> dict[str, Any]:
    """Latency stats in microseconds (+ GB/s at the median when ``nbytes``)."""
    arr = np.asarray(samples, dtype=np.float64)
    p50 = float(np.median(arr))
    out: dict[str, Any] = {
        "n": len(samples),
        "p50_us": p50 * 1e6,
        "p99_us": float(np.percentile(arr, 99)) * 1e6,
        "mean_us": float(arr.mean()) * 1e6,
        "min_us": float(arr.min()) * 1e6,
        "max_us": float(arr.max()) * 1e6,
    }
    if nbytes is not None:
        out["nbytes"] = nbytes
        out["gbps_p50"] = nbytes / p50 / 1e9
        out["gbps_mean"] = nbytes / float(arr.mean()) / 1e9
    out["samples_us"] = [round(s * 1e6, 3) for s in samples]
    return out


def cpu_ticks(pid: int) -> int | None:
    """utime + stime of every thread of ``pid``, in clock ticks (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads); ProcessLookupError: gone."""
    ticks = cpu_ticks(pid)
    if ticks is None:
        raise ProcessLookupError(f"process {pid} is gone")
    return ticks / os.sysconf("SC_CLK_TCK")


def cpu_split(live: Sequence[int] = ()) -> tuple[float, float] | None:
    """(CPU seconds the whole machine has used, CPU seconds of this process,
    its reaped children and the ``live`` child pids): the difference of two
    calls, over the wall time between them, is how many CPUs other processes
    kept busy meanwhile.  None without ``/proc/stat``."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    tck = os.sysconf("SC_CLK_TCK")
    machine = (sum(ticks) - ticks[3] - ticks[4]) / tck  # all but idle and iowait
    t = os.times()
    ours = t.user + t.system + t.children_user + t.children_system
    return machine, ours + sum(cpu_ticks(p) or 0 for p in live) / tck
