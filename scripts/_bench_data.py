"""``bench.py``'s data rows: stores and reads of one payload, and batches of 10,000 tensors.

``bench_data``: for each size, rpcbuf on both paths (the tcp context and the
default one, same-host on this host) against raw ucxx, the raw socket and
memcpy, all sides in one alternation per direction, after a warm-up that
also checks rpcbuf reads back what it stored.  ``bench_batching``: 10,000 x
4 KiB by ``store_tensors``, ``store_batch``, the naive loop and
``load_tensors``, each against one 40 MiB op and the raw socket streaming the
same bytes.  What each row means is in ``bench.py``'s docstring; the JSON
keys returned here are the ones ``_bench_rows`` reads.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import rpcbuf
from _bench_plan import (
    BATCH_TENSOR_BYTES,
    BATCH_TENSORS,
    ONE_TENSOR_BYTES,
    RTT_BYTES,
    Plan,
)
from _bench_refs import RawUcxx, SockPeer, memcpy_round
from benchkit import size_name
from benchkit.interrupt import check_interrupted
from benchkit.timing import Round, alternate, alternate_many, blocking, summarize, timed


def data_sides(tcp: rpcbuf.RpcContext, local: rpcbuf.RpcContext, raw: RawUcxx, sock: SockPeer,
               bids: dict[str, str], data: np.ndarray, out: np.ndarray,
               copy_dst: np.ndarray) -> tuple[dict[str, Round], dict[str, Round]]:
    """Every store side and every read side of one size, by JSON key."""
    stores: dict[str, Round] = {}
    reads: dict[str, Round] = {}
    for key, ctx in (("rpcbuf_tcp", tcp), ("rpcbuf_same_host", local)):
        async def rp_store(n: int, ctx: rpcbuf.RpcContext = ctx,
                           bid: str = bids[key]) -> list[float]:
            return await timed(lambda: ctx.store_tensor(bid, data), n)

        async def rp_read(n: int, ctx: rpcbuf.RpcContext = ctx,
                          bid: str = bids[key]) -> list[float]:
            return await timed(lambda: ctx.read_buffer(bid, out=out), n)

        stores[key], reads[key] = rp_store, rp_read

    stores["raw_ucxx"] = blocking(lambda n: raw.store(data, n))
    reads["raw_ucxx"] = blocking(lambda n: raw.read(out, n))
    stores["raw_socket"] = blocking(lambda n: sock.store(data, n))
    reads["raw_socket"] = blocking(lambda n: sock.read(out, n))
    stores["memcpy"] = reads["memcpy"] = memcpy_round(copy_dst, data)
    return stores, reads


async def bench_data(tcp: rpcbuf.RpcContext, local: rpcbuf.RpcContext, raw: RawUcxx,
                     sock: SockPeer, plan: Plan) -> dict[str, Any]:
    """Store and read of each size: rpcbuf on both paths against raw ucxx, the
    raw socket and memcpy, all in one alternation; at the smallest size the
    store alternation also holds the raw socket's 40-byte round trip."""
    rng = np.random.default_rng(0)
    results: dict[str, Any] = {}
    smallest = min(plan.iters)
    for nbytes, iters in plan.iters.items():
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        out = np.empty(nbytes, dtype=np.uint8)
        out.fill(0)  # touch every page before anything is timed
        copy_dst = np.empty(nbytes, dtype=np.uint8)
        copy_dst.fill(0)
        bids = {"rpcbuf_tcp": await tcp.request_buffer(nbytes),
                "rpcbuf_same_host": await local.request_buffer(nbytes)}
        try:
            stores, reads = data_sides(tcp, local, raw, sock, bids, data, out, copy_dst)
            if nbytes == smallest:
                stores["raw_socket_rtt_40B"] = blocking(lambda n: sock.round_trip(RTT_BYTES, n))

            warm = plan.warmup[nbytes]
            name = size_name(nbytes)
            for key in ("rpcbuf_tcp", "rpcbuf_same_host"):
                out.fill(0)
                await stores[key](warm)
                await reads[key](warm)
                if not np.array_equal(out, data):
                    raise RuntimeError(f"rpcbuf ({key}) read back different bytes ({name})")
            for key in ("raw_ucxx", "raw_socket", "memcpy"):
                await stores[key](warm)
                await reads[key](warm)
            if "raw_socket_rtt_40B" in stores:
                await stores["raw_socket_rtt_40B"](warm)
            s = await alternate_many(list(stores.values()), iters, plan.rounds, warm=True)
            r = await alternate_many(list(reads.values()), iters, plan.rounds, warm=True)
            results[name] = {
                "store": {key: summarize(samples, RTT_BYTES if key.endswith("_40B") else nbytes)
                          for key, samples in zip(stores, s, strict=True)},
                "read": {key: summarize(samples, nbytes)
                         for key, samples in zip(reads, r, strict=True)},
            }
        finally:
            await tcp.release_buffer(bids["rpcbuf_tcp"])
            await local.release_buffer(bids["rpcbuf_same_host"])
    return results



@dataclass
class Batch:
    """The batching inputs, built once and used on both paths."""

    big: np.ndarray  # one 40 MiB array
    arrays: list[np.ndarray]  # 10,000 separate 4 KiB copies of its first 40,960,000 bytes
    tensors: dict[str, np.ndarray]
    items: list[tuple[int, np.ndarray]]
    out: np.ndarray  # 40 MiB, pre-touched

    @classmethod
    def make(cls) -> Batch:
        count, size = BATCH_TENSORS, BATCH_TENSOR_BYTES
        big = np.random.default_rng(1).integers(0, 256, ONE_TENSOR_BYTES, dtype=np.uint8)
        arrays = [row.copy() for row in big[:count * size].reshape(count, size)]
        out = np.empty(ONE_TENSOR_BYTES, dtype=np.uint8)
        out.fill(0)  # touch every page before anything is timed
        return cls(big, arrays, {f"t{i}": a for i, a in enumerate(arrays)},
                   [(i * size, a) for i, a in enumerate(arrays)], out)


async def bench_batching(ctx: rpcbuf.RpcContext, batch: Batch, sock: SockPeer,
                         plan: Plan) -> dict[str, Any]:
    """10,000 x 4 KiB tensors: batched (store_tensors, store_batch), naive
    (one store_tensor each) and load_tensors, each against one store / read
    of a single 40 MiB array (whose first 10,000 x 4 KiB are the tensors) and
    against the raw socket streaming the same 40,960,000 bytes as one store
    (one read for load_tensors)."""
    count, size = BATCH_TENSORS, BATCH_TENSOR_BYTES
    total = count * size  # 40,960,000 bytes: the "40 MiB" is 41,943,040
    big, arrays, tensors, items = batch.big, batch.arrays, batch.tensors, batch.items
    out = batch.out
    buffer_size = rpcbuf.calculate_buffer_size(tensors)
    naive_n = min(plan.naive_tensors, count)
    scale = count / naive_n
    clock = time.perf_counter
    started = clock()
    tensors_bid = await ctx.request_buffer(buffer_size)
    # The 40 MiB store and read, store_batch (no manifest) and the naive loop.
    plain_bid = await ctx.request_buffer(ONE_TENSOR_BYTES)
    try:
        def repeat(op: Callable[[], Awaitable[Any]]) -> Round:
            async def run(n: int) -> list[float]:
                return await timed(op, n)
            return run

        async def naive_loop(n: int) -> list[float]:
            samples = []
            for _ in range(n):
                t0 = clock()
                for i in range(naive_n):
                    check_interrupted()
                    await ctx.store_tensor(plain_bid, arrays[i], offset=i * size)
                samples.append((clock() - t0) * scale)
            return samples

        one_store = repeat(lambda: ctx.store_tensor(plain_bid, big))
        one_read = repeat(lambda: ctx.read_buffer(plain_bid, out=out))
        store_tensors = repeat(lambda: ctx.store_tensors(tensors_bid, tensors))
        store_batch = repeat(lambda: ctx.store_batch(plain_bid, items))
        load_tensors = repeat(lambda: ctx.load_tensors(tensors_bid))
        stream = big[:total]
        sock_store = blocking(lambda n: sock.store(stream, n))
        sock_read = blocking(lambda n: sock.read(out[:total], n))

        # Warm every op up (fresh arena pages, the first manifest) and check the
        # bytes once: each batched write must read back as the arrays it stored.
        warm = plan.batch_warmup
        for op in (one_store, one_read, store_tensors, load_tensors, sock_store, sock_read):
            await op(warm)
        await ctx.clear_buffer(plain_bid)
        answer = await ctx.store_batch(plain_bid, items)
        await store_batch(warm - 1)
        await ctx.read_buffer(plain_bid, out=out)
        if not (np.array_equal(out[:total], big[:total]) and not out[total:].any()):
            raise RuntimeError("store_batch: the buffer does not read back as the arrays")
        for i in range(min(200, naive_n)):
            await ctx.store_tensor(plain_bid, arrays[i], offset=i * size)
        loaded = await ctx.load_tensors(tensors_bid)
        if list(loaded) != list(tensors) or not all(
                np.array_equal(loaded[name], a) for name, a in tensors.items()):
            raise RuntimeError("load_tensors did not return the arrays store_tensors stored")
        manifest_entries = len((await ctx.get_buffer_meta(tensors_bid))["tensors"])
        del loaded

        reps = plan.batch_reps
        st, st_ref, st_sock = await alternate_many((store_tensors, one_store, sock_store),
                                                   reps, reps)
        sb, sb_ref, sb_sock = await alternate_many((store_batch, one_store, sock_store),
                                                   reps, reps)
        nv, nv_ref = await alternate(naive_loop, one_store, plan.naive_reps, plan.naive_reps)
        lt, lt_ref, lt_sock = await alternate_many((load_tensors, one_read, sock_read),
                                                   reps, reps)
    finally:
        await ctx.release_buffer(tensors_bid)
        await ctx.release_buffer(plain_bid)

    def pair(ours: list[float], ref: list[float], ref_name: str,
             sock_samples: list[float] | None = None) -> dict[str, Any]:
        out = {"rpcbuf": summarize(ours, total), ref_name: summarize(ref, ONE_TENSOR_BYTES)}
        if sock_samples is not None:
            out["raw_socket_stream"] = summarize(sock_samples, total)
        return out

    return {
        "tensors": count,
        "tensor_bytes": size,
        "total_bytes": total,
        "one_tensor_bytes": ONE_TENSOR_BYTES,
        "buffer_size": buffer_size,
        "manifest_entries": manifest_entries,
        "store_batch_answer": answer,  # nbytes, items, UCX messages
        "store_tensors": pair(st, st_ref, "one_store", st_sock),
        "store_batch": pair(sb, sb_ref, "one_store", sb_sock),
        "naive_loop": {**pair(nv, nv_ref, "one_store"), "timed_tensors": naive_n,
                       "scaled_by": scale,
                       "per_store_us": float(np.median(nv)) / count * 1e6},
        "load_tensors": {**pair(lt, lt_ref, "one_read", lt_sock), "verify": True},
        "seconds": clock() - started,  # the whole section, warm-ups and checks included
    }
