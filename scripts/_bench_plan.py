"""How much ``bench.py`` measures (``FULL``, or ``QUICK`` with ``--quick``) and the
sizes and goals its rows name.

Every other ``_bench_*`` module reads its counts from a ``Plan`` and its
sizes from here, so the full and quick runs measure the same rows with the
same inputs, only fewer times.  The goals are the first round's (DESIGN.md
"Performance goals" as it stood then) and issue 15's (performance round 2),
which adds to them without replacing any: a ``Goal`` says which
(``source``), and the table prints issue 15's with "(15)".
``bench_peers.py``'s goals (the ones that need a peer) use the same ``Goal``.
"""

from __future__ import annotations

from dataclasses import dataclass

from benchkit import KiB, MiB

SECTIONS = ("data", "control", "batching", "idle")  # what --only can name

@dataclass(frozen=True)
class Goal:
    """A ratio goal, rpcbuf / reference: at most ``x`` (a time: lower is
    better) or at least ``x`` (a throughput).  ``source`` is "" for
    DESIGN.md's goals and the issue's number for an issue's."""

    at_most: bool
    x: float
    source: str = ""

    def text(self) -> str:
        """``<= 0.5x (15)``: what the table's goal column says."""
        tag = f" ({self.source})" if self.source else ""
        return f"{'<=' if self.at_most else '>='} {self.x:g}x{tag}"

    def met(self, ratio: float) -> bool:
        return ratio <= self.x if self.at_most else ratio >= self.x


def at_most(x: float, source: str = "") -> Goal:
    return Goal(True, x, source)


def at_least(x: float, source: str = "") -> Goal:
    return Goal(False, x, source)


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
SMALL = 4 * KiB  # the size the latency goals name
BIG = 64 * MiB  # the size the throughput goals name
IDLE_GOAL_PERCENT = 2.0  # "daemon idle: ~0 % CPU": met below this share of one core
PIPELINED_GOAL = 20_000  # request+release ops/s, pipelined on one connection

# The first round's (DESIGN.md "Performance goals" as it stood then)
TCP_VS_UCXX = at_least(0.9)  # 64 MiB store and read over tcp / raw ucxx (issue 15 repeats it)
TCP_VS_SOCKET = at_least(1.5)  # 64 MiB over tcp / the raw blocking socket
SAME_HOST_VS_COPY = at_least(0.6)  # 64 MiB same-host / np.copyto
SMALL_VS_RTT = at_most(2.0)  # 4 KiB store p50 / the raw socket's 40-byte round trip
PAIR_VS_ECHO = at_most(2.0)  # request+release pair p50 / two echos
BATCH_VS_ONE = at_most(3.0)  # 10,000 x 4 KiB store_tensors / one 40 MiB store
BATCH_VS_STREAM = at_least(0.5)  # the same / the raw socket streaming its bytes
# Issue 15 (performance round 2), measured the same way
SMALL_VS_UCXX_15 = at_most(1.5, "15")  # 4 KiB store+ack p50 over tcp / raw ucxx send+ack
SAME_HOST_VS_TCP_15 = at_most(0.5, "15")  # 4 KiB store p50 same-host / over tcp
SAME_HOST_VS_COPY_15 = at_least(1.0, "15")  # 64 MiB same-host / np.copyto
PIPELINED_VS_ECHO_15 = at_least(0.8, "15")  # pipelined request+release / pipelined echos
# Issue 35 (performance round 3): the owner's stores and reads in place
SAME_HOST_VS_COPY_35 = at_least(0.9, "35")  # 1 MiB same-host / np.copyto
SMALL_VS_COPY_35 = at_most(12.5, "35")  # 4 KiB store p50 same-host / np.copyto's (0.08 x)
