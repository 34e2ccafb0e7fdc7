"""Dedup benchmark: how much a repeated model upload sends, and how long it takes.

Run as ``.venv/bin/python scripts/bench_dedup.py [--json bench_dedup.json] [--quick]``.

A llama-like safetensors model (``--size``, 256 MiB by default: embeddings,
``--layers`` layers of attention and MLP weights, final norm and head, float16)
is written to a temporary directory, and one rpcbufd is started on loopback
(UCX over tcp) with ``--cache-dir`` and ``--prefault`` (``--no-prefault``:
without).  Each round, on a fresh daemon, an empty disk cache and an empty
client hash cache (``RPCBUF_CACHE_DIR`` in the temporary directory;
``--no-hash-cache``: the client hashes every upload), times
``rpcbuf.load_model`` (checksum-verified, 64 MiB batches):

1. *first*: the cold upload; every byte crosses the network;
2. *again, same name*: the same model loaded again (the buffers exist: the
   daemon finds every tensor in place and only verifies it);
3. *again, new name*: loaded under another name while the first copy is
   still there (the daemon copies each tensor locally and verifies the copy);
4. *after restart*: the daemon is stopped (SIGTERM: the cache writes finish)
   and started again on the same ``--cache-dir``; the model is loaded again
   (each tensor read from the disk cache and verified).

Reported per scenario (median over the rounds): bytes sent, their share of
the first upload's, seconds, and their share of the first upload's time in
the same round.  Goals (docs/cluster.md): a second upload sends <= 1 % of the
bytes in <= 10 % of the time; after a restart with a warm disk cache,
<= 25 % of the time.  Output: an aligned table on stdout, every number as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import benchkit

benchkit.loopback_ucx_env()  # before anything imports ucxx

import numpy as np  # noqa: E402

import rpcbuf  # noqa: E402
from benchkit import MiB  # noqa: E402
from benchkit.procs import Daemon  # noqa: E402
from benchkit.report import format_table, machine_meta, progress_printer, write_json  # noqa: E402
from rpcbuf.control.client.context import same_host_default  # noqa: E402

progress = progress_printer("bench_dedup")
SCENARIOS = ("first", "again, same name", "again, new name", "after restart")
GOALS = {"again, same name": (0.01, 0.10), "again, new name": (0.01, 0.10),
         "after restart": (0.01, 0.25)}


def write_model(path: Path, size: int, layers: int, seed: int = 0) -> int:
    """A llama-like float16 safetensors file of about ``size`` bytes."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    hidden = 1024
    vocab = max(1024, size // 8 // (hidden * 2))  # embeddings + head: a quarter
    per_layer = (size - 2 * vocab * hidden * 2) // layers
    ffn = max(256, (per_layer // 2 - 4 * hidden * hidden) // (3 * hidden))

    def t(*shape: int) -> np.ndarray:
        n = int(np.prod(shape))
        return np.frombuffer(rng.bytes(2 * n), dtype=np.float16).reshape(shape)

    tensors = {"model.embed_tokens.weight": t(vocab, hidden)}
    for i in range(layers):
        for name, shape in (("self_attn.q_proj", (hidden, hidden)),
                            ("self_attn.k_proj", (hidden, hidden)),
                            ("self_attn.v_proj", (hidden, hidden)),
                            ("self_attn.o_proj", (hidden, hidden)),
                            ("mlp.gate_proj", (ffn, hidden)), ("mlp.up_proj", (ffn, hidden)),
                            ("mlp.down_proj", (hidden, ffn))):
            tensors[f"model.layers.{i}.{name}.weight"] = t(*shape)
        tensors[f"model.layers.{i}.input_layernorm.weight"] = t(hidden)
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = t(hidden)
    tensors["model.norm.weight"] = t(hidden)
    tensors["lm_head.weight"] = t(vocab, hidden)
    save_file(tensors, str(path))
    return sum(a.nbytes for a in tensors.values())


def node(tmp: Path, arena: int, cache: Path, flags: list[str]) -> Daemon:
    """One rpcbufd on ``cache`` (restartable: ``stop()`` then ``start()`` again
    keeps the disk cache); SIGTERM lets the cache writes finish (bounded: 120 s)."""
    return Daemon(tmp, "--device", f"cpu:{arena}", "--cache-dir", str(cache),
                  "--cache-size", f"{4 * arena}", *flags, tenant="bench",
                  log_level=os.environ.get("BENCH_LOG", "WARNING"), ready_timeout=30.0,
                  stop_timeout=120.0)


async def upload(node: Daemon, model: Path, name: str, hash_cache: bool) -> dict[str, Any]:
    async with rpcbuf.Cluster.connect(node.addr, node.token, timeout=120) as cluster:
        t = time.perf_counter()
        res = await rpcbuf.load_model(cluster, model, name=name, progress=False,
                                      hash_cache=hash_cache)
        seconds = time.perf_counter() - t
    return {"seconds": seconds, "bytes_sent": res.bytes_sent, "bytes_total": res.bytes_total}


async def one_round(tmp: Path, model: Path, arena: int, flags: list[str],
                    hash_cache: bool) -> dict[str, dict[str, Any]]:
    cache = tmp / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(tmp / "hashes", ignore_errors=True)  # the client's hash cache: cold too
    os.environ["RPCBUF_CACHE_DIR"] = str(tmp / "hashes")
    daemon = node(tmp, arena, cache, flags)
    daemon.start()
    out: dict[str, dict[str, Any]] = {}
    try:
        out["first"] = await upload(daemon, model, "m", hash_cache)
        out["again, same name"] = await upload(daemon, model, "m", hash_cache)
        out["again, new name"] = await upload(daemon, model, "m2", hash_cache)
    finally:
        daemon.stop()
    daemon.start()
    try:
        out["after restart"] = await upload(daemon, model, "m", hash_cache)
    finally:
        daemon.stop()
    return out


def fmt_table(rows: dict[str, dict[str, Any]]) -> str:
    head = ["scenario", "bytes sent", "of first", "seconds", "of first", "goal", "met"]
    lines = []
    for name in SCENARIOS:
        r = rows[name]
        goal = GOALS.get(name)
        target = "-" if goal is None else f"<= {100 * goal[0]:.0f} % / <= {100 * goal[1]:.0f} %"
        lines.append([name, f"{r['bytes_sent'] / MiB:,.2f} MiB",
                      f"{100 * r['bytes_ratio']:.2f} %", f"{r['seconds']:.3f}",
                      f"{100 * r['time_ratio']:.1f} %", target,
                      "-" if r["met"] is None else ("yes" if r["met"] else "NO")])
    return format_table(head, lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", default="bench_dedup.json", help="write every number here")
    p.add_argument("--size", type=int, default=256, help="model size in MiB [%(default)s]")
    p.add_argument("--layers", type=int, default=16, help="[%(default)s]")
    p.add_argument("--rounds", type=int, default=3, help="[%(default)s]")
    p.add_argument("--quick", action="store_true", help="one round of a 64 MiB model")
    p.add_argument("--no-hash-cache", action="store_true",
                   help="the client hashes every tensor on every upload")
    p.add_argument("--no-prefault", action="store_true",
                   help="start rpcbufd without --prefault")
    args = p.parse_args(argv)
    flags = [] if args.no_prefault else ["--prefault"]
    if args.quick:
        args.size, args.rounds = 64, 1
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench_dedup-") as tmpdir:
        tmp = Path(tmpdir)
        model = tmp / "model.safetensors"
        nbytes = write_model(model, args.size * MiB, args.layers)
        arena = 1 << max(24, (4 * nbytes - 1).bit_length())  # two loaded copies, buddy blocks
        rounds = []
        for i in range(args.rounds):
            t = time.perf_counter()
            rounds.append(asyncio.run(one_round(tmp, model, arena, flags,
                                                not args.no_hash_cache)))
            progress(f"round {i + 1}/{args.rounds}: {time.perf_counter() - t:.1f} s")
    rows: dict[str, dict[str, Any]] = {}
    for name in SCENARIOS:
        t_ratios = [r[name]["seconds"] / r["first"]["seconds"] for r in rounds]
        b_ratios = [r[name]["bytes_sent"] / r["first"]["bytes_sent"] for r in rounds]
        goal = GOALS.get(name)
        row = {"seconds": statistics.median(r[name]["seconds"] for r in rounds),
               "bytes_sent": statistics.median(r[name]["bytes_sent"] for r in rounds),
               "time_ratio": statistics.median(t_ratios),
               "bytes_ratio": statistics.median(b_ratios),
               "rounds": [r[name] for r in rounds]}
        row["met"] = None if goal is None else (row["bytes_ratio"] <= goal[0]
                                                and row["time_ratio"] <= goal[1])
        rows[name] = row
    path = "UCX tcp: RPCBUF_SAME_HOST=0" if same_host_default() is False else "same-host path"
    print(f"model {nbytes / MiB:.0f} MiB ({args.layers} layers, float16, safetensors), one node "
          f"on loopback ({path}), medians of {args.rounds} round(s); client hash cache "
          f"{'off' if args.no_hash_cache else 'on'}, rpcbufd {' '.join(flags) or 'no --prefault'}")
    print(fmt_table(rows))
    report = {"meta": {"started_at": started, "seconds": time.time() - started,
                       "model_bytes": nbytes, "layers": args.layers, "rounds": args.rounds,
                       "hash_cache": not args.no_hash_cache, "daemon_flags": flags,
                       **machine_meta()},
              "goals": {k: {"bytes": v[0], "time": v[1]} for k, v in GOALS.items()},
              "scenarios": rows}
    write_json(args.json, report)
    progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
