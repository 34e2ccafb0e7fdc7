"""Allocator benchmark: a model-serving trace replayed against every allocator.

Run as ``.venv/bin/python scripts/bench_alloc.py [--json bench_alloc.json] [--quick]``.

The trace (docs/allocators.md explains the choices) is closed-loop and seeded:
each allocator gets the same random stream, and the streams part only where
allocators fail at different moments.  One pool, scaled down by ``--scale``
(256 by default) from 192 GiB, serves in turn:

1. Llama-2-7B weights, then KV-cache churn for it;
2. Llama-2-13B weights beside it, churn for both;
3. the 7B unloaded (its KV dropped), Llama-2-70B loaded, churn for 13B + 70B;
4. the 13B unloaded (its KV dropped; the 70B loaded now if it did not fit
   before), churn for the 70B;
5. four in five sequences released at random, the 70B still loaded: the
   state in which "largest free block after churn" is measured.

Weights are one buffer per tensor (fp16, checkpoint order), their sizes
divided by the scale like the pool.  KV cache is vLLM-style pages of 16 tokens
of one layer (256 KiB for the 7B, 320 KiB for the 13B, 64 KiB for the GQA 70B)
at their real size; a sequence of L tokens holds ceil(L / 16) x layers / scale
pages, so the pool holds as many sequences as the unscaled pool would, with
pages that are ``scale`` times coarser.  Each sequence also holds three small
buffers at their real size (token ids, block table, one row of fp16 logits).
A churn step starts a sequence (40%), grows one by 256 tokens (20%), reuses
one (25%: it becomes most recently used) or releases one (15%).  When an
allocation fails the least recently used sequences are evicted until it fits
(weights are never evicted); a request that cannot fit in an otherwise empty
pool is dropped, and a model that cannot load is counted as a failed load.

Reported per allocator: peak utilisation (requested bytes live / pool bytes at
the first failed allocation), mean utilisation after every churn step (the
cache runs full most of the time: how much of the pool it really gets; the
mean at failed allocations is in the JSON too), the largest free block after churn (as a share of
the free bytes: 100% means no fragmentation), failed model loads, the trace's
operations and operations per second (allocate and free calls only, timed one
by one), and the time of 1,000,000 mixed allocate/free calls on a 1 GiB arena
(200,000 with ``--quick``).  Timings are the best of three rounds (one with
``--quick``) in which the allocators alternate; the garbage collector is off
while timing.  Output: an aligned table on stdout, every number
as JSON at ``--json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rpcbuf.dataplane.allocator import Allocator
from rpcbuf.dataplane.allocators import ALLOCATORS, make_allocator

GiB = 1 << 30
POOL_BYTES = 192 * GiB  # before scaling: the 70B's 128 GiB of weights plus 64 GiB
PAGE_TOKENS = 16
GROW_TOKENS = 256
KEEP_AFTER_CHURN = 0.2


@dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    intermediate: int
    layers: int
    kv_heads: int
    head_dim: int = 128
    vocab: int = 32000

    def tensors(self) -> list[int]:
        """Bytes of every weight tensor (fp16), in checkpoint order."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        layer = [h * h, kv * h, kv * h, h * h,  # q, k, v, o
                 self.intermediate * h, self.intermediate * h, h * self.intermediate,  # mlp
                 h, h]  # the two norms
        shapes = [self.vocab * h, *layer * self.layers, h, self.vocab * h]
        return [2 * n for n in shapes]

    @property
    def page_bytes(self) -> int:
        """One layer's K and V for PAGE_TOKENS tokens, fp16."""
        return PAGE_TOKENS * 2 * self.kv_heads * self.head_dim * 2


MODELS = {
    "7B": Model("llama-2-7b", 4096, 11008, 32, 32),
    "13B": Model("llama-2-13b", 5120, 13824, 40, 40),
    "70B": Model("llama-2-70b", 8192, 28672, 80, 8),
}


@dataclass(frozen=True)
class Plan:
    steps: int  # churn steps per phase
    mixed_ops: int  # the plain allocate/free loop
    rounds: int  # timing rounds, allocators alternating; the best one counts


FULL = Plan(steps=15_000, mixed_ops=1_000_000, rounds=3)
QUICK = Plan(steps=1_500, mixed_ops=200_000, rounds=1)


@dataclass
class Seq:
    model: str
    tokens: int
    bufs: list[tuple[int, int]] = field(default_factory=list)  # (offset, requested size)


class Trace:
    """One allocator driven through the phases; counts and times every call."""

    def __init__(self, name: str, scale: int, seed: int) -> None:
        self.alloc: Allocator = make_allocator(name, POOL_BYTES // scale)
        self.scale = scale
        self.rng = random.Random(seed)
        self.phase = ""
        self.requested = 0  # bytes asked for by live buffers
        self.ops = 0
        self.ns = 0
        self.first_failure: dict[str, Any] | None = None
        self.failure_utils: list[float] = []
        self.util_sum = 0.0  # requested / total after every churn step
        self.util_steps = 0
        self.evicted = 0
        self.dropped = 0
        self.failed_loads: list[str] = []
        self.weights: dict[str, list[tuple[int, int]]] = {}
        self.seqs: OrderedDict[int, Seq] = OrderedDict()  # least recently used first
        self.ids: list[int] = []  # the same sequences, for O(1) random picks
        self.pos: dict[int, int] = {}
        self.next_id = 0

    # -- timed allocator calls -------------------------------------------------

    def _allocate(self, size: int) -> int | None:
        t = time.perf_counter_ns()
        off = self.alloc.allocate(size)
        self.ns += time.perf_counter_ns() - t
        self.ops += 1
        if off is not None:
            self.requested += size
        return off

    def _free(self, off: int, size: int) -> None:
        t = time.perf_counter_ns()
        self.alloc.free(off)
        self.ns += time.perf_counter_ns() - t
        self.ops += 1
        self.requested -= size

    def _failed(self, size: int) -> None:
        util = self.requested / self.alloc.total
        self.failure_utils.append(util)
        if self.first_failure is None:
            self.first_failure = {"phase": self.phase, "size": size, "utilisation": util,
                                  "allocator_used": self.alloc.stats().used / self.alloc.total}

    def allocate(self, size: int, protect: int | None = None) -> int | None:
        """Allocate, evicting least recently used sequences (never ``protect``) until it fits."""
        off = self._allocate(size)
        if off is None:
            self._failed(size)
        while off is None:
            if not self._evict_lru(protect):
                return None
            off = self._allocate(size)
        return off

    # -- sequences ---------------------------------------------------------------

    def _add(self, seq: Seq) -> int:
        sid = self.next_id
        self.next_id += 1
        self.seqs[sid] = seq
        self.pos[sid] = len(self.ids)
        self.ids.append(sid)
        return sid

    def _drop(self, sid: int) -> None:
        seq = self.seqs.pop(sid)
        i = self.pos.pop(sid)
        last = self.ids.pop()
        if last != sid:
            self.ids[i] = last
            self.pos[last] = i
        for off, size in seq.bufs:
            self._free(off, size)

    def _evict_lru(self, protect: int | None) -> bool:
        for sid in self.seqs:  # the first, or the second when the first is protected
            if sid != protect:
                self._drop(sid)
                self.evicted += 1
                return True
        return False

    def _pages(self, model: Model, tokens: int) -> int:
        """Pages for ``tokens`` more tokens, scaled, rounded at random so the mean is exact."""
        exact = math.ceil(tokens / PAGE_TOKENS) * model.layers / self.scale
        n = int(exact)
        return n + (self.rng.random() < exact - n)

    def _fill(self, seq: Seq, sizes: list[int], protect: int | None) -> bool:
        for size in sizes:
            off = self.allocate(size, protect)
            if off is None:
                return False
            seq.bufs.append((off, size))
        return True

    def new_sequence(self, name: str) -> None:
        model = MODELS[name]
        tokens = min(32768, max(16, int(self.rng.lognormvariate(math.log(1024), 1.0))))
        pages = max(1, self._pages(model, tokens))
        small = [4 * tokens, 4 * (-(-tokens // PAGE_TOKENS)), 2 * model.vocab]
        seq = Seq(name, tokens)
        if self._fill(seq, [*small, *[model.page_bytes] * pages], None):
            self._add(seq)
        else:  # cannot fit even in an empty cache: give back what it got
            self.dropped += 1
            for off, size in seq.bufs:
                self._free(off, size)

    def step(self, models: list[str]) -> None:
        r = self.rng.random()
        if r < 0.40 or not self.ids:
            self.new_sequence(self.rng.choice(models))
        elif r < 0.60:  # decode: the sequence grows
            sid = self.ids[self.rng.randrange(len(self.ids))]
            self.seqs.move_to_end(sid)
            seq = self.seqs[sid]
            model = MODELS[seq.model]
            seq.tokens += GROW_TOKENS
            self._fill(seq, [model.page_bytes] * self._pages(model, GROW_TOKENS), sid)
        elif r < 0.85:  # prefix-cache hit: most recently used again
            self.seqs.move_to_end(self.ids[self.rng.randrange(len(self.ids))])
        else:  # released by its client
            self._drop(self.ids[self.rng.randrange(len(self.ids))])

    # -- models ------------------------------------------------------------------

    def load(self, name: str) -> bool:
        bufs: list[tuple[int, int]] = []
        for real in MODELS[name].tensors():
            size = max(1, real // self.scale)
            off = self.allocate(size)
            if off is None:
                self.failed_loads.append(f"{name} in {self.phase}")
                for o, s in bufs:
                    self._free(o, s)
                return False
            bufs.append((off, size))
        self.weights[name] = bufs
        return True

    def unload(self, name: str) -> None:
        for off, size in self.weights.pop(name, []):
            self._free(off, size)
        for sid in [sid for sid, seq in self.seqs.items() if seq.model == name]:
            self._drop(sid)

    def churn(self, steps: int) -> None:
        models = sorted(self.weights)
        total = self.alloc.total
        for _ in range(steps if models else 0):
            self.step(models)
            self.util_sum += self.requested / total
            self.util_steps += 1

    def run(self, steps: int) -> dict[str, Any]:
        self.phase = "7B"
        self.load("7B")
        self.churn(steps)
        self.phase = "7B+13B"
        self.load("13B")
        self.churn(steps)
        self.phase = "13B+70B"
        self.unload("7B")
        self.load("70B")
        self.churn(steps)
        self.phase = "70B"
        self.unload("13B")
        if "70B" not in self.weights:
            self.load("70B")
        self.churn(steps)
        self.phase = "after churn"
        keep = set(self.rng.sample(self.ids, int(len(self.ids) * KEEP_AFTER_CHURN)))
        for sid in [sid for sid in self.seqs if sid not in keep]:
            self._drop(sid)
        after = self.alloc.stats()
        self.alloc.check_invariants()
        for name in list(self.weights):
            self.unload(name)
        for sid in list(self.seqs):
            self._drop(sid)
        end = self.alloc.stats()
        assert end.used == 0 and self.requested == 0, "the trace leaked"
        self.alloc.check_invariants()
        first = self.first_failure or {}
        return {
            "peak_utilisation": first.get("utilisation"),
            "first_failure": first,
            "mean_utilisation_in_churn": self.util_sum / max(1, self.util_steps),
            "mean_utilisation_at_failure": (sum(self.failure_utils) / len(self.failure_utils)
                                            if self.failure_utils else None),
            "failed_allocations": len(self.failure_utils),
            "after_churn": {**after.as_dict(), "largest_free_share": 1 - after.fragmentation},
            "failed_loads": self.failed_loads,
            "evicted_sequences": self.evicted,
            "dropped_sequences": self.dropped,
            "trace_ops": self.ops,
            "largest_free_when_empty": end.largest_free,
        }


def mixed_ops(name: str, n: int, seed: int) -> float:
    """Seconds for ``n`` random allocate/free calls (half each) on a 1 GiB arena."""
    a, rng = make_allocator(name, GiB), random.Random(seed)
    live: list[int] = []
    sizes = [256, 1000, 4096, 20_000, 65536, 300_000, 1 << 20]
    start = time.perf_counter()
    for _ in range(n):
        if live and rng.random() < 0.5:
            i = rng.randrange(len(live))
            live[i], live[-1] = live[-1], live[i]
            a.free(live.pop())
        else:
            off = a.allocate(rng.choice(sizes))
            if off is not None:
                live.append(off)
    elapsed = time.perf_counter() - start
    for off in live:
        a.free(off)
    a.check_invariants()
    return elapsed


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def format_table(results: dict[str, dict[str, Any]], mixed_n: int) -> str:
    head = ["allocator", "peak util", "mean util in churn", "largest free after churn",
            "failed loads", "trace ops", "trace ops/s", f"{mixed_n:,} mixed ops"]
    rows = [head]
    for name, r in results.items():
        after = r["after_churn"]
        rows.append([
            name,
            pct(r["peak_utilisation"]),
            pct(r["mean_utilisation_in_churn"]),
            f"{pct(after['largest_free_share'])} of free",
            str(len(r["failed_loads"])),
            f"{r['trace_ops']:,}",
            f"{r['trace_ops_per_s']:,.0f}",
            f"{r['mixed_ops_seconds']:.2f} s",
        ])
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w)
                       for i, (cell, w) in enumerate(zip(row, widths, strict=True)))
             for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def progress(msg: str) -> None:
    print(f"[bench_alloc] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", default="bench_alloc.json",
                   help="write every number here [%(default)s]")
    p.add_argument("--quick", action="store_true", help="a tenth of the churn, 200k mixed ops")
    p.add_argument("--scale", type=int, default=256,
                   help="divide the pool and the weights by this [%(default)s]")
    p.add_argument("--seed", type=int, default=1, help="random seed [%(default)s]")
    args = p.parse_args(argv)
    plan = QUICK if args.quick else FULL
    started = time.time()
    outcomes: dict[str, dict[str, Any]] = {}
    rates: dict[str, list[float]] = {name: [] for name in ALLOCATORS}
    mixed: dict[str, list[float]] = {name: [] for name in ALLOCATORS}
    gc.disable()  # no collector pauses inside the timed calls
    try:
        for rnd in range(plan.rounds):  # alternate, so drift on a busy machine hits all alike
            for name in ALLOCATORS:
                t = time.perf_counter()
                trace = Trace(name, args.scale, args.seed)
                outcome = trace.run(plan.steps)
                # The trace is deterministic: later rounds only re-time it.
                assert outcomes.setdefault(name, outcome) == outcome, "trace not deterministic"
                rates[name].append(trace.ops / (trace.ns / 1e9))
                mixed[name].append(mixed_ops(name, plan.mixed_ops, args.seed))
                gc.collect()
                progress(f"round {rnd + 1}/{plan.rounds} {name}: {time.perf_counter() - t:.1f} s")
    finally:
        gc.enable()
    results = {name: {**outcomes[name],
                      "trace_ops_per_s": max(rates[name]), "trace_ops_per_s_rounds": rates[name],
                      "mixed_ops_seconds": min(mixed[name]),
                      "mixed_ops_seconds_rounds": mixed[name]}
               for name in ALLOCATORS}
    print(f"pool {POOL_BYTES // GiB} GiB / {args.scale} = {POOL_BYTES // args.scale / 2**20:.0f} "
          f"MiB; {plan.steps:,} churn steps per phase; seed {args.seed}")
    print(format_table(results, plan.mixed_ops))
    for name, r in results.items():
        if r["failed_loads"]:
            print(f"{name}: could not load {', '.join(r['failed_loads'])}")
    report = {
        "meta": {
            "started_at": started,
            "seconds": time.time() - started,
            "quick": args.quick,
            "scale": args.scale,
            "seed": args.seed,
            "pool_bytes_unscaled": POOL_BYTES,
            "pool_bytes": POOL_BYTES // args.scale,
            "churn_steps_per_phase": plan.steps,
            "mixed_ops": plan.mixed_ops,
            "models": {k: {"name": m.name, "weight_bytes": sum(m.tensors()),
                           "tensors": len(m.tensors()), "page_bytes": m.page_bytes}
                       for k, m in MODELS.items()},
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        },
        "allocators": results,
    }
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    progress(f"wrote {args.json} ({report['meta']['seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
