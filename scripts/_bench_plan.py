"""How much ``bench.py`` measures (``FULL``, or ``QUICK`` with ``--quick``) and the
sizes and goals its rows name (DESIGN.md "Performance goals").

Every other ``_bench_*`` module reads its counts from a ``Plan`` and its
sizes from here, so the full and quick runs measure the same rows with the
same inputs, only fewer times.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchkit import KiB, MiB

SECTIONS = ("data", "control", "batching", "idle")  # what --only can name

@dataclass(frozen=True)
class Plan:
    """How much to measure; ``--quick`` takes the small one."""

    iters: dict[int, int]  # payload size -> timed iterations per op
    warmup: dict[int, int]
    rounds: int  # alternating rpcbuf/reference rounds per measurement
    control_pairs: int
    pipelined_pairs: int
    concurrency: int
    batch_reps: int  # timed repetitions of each batched op (and of its reference)
    batch_warmup: int
    naive_tensors: int  # tensors the timed naive loop stores (scaled to BATCH_TENSORS)
    naive_reps: int
    idle_seconds: float  # how long the daemon's idle CPU is measured


FULL = Plan(iters={4 * KiB: 3000, 1 * MiB: 300, 64 * MiB: 30},
            warmup={4 * KiB: 200, 1 * MiB: 20, 64 * MiB: 3},
            rounds=10, control_pairs=3000, pipelined_pairs=20000, concurrency=64,
            batch_reps=7, batch_warmup=2, naive_tensors=10_000, naive_reps=3,
            idle_seconds=3.0)
QUICK = Plan(iters={4 * KiB: 300, 1 * MiB: 40, 64 * MiB: 6},
             warmup={4 * KiB: 50, 1 * MiB: 5, 64 * MiB: 2},
             rounds=4, control_pairs=300, pipelined_pairs=2000, concurrency=64,
             batch_reps=3, batch_warmup=1, naive_tensors=2_000, naive_reps=1,
             idle_seconds=1.5)
BATCH_TENSORS = 10_000  # the batch: 10,000 tensors of 4 KiB
BATCH_TENSOR_BYTES = 4 * KiB
ONE_TENSOR_BYTES = 40 * MiB  # the reference: "one 40 MiB tensor"
RTT_BYTES = 40  # the raw socket round trip the 4 KiB store is held against
BIG = 64 * MiB  # the size the throughput goals name
IDLE_GOAL_PERCENT = 2.0  # "daemon idle: ~0 % CPU": met below this share of one core
PIPELINED_GOAL = 20_000  # request+release ops/s, pipelined on one connection
