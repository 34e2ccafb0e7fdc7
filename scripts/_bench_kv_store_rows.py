"""The block-level rows of ``bench_kv_store.py``, the same code for every side.

A *side* is anything with the ``Side`` methods below: rpcbuf's block tier
(same host and UCX, in ``bench_kv_store.py``), Mooncake Store's two clients
(``_bench_kv_store_mooncake.py``, run by Mooncake's own venv, which has numpy
but not rpcbuf: so this module imports numpy and the standard library only)
and a plain memcpy.  Each side hands out two registered regions (where it
puts from and gets into: Mooncake needs its buffers registered, its
same-host client needs them from its shared pool), and every block is a
slice of one of them.

The rows, each timed call by call (``time.perf_counter``, the collector
off) and summarised by its median:

* ``single``: one block of 256 KiB, 2 MiB and 16 MiB, put under a fresh key
  then got into the other region, ``ITERS`` times per size;
* ``batch``: 256 blocks of 256 KiB, put in one call and got in one call;
* ``hit``: one 4 KiB block got again and again (the latency of a hit);
* ``hold``: ``hold_n`` blocks of 16 KiB put in batches of 512 until all are
  in or ``hold_s`` seconds passed, then every key read back in batches of
  512: how many came back intact, the puts' and gets' blocks per second, and
  the holding process's open fds after the puts.

Every get is checked byte for byte here, whatever the side checks itself:
before each put the source is stamped (the first and last 8 bytes of each
block say which put it is), and before each get the target is filled with
the complement of what should come back (every byte differs), so a get
that left any byte untouched, or read another key's bytes, fails the row.
A failed check is an error of the side, reported in its row, never a number.
"""

from __future__ import annotations

import functools
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

KiB, MiB = 1 << 10, 1 << 20
SIZES = (256 * KiB, 2 * MiB, 16 * MiB)
ITERS = {256 * KiB: 30, 2 * MiB: 20, 16 * MiB: 8}
BATCH, BATCH_BLOCK, BATCH_ITERS = 256, 256 * KiB, 4
HIT_BYTES, HIT_ITERS = 4 * KiB, 300
HOLD_BLOCK, HOLD_BATCH = 16 * KiB, 512
REGION = BATCH * BATCH_BLOCK  # 64 MiB: the largest thing one call moves


class Side(Protocol):
    """One store as the rows drive it; every call raises on a failure."""

    name: str
    checks: str  # what the store itself verifies, in words

    def regions(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]: ...
    def put(self, keys: list[str], blocks: list[np.ndarray]) -> None: ...
    # Fills ``out[i]`` for each key it has; returns which it had.
    def get(self, keys: list[str], out: list[np.ndarray]) -> list[bool]: ...
    def remove(self, keys: list[str]) -> None: ...
    def server_fds(self) -> int | None: ...


class Mismatch(AssertionError):
    """A get that did not bring back what was put."""


def size_name(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def _stamp(rows: np.ndarray, ids: np.ndarray) -> None:
    """Write each id into its row's first and last 8 bytes (rows: n x size uint8)."""
    tag = ids.astype("<u8").view(np.uint8).reshape(-1, 8)
    rows[:, :8] = tag
    rows[:, -8:] = tag


def _rows(region: np.ndarray, n: int, size: int) -> np.ndarray:
    return region[:n * size].reshape(n, size)


def _check(what: str, got: np.ndarray, want: np.ndarray) -> None:
    if not np.array_equal(got, want):
        bad = np.flatnonzero((got != want).reshape(len(got), -1).any(axis=1))
        raise Mismatch(f"{what}: {len(bad)} of {len(got)} blocks came back different "
                       f"(first: #{int(bad[0])})")


def _timed(fn: Callable[..., Any], *args: Any) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


class Rows:
    """The rows for one side, its regions allocated once."""

    def __init__(self, side: Side, prefix: str, progress: Callable[[str], None]) -> None:
        self.side, self.prefix, self.say = side, prefix, progress
        self.src, self.dst = side.regions(REGION)
        self.src[:] = np.random.default_rng(40).integers(0, 256, REGION, dtype=np.uint8)
        self.dst[:] = 0
        self.serial = 0

    def _keys(self, what: str, n: int) -> list[str]:
        self.serial += 1
        return [f"{self.prefix}-{what}-{self.serial}-{i}" for i in range(n)]

    def _get_all(self, keys: list[str], out: list[np.ndarray], what: str) -> None:
        had = self.side.get(keys, out)
        if not all(had):
            raise Mismatch(f"{what}: {had.count(False)} of {len(keys)} keys missing")

    def single(self, size: int) -> dict[str, Any]:
        src, dst = _rows(self.src, 1, size), _rows(self.dst, 1, size)
        puts, gets, keys = [], [], []
        for i in range(ITERS[size]):
            _stamp(src, np.array([self.serial * 1000 + i]))
            key = self._keys(size_name(size), 1)
            keys += key
            puts.append(_timed(self.side.put, key, [src[0]]))
            np.invert(src, out=dst)  # every byte differs until the get writes it
            gets.append(_timed(self._get_all, key, [dst[0]], size_name(size)))
            _check(f"{size_name(size)} get", dst, src)
        self.side.remove(keys)
        return {"put_ms": statistics.median(puts) * 1e3, "get_ms": statistics.median(gets) * 1e3,
                "iters": len(puts), "nbytes": size}

    def batch(self) -> dict[str, Any]:
        src, dst = _rows(self.src, BATCH, BATCH_BLOCK), _rows(self.dst, BATCH, BATCH_BLOCK)
        puts, gets = [], []
        for it in range(BATCH_ITERS):
            _stamp(src, np.arange(BATCH) + (self.serial * 1000 + it) * BATCH)
            keys = self._keys("batch", BATCH)
            puts.append(_timed(self.side.put, keys, list(src)))
            np.invert(src, out=dst)
            gets.append(_timed(self._get_all, keys, list(dst), "batch"))
            _check("batch get", dst, src)
            self.side.remove(keys)
        return {"put_ms": statistics.median(puts) * 1e3, "get_ms": statistics.median(gets) * 1e3,
                "iters": len(puts), "blocks": BATCH, "block_nbytes": BATCH_BLOCK}

    def hit(self) -> dict[str, Any]:
        src, dst = _rows(self.src, 1, HIT_BYTES), _rows(self.dst, 1, HIT_BYTES)
        _stamp(src, np.array([7]))
        key = self._keys("hit", 1)
        self.side.put(key, [src[0]])
        gets = []
        for _ in range(HIT_ITERS):
            np.invert(src, out=dst)
            gets.append(_timed(self._get_all, key, [dst[0]], "hit"))
            _check("hit get", dst, src)
        self.side.remove(key)
        return {"get_us": statistics.median(gets) * 1e6, "iters": len(gets),
                "nbytes": HIT_BYTES}

    def hold(self, n: int, seconds: float) -> dict[str, Any]:
        """Put up to ``n`` 16 KiB blocks within ``seconds``, read every one back."""
        per = HOLD_BATCH
        slots = REGION // HOLD_BLOCK  # the source rows cycle through the region
        src = _rows(self.src, slots, HOLD_BLOCK)
        dst = _rows(self.dst, per, HOLD_BLOCK)
        keys = [f"{self.prefix}-hold-{i}" for i in range(n)]
        put_done, put_s, why = 0, 0.0, ""
        deadline = time.monotonic() + seconds
        while put_done < n:
            if time.monotonic() > deadline:
                why = f"stopped putting after {seconds:.0f} s"
                break
            ids = np.arange(put_done, min(n, put_done + per))
            rows = src[ids % slots]
            _stamp(rows, ids)
            src[ids % slots] = rows
            try:
                put_s += _timed(self.side.put, [keys[i] for i in ids],
                                [src[i % slots] for i in ids])
            except Exception as exc:  # the side's refusal is the row's answer
                why = f"put of #{put_done} failed: {type(exc).__name__}: {exc}"[:300]
                break
            put_done += len(ids)
            if put_done % 20_000 < per:
                self.say(f"{self.side.name}: {put_done:,} blocks put")
        fds = self.side.server_fds()
        held = corrupt = 0
        get_s = 0.0
        read_deadline = time.monotonic() + seconds
        for start in range(0, put_done, per):
            if time.monotonic() > read_deadline:
                why = (why + "; " if why else "") + f"stopped reading after {seconds:.0f} s"
                break
            ids = np.arange(start, min(put_done, start + per))
            want = src[ids % slots].copy()
            _stamp(want, ids)
            np.invert(want, out=dst[:len(ids)])
            out = list(dst[:len(ids)])
            t0 = time.perf_counter()
            had = self.side.get([keys[i] for i in ids], out)
            get_s += time.perf_counter() - t0
            ok = np.array(had, dtype=bool)
            same = (dst[:len(ids)] == want).all(axis=1)
            held += int((ok & same).sum())
            corrupt += int((ok & ~same).sum())
        self.side.remove(keys[:put_done])
        gc.collect()
        return {"asked": n, "put": put_done, "held": held, "corrupt": corrupt,
                "lost": put_done - held - corrupt if "reading" not in why else None,
                "fds": fds, "put_blocks_s": put_done / put_s if put_s else None,
                "get_blocks_s": put_done / get_s if get_s else None,
                "block_nbytes": HOLD_BLOCK, "batch": per, "why": why}


def run_side(side: Side, prefix: str, hold_n: int, hold_s: float,
             progress: Callable[[str], None]) -> dict[str, Any]:
    """Every row for one side: ``{"single": {size: ...}, "batch", "hit", "hold",
    "checks"}``; a row that fails carries ``{"error": ...}`` instead."""
    out: dict[str, Any] = {"checks": side.checks, "single": {}}
    try:
        rows = Rows(side, prefix, progress)
    except Exception as exc:
        return {**out, "error": f"{type(exc).__name__}: {exc}"[:300]}

    def guarded(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        gc.disable()
        try:
            return fn()
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            gc.enable()

    for size in SIZES:
        progress(f"{side.name}: {size_name(size)} put and get ...")
        out["single"][size_name(size)] = guarded(functools.partial(rows.single, size))
    progress(f"{side.name}: {BATCH} x {size_name(BATCH_BLOCK)} batches ...")
    out["batch"] = guarded(rows.batch)
    out["hit"] = guarded(rows.hit)
    if hold_n > 0:
        progress(f"{side.name}: holding {hold_n:,} x {size_name(HOLD_BLOCK)} ...")
        out["hold"] = guarded(functools.partial(rows.hold, hold_n, hold_s))
    return out


class Memcpy:
    """The floor: numpy copies into and out of a warm pool, in this process
    (a put copies into the pool's next free bytes, a get copies back out)."""

    name = "memcpy"
    checks = "nothing (a copy)"

    def __init__(self) -> None:
        self.pool = np.ones(REGION, np.uint8)  # faulted once, as a store's warm pages
        self.at: dict[str, tuple[int, int]] = {}
        self.next = 0

    def regions(self, nbytes: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(nbytes, np.uint8), np.zeros(nbytes, np.uint8)

    def put(self, keys: list[str], blocks: list[np.ndarray]) -> None:
        for k, b in zip(keys, blocks, strict=True):
            if self.next + b.nbytes > REGION:
                self.next = 0  # the rows read each key back before it wraps
            np.copyto(self.pool[self.next:self.next + b.nbytes], b)
            self.at[k] = (self.next, b.nbytes)
            self.next += b.nbytes

    def get(self, keys: list[str], out: list[np.ndarray]) -> list[bool]:
        for k, o in zip(keys, out, strict=True):
            off, n = self.at[k]
            np.copyto(o, self.pool[off:off + n])
        return [True] * len(keys)

    def remove(self, keys: list[str]) -> None:
        for k in keys:
            self.at.pop(k, None)

    def server_fds(self) -> int | None:
        return None
