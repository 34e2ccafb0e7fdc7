"""What both ends of every peer in ``bench_peers.py`` share: roles, the plan, timing, results.

A peer (Mooncake's transfer engine, NIXL) runs as two processes under its
own virtualenv's python, never importing rpcbuf: a *target* that registers
one pre-touched buffer, publishes what the initiator needs in a ready file
(JSON, written atomically) and then only stays alive, and an *initiator*
that reads it, registers its own buffer, runs the plan and writes every
sample (seconds) as JSON to ``--out``.  This module holds that frame with
the standard library and numpy only (the peers' venvs have nothing else of
ours); each peer's module supplies the two roles' bodies.

Everything is bounded: the target lives until SIGTERM, its parent's exit
or ``--deadline`` seconds; the initiator checks ``Clock.check()`` before
each operation and gives up after ``--deadline`` seconds; the parent kills
both after its own bound anyway.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
SMALL, MID, BIG = 4 * KiB, 1 * MiB, 64 * MiB  # the sizes every row names
BATCH_ITEMS, BATCH_ITEM_BYTES = 10_000, 4 * KiB  # the batch
REGION = BIG  # each side's registered buffer: holds 64 MiB and the 40,960,000-byte batch


@dataclass(frozen=True)
class PeerPlan:
    """How many timed operations of each kind (the parent passes it as JSON)."""

    small: int = 2000
    small_warm: int = 200
    mid: int = 200
    mid_warm: int = 20
    big: int = 15
    big_warm: int = 3
    batch: int = 5
    batch_warm: int = 1


class Clock:
    """The initiator's bound: ``check()`` raises TimeoutError past the deadline."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def check(self) -> None:
        if time.monotonic() > self.deadline:
            raise TimeoutError("the initiator ran past its deadline")


def timed(op: Callable[[], object], iters: int, clock: Clock) -> list[float]:
    """Seconds each of ``iters`` calls of ``op()`` took."""
    samples = []
    now = time.perf_counter
    for _ in range(iters):
        clock.check()
        t0 = now()
        op()
        samples.append(now() - t0)
    return samples


def region() -> np.ndarray:
    """One pre-touched ``REGION``-byte buffer (random bytes: nothing compresses)."""
    return np.random.default_rng(0).integers(0, 256, REGION, dtype=np.uint8)


def write_json_atomic(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.write("\n")
    os.replace(tmp, path)


def read_ready(path: str, timeout: float = 60.0) -> dict[str, Any]:
    """The target's ready file, polled for up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(path) as f:
                text = f.read()
            if text.endswith("\n"):
                return dict(json.loads(text))
        except OSError:
            pass
        time.sleep(0.02)
    raise TimeoutError(f"no ready file at {path} after {timeout:.0f} s")


def stay_alive(seconds: float) -> None:
    """The target's life after publishing: until SIGTERM, its parent's exit or ``seconds``."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    parent, deadline = os.getppid(), time.monotonic() + seconds
    while not stop and os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.2)


Target = Callable[[argparse.Namespace], None]
Initiator = Callable[[argparse.Namespace, PeerPlan, Clock], dict[str, Any]]


def main(peer: str, target: Target, initiator: Initiator) -> None:
    """Parse the command line and run one role of ``peer``."""
    p = argparse.ArgumentParser(description=f"bench_peers: one end of {peer}")
    p.add_argument("role", choices=("target", "initiator"))
    p.add_argument("--ready-file", required=True,
                   help="the target writes it; the initiator reads it")
    p.add_argument("--out", help="initiator: the results' JSON file")
    p.add_argument("--plan", default="{}", help="initiator: PeerPlan fields as JSON")
    p.add_argument("--deadline", type=float, default=300.0, help="seconds this end may live")
    args = p.parse_args()
    if args.role == "target":
        target(args)
    else:
        clock = Clock(args.deadline)
        plan = PeerPlan(**json.loads(args.plan))
        started = time.monotonic()
        results = initiator(args, plan, clock)
        results["seconds"] = time.monotonic() - started
        results["python"] = sys.version.split()[0]
        write_json_atomic(args.out, results)
    # Skip the interpreter's teardown: NIXL 1.5.1's agent segfaults in it
    # (after the work is done and written), which would read as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
