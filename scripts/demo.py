"""End-to-end demo: start a real rpcbufd, push a small transformer's weights through it.

Stores every tensor of a 4-layer toy transformer into one buffer (checksum-verified),
reads each back, checks the pool is whole again after release, prints a table and stops
the daemon cleanly.  Run: ``.venv/bin/python scripts/demo.py`` (what ``make run`` does).

The store column times the stores (each verified by the daemon's checksum); the read
column times the reads alone, into arrays allocated and touched before the clock
starts, and the comparison with what was stored comes after it.  The first line says
which data path the client got, and why not the same-host one if the daemon refused it
(it does when it runs as root).  The daemon comes from ``benchkit.procs.Daemon``.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

import benchkit

benchkit.loopback_ucx_env()  # before anything imports ucxx

import numpy as np  # noqa: E402
import uvloop  # noqa: E402

import rpcbuf  # noqa: E402
from benchkit.procs import Daemon, tail  # noqa: E402

VOCAB, HIDDEN, FFN, LAYERS, ALIGN = 32000, 512, 1376, 4, 256
RUN_TIMEOUT = 120.0  # a bound on the whole demo, whatever happens
Tensors = dict[str, list[tuple[str, np.ndarray]]]


def build_model(seed: int = 0) -> Tensors:
    """Random float16 weights, grouped as embedding / layer N / final."""
    rng = np.random.default_rng(seed)

    def t(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32).astype(np.float16)

    groups: Tensors = {"embedding": [("embed_tokens", t(VOCAB, HIDDEN))]}
    for i in range(LAYERS):
        groups[f"layer {i}"] = [(f"layers.{i}.{n}", t(*s)) for n, s in (
            ("attn.q", (HIDDEN, HIDDEN)), ("attn.k", (HIDDEN, HIDDEN)),
            ("attn.v", (HIDDEN, HIDDEN)), ("attn.o", (HIDDEN, HIDDEN)),
            ("mlp.up", (HIDDEN, FFN)), ("mlp.gate", (HIDDEN, FFN)), ("mlp.down", (FFN, HIDDEN)),
            ("input_norm", (HIDDEN,)), ("post_attn_norm", (HIDDEN,)))]
    groups["final"] = [("norm", t(HIDDEN)), ("lm_head", t(VOCAB, HIDDEN))]
    return groups


async def run(addr: str, token: str) -> None:
    groups = build_model()
    offsets, size = {}, 0
    for name, arr in (t for tensors in groups.values() for t in tensors):
        offsets[name], size = size, size + -(-arr.nbytes // ALIGN) * ALIGN
    rows: list[tuple[str, int, int, float, float, bool]] = []
    async with asyncio.timeout(RUN_TIMEOUT), rpcbuf.connect(addr, token=token) as ctx:
        free0 = sum(int(d["free"]) for d in await ctx.list_devices())
        buf = await ctx.request_buffer(size, name="demo-model")
        t_all = time.perf_counter()
        for group, tensors in groups.items():
            t0 = time.perf_counter()
            for name, arr in tensors:
                await ctx.store_tensor(buf, arr, offset=offsets[name], verify="checksum")
            t1 = time.perf_counter()
            # Only the reads are timed: into arrays allocated (and their pages
            # touched) before, compared after.
            backs = [np.zeros_like(arr) for _, arr in tensors]
            t2 = time.perf_counter()
            for (name, _), back in zip(tensors, backs, strict=True):
                await ctx.read_buffer(buf, offset=offsets[name], out=back)
            t3 = time.perf_counter()
            ok = all(np.array_equal(back, arr) for (_, arr), back in zip(tensors, backs,
                                                                          strict=True))
            ok &= await ctx.verify_write(buf, offsets[tensors[-1][0]], tensors[-1][1])
            nbytes = sum(a.nbytes for _, a in tensors)
            rows.append((group, len(tensors), nbytes, (t1 - t0) * 1e3, (t3 - t2) * 1e3, ok))
        elapsed = time.perf_counter() - t_all
        same_host = ctx.same_host
        why = ctx.hello.get("same_host_why")
        meta = await ctx.get_buffer_meta(buf)
        await ctx.release_buffer(buf)
        free1 = sum(int(d["free"]) for d in await ctx.list_devices())
    path = ("same-host (shared memory: a staging area the daemon made)" if same_host
            else "UCX (tcp)" + (f"; same-host refused: {why}" if why else ""))
    print(f"buffer {buf}: {meta.get('size')} bytes on {meta.get('device_type')}; data path: {path}")
    head = f"{'group':<10} {'tensors':>7} {'bytes':>12} {'store ms':>9} {'read ms':>9}  verified"
    print(head, "-" * len(head), sep="\n")
    for g, n, b, s, r, ok in rows:
        print(f"{g:<10} {n:>7} {b:>12,} {s:>9.1f} {r:>9.1f}  {'ok' if ok else 'FAILED'}")
    total = sum(r[2] for r in rows)
    st, rd = sum(r[3] for r in rows), sum(r[4] for r in rows)
    print("-" * len(head))
    print(f"{'total':<10} {sum(r[1] for r in rows):>7} {total:>12,} {st:>9.1f} {rd:>9.1f}  "
          f"store {total / st / 1e6:.2f} GB/s, read {total / rd / 1e6:.2f} GB/s "
          f"({elapsed:.2f} s)")
    if not all(r[5] for r in rows):
        raise RuntimeError("read-back mismatch")
    if free1 != free0:
        raise RuntimeError(f"pool free bytes {free1} after release, expected {free0}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="rpcbuf-demo-") as tmp:
        daemon = Daemon(Path(tmp), "--device", "cpu:512MiB", tenant="demo",
                        ready_timeout=20.0, stop_timeout=10.0)
        failure, up = "", False
        try:
            up = bool(daemon.start())
            print(f"rpcbufd up at {daemon.addr} (pid {daemon.pid})")
            uvloop.run(run(daemon.addr, daemon.token))
        except TimeoutError:
            failure = f"no result within {RUN_TIMEOUT:g} s (a transfer hung?)"
        except Exception as exc:
            failure = f"{type(exc).__name__}: {exc}"
        finally:
            if up and (rc := daemon.stop()) != 0:
                failure += f"\nrpcbufd exited {rc}\n{tail(daemon.log, 50)}"
    if failure:
        print(f"demo FAILED: {failure.strip()}", file=sys.stderr)
        return 1
    print("demo ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
