"""Mooncake Store's sides of ``_bench_kv_sglang.py``: the store calls SGLang's
``MooncakeStore`` backend makes for ``batch_set_v1`` and ``batch_get_v1``,
run by the Mooncake venv's python inside a network namespace of its own
(the parent starts it under ``unshare -n``), against the master and
``mooncake_client`` set up as ``_bench_kv_store_mooncake.py`` sets them up.

SGLang's own class does not import on the CPU (its module imports SGLang's
host pools and metrics, which pull the model configs: transformers,
torchvision), so this is its calls, not its code: a page is two objects,
``<model>_<hash>_<tp rank>_k`` and ``_v`` (``_get_mha_buffer_meta``), read
and written in place in a registered host pool of SGLang's page_first
layout (a page's K and V halves apart); a set is ``batch_is_exist`` then
``batch_put_from`` of the missing objects, a get ``batch_get_into``
(``batch_set_v1``, ``batch_get_v1``).  Two clients: **tcp** (``setup`` with
a segment of 0: the bytes cross the transfer engine's tcp transport to the
holder's segment) and **same-host** (``setup_dummy``: SGLang's
``standalone_storage`` mode, the pool from ``alloc_from_mem_pool``).
Writes each side's rows to ``--out`` as JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from _bench_kv_store_mooncake import CLIENT_PORT, HOST, MASTER_PORT, finish, lo_up, wait_port

MiB = 1 << 20


def progress(msg: str) -> None:
    print(f"[bench_kv sglang mooncake] {msg}", file=sys.stderr, flush=True)


class Pool:
    """A host pool of ``2 * pages`` pages in page_first order: every page's
    K half, then every page's V half (as SGLang's ``kv_buffer`` lies)."""

    def __init__(self, store: Any, pages: int, half: int, dummy: bool) -> None:
        self.pages, self.half = 2 * pages, half
        nbytes = 2 * self.pages * half
        if dummy:
            ptr = int(store.alloc_from_mem_pool(nbytes))
            if not ptr:
                raise RuntimeError(f"alloc_from_mem_pool({nbytes}) returned 0")
            self.buf = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        else:
            self.buf = np.zeros(nbytes, np.uint8)
        if store.register_buffer(self.buf.ctypes.data, nbytes) != 0:
            raise RuntimeError("register_buffer failed")
        self.buf = self.buf.reshape(2, self.pages, half)

    def spans(self, first: int, n: int) -> tuple[list[int], list[int]]:
        base, ptrs = self.buf.ctypes.data, []
        for p in range(first, first + n):
            ptrs += [base + p * self.half, base + (self.pages + p) * self.half]
        return ptrs, [self.half] * len(ptrs)


def keys_of(tag: str, n: int) -> list[str]:
    out = []
    for i in range(n):
        out += [f"bench-model_{tag}-{i:06d}_0_k", f"bench-model_{tag}-{i:06d}_0_v"]
    return out


def batch_set(store: Any, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
    there = store.batch_is_exist(keys)
    todo = [i for i, e in enumerate(there) if e != 1]
    res = [0] * len(keys)
    if todo:
        got = store.batch_put_from([keys[i] for i in todo], [ptrs[i] for i in todo],
                                   [sizes[i] for i in todo])
        for i, r in zip(todo, got, strict=True):
            res[i] = r
    return [res[i] == 0 and res[i + 1] == 0 for i in range(0, len(res), 2)]


def batch_get(store: Any, keys: list[str], ptrs: list[int], sizes: list[int]) -> list[bool]:
    got = store.batch_get_into(keys, ptrs, sizes)
    return [got[i] > 0 and got[i + 1] > 0 for i in range(0, len(got), 2)]


def run_shape(store: Any, name: str, half: int, pages: int, rounds: int,
              dummy: bool) -> dict[str, Any]:
    pool = Pool(store, pages, half, dummy)
    rng = np.random.default_rng(half)
    sets, gets = [], []
    for r in range(-1, rounds):  # (the first round untimed)
        pool.buf[:, :pages] = rng.integers(0, 256, (2, pages, half), dtype=np.uint8)
        pool.buf[:, pages:] = 0
        keys = keys_of(f"{name}-{r}", pages)
        src, dst = pool.spans(0, pages), pool.spans(pages, pages)
        t0 = time.perf_counter()
        ok = batch_set(store, keys, *src)
        sets.append(time.perf_counter() - t0)
        assert all(ok), f"batch set: {ok.count(False)} of {pages} pages failed"
        t0 = time.perf_counter()
        ok = batch_get(store, keys, *dst)
        gets.append(time.perf_counter() - t0)
        assert all(ok), f"batch get: {ok.count(False)} of {pages} pages missed"
        assert np.array_equal(pool.buf[:, pages:], pool.buf[:, :pages]), "bytes differ"
        store.remove_all(True)
    sets, gets = sets[1:], gets[1:]
    return {"set_ms": statistics.median(sets) * 1e3, "get_ms": statistics.median(gets) * 1e3,
            "set_samples_ms": [s * 1e3 for s in sets], "get_samples_ms": [g * 1e3 for g in gets]}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--logs", required=True)
    p.add_argument("--shapes", required=True, help='JSON: {"name": page_bytes}')
    p.add_argument("--pages", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--segment-gb", type=int, default=2)
    args = p.parse_args()
    from mooncake.store import MooncakeDistributedStore

    shapes: dict[str, int] = json.loads(args.shapes)
    biggest = 2 * args.pages * max(shapes.values())
    lo_up()
    logs = Path(args.logs)
    out: dict[str, Any] = {"sides": {}, "notes": []}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with open(logs / "mooncake_master.log", "ab") as f:
            procs.append(subprocess.Popen(
                [f"{args.bin}/mooncake_master", f"--rpc_address={HOST}",
                 f"--rpc_port={MASTER_PORT}", "--enable_metric_reporting=false"],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        wait_port(MASTER_PORT, procs[-1], "mooncake_master")
        with open(logs / "mooncake_client.log", "ab") as f:
            procs.append(subprocess.Popen(
                [f"{args.bin}/mooncake_client", f"--host={HOST}", f"--port={CLIENT_PORT}",
                 "--protocol=tcp", "--metadata_server=P2PHANDSHAKE",
                 f"--master_server_address={HOST}:{MASTER_PORT}",
                 f"--global_segment_size={args.segment_gb} GB"],
                stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        wait_port(CLIENT_PORT, procs[-1], "mooncake_client")
        for which in ("tcp", "same-host"):
            name = f"Mooncake {which}"
            store = MooncakeDistributedStore()
            if which == "tcp":
                ret = store.setup(HOST, "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "",
                                  f"{HOST}:{MASTER_PORT}")
            else:
                ret = store.setup_dummy(2 * biggest + 64 * MiB, 64 * MiB,
                                        f"{HOST}:{CLIENT_PORT}")
            if ret != 0:
                out["sides"][name] = {"error": f"setup returned {ret}"}
                continue
            rows = {}
            for shape, page_bytes in shapes.items():
                progress(f"{name}, {shape} ...")
                try:
                    rows[shape] = run_shape(store, shape, page_bytes // 2, args.pages,
                                            args.rounds, which != "tcp")
                except Exception as exc:  # one failing row is a note, not a crash
                    rows[shape] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            out["sides"][name] = rows
            store.close()
    except Exception as exc:
        out["notes"].append(f"Mooncake: {type(exc).__name__}: {exc}")
    finally:
        finish(procs, out, args.out)
    sys.stdout.flush()
    os._exit(0)  # Mooncake's threads must not keep the process alive


if __name__ == "__main__":
    main()
