"""rpcbuf's side of ``bench_peers.py``, with the raw references: the same operations the peers run.

For each size (4 KiB, 1 MiB, 64 MiB) one alternation (``benchkit.timing``:
rounds that rotate who goes first, garbage collector off, one untimed
operation per chunk) of ``store_tensor`` on the UCX (tcp) context, on the
same-host context, the raw ucxx reference (``_bench_refs.RawUcxx``: its
own two processes, tuned) sending the bytes and receiving a 1-byte ack, and
``np.copyto`` of the same bytes in this process (one thread).  Then the
batch: ``store_tensors`` of 10,000 separate 4 KiB arrays on each context,
alternated, into a buffer sized by ``calculate_buffer_size``.  Counts come
from the same ``PeerPlan`` the peers get, so every side runs the same number
of operations.  Samples are seconds, keyed as the peers' JSON keys them.
"""

from __future__ import annotations

import numpy as np

import rpcbuf
from _bench_peers_child import BATCH_ITEM_BYTES, BATCH_ITEMS, BIG, MID, SMALL, PeerPlan
from _bench_refs import RawUcxx, memcpy_round
from benchkit.timing import Round, alternate_many, blocking, timed

SIZES = (("write_4k", SMALL), ("write_1m", MID), ("write_64m", BIG))
ROUNDS = 5


def counts(plan: PeerPlan, key: str) -> tuple[int, int]:
    """(timed, warm-up) operations for one row, as the peers run them."""
    return {"write_4k": (plan.small, plan.small_warm), "write_1m": (plan.mid, plan.mid_warm),
            "write_64m": (plan.big, plan.big_warm),
            "batch_10000x4k": (plan.batch, plan.batch_warm)}[key]


async def measure(ctxs: dict[str, rpcbuf.RpcContext], raw: RawUcxx | None,
                  plan: PeerPlan) -> dict[str, dict[str, list[float]]]:
    """{side: {row key: samples}} for the rpcbuf contexts (``ctxs``: side -> context),
    ``raw_ucxx`` (when ``raw`` is given) and ``memcpy``."""
    rng = np.random.default_rng(0)
    out: dict[str, dict[str, list[float]]] = {k: {} for k in (*ctxs, "raw_ucxx", "memcpy")}
    for key, nbytes in SIZES:
        data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        dst = np.zeros(nbytes, dtype=np.uint8)  # pre-touched: np.copyto's target
        bids = {side: await ctx.request_buffer(nbytes) for side, ctx in ctxs.items()}
        try:
            sides: dict[str, Round] = {}
            for side, ctx in ctxs.items():
                async def store(n: int, ctx: rpcbuf.RpcContext = ctx, bid: str = bids[side],
                                data: np.ndarray = data) -> list[float]:
                    return await timed(lambda: ctx.store_tensor(bid, data), n)
                sides[side] = store
            if raw is not None:
                sides["raw_ucxx"] = blocking(lambda n, raw=raw, data=data: raw.store(data, n))
            sides["memcpy"] = memcpy_round(dst, data)
            iters, warm = counts(plan, key)
            for run in sides.values():
                await run(warm)
            samples = await alternate_many(list(sides.values()), iters, ROUNDS, warm=True)
            for side, s in zip(sides, samples, strict=True):
                out[side][key] = s
        finally:
            for side, ctx in ctxs.items():
                await ctx.release_buffer(bids[side])
    tensors = {f"t{i}": rng.integers(0, 256, BATCH_ITEM_BYTES, dtype=np.uint8)
               for i in range(BATCH_ITEMS)}
    size = rpcbuf.calculate_buffer_size(tensors)
    bids = {side: await ctx.request_buffer(size) for side, ctx in ctxs.items()}
    try:
        batch_sides: list[Round] = []
        for side, ctx in ctxs.items():
            async def batch(n: int, ctx: rpcbuf.RpcContext = ctx,
                            bid: str = bids[side]) -> list[float]:
                return await timed(lambda: ctx.store_tensors(bid, tensors), n)
            batch_sides.append(batch)
        iters, warm = counts(plan, "batch_10000x4k")
        for run in batch_sides:
            await run(warm)
        first = next(iter(ctxs))
        loaded = await ctxs[first].load_tensors(bids[first])  # the batch landed, checked once
        if not all(np.array_equal(loaded[k], v) for k, v in tensors.items()):
            raise RuntimeError("store_tensors did not read back as the arrays it stored")
        samples = await alternate_many(batch_sides, iters, iters)
        for side, s in zip(ctxs, samples, strict=True):
            out[side]["batch_10000x4k"] = s
    finally:
        for side, ctx in ctxs.items():
            await ctx.release_buffer(bids[side])
    return {side: rows for side, rows in out.items() if rows}


def nbytes_of(key: str) -> int:
    """The bytes one operation of row ``key`` moves."""
    return dict(SIZES).get(key, BATCH_ITEMS * BATCH_ITEM_BYTES)
