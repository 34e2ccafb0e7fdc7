"""``bench.py``'s control and idle rows: request+release against a bare msgpack echo,
and the daemon's CPU while nothing happens.

``bench_control``: ``request_buffer(4096)`` + ``release_buffer`` pairs one
at a time against two sequential echos of the same two request objects
(same bytes, same framing), then pipelined by many workers against
pipelined echos.  ``idle_cpu``: the share of one core the daemon (and this
client) used over a window in which this process only sleeps.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import rpcbuf
from _bench_plan import Plan
from _bench_refs import EchoClient
from benchkit.interrupt import check_interrupted
from benchkit.timing import Round, alternate, process_cpu_seconds, summarize
from rpcbuf.control.wire import protocol as P


async def bench_control(ctx: rpcbuf.RpcContext, echo: EchoClient, plan: Plan) -> dict[str, Any]:
    # The echo sends exactly what rpcbuf sends: the same request objects, encoded the same way.
    sample_id = await ctx.request_buffer(4096)
    await ctx.release_buffer(sample_id)
    echo_req = P.RequestBuffer(size=4096)
    echo_rel = P.Release(buffer_id=sample_id)
    clock = time.perf_counter

    def sequential(kind: str) -> tuple[Round, dict[str, list[float]]]:
        parts: dict[str, list[float]] = {"first": [], "second": []}

        async def run(n: int) -> list[float]:
            pairs = []
            for _ in range(n):
                check_interrupted()
                t0 = clock()
                if kind == "rpcbuf":
                    bid = await ctx.request_buffer(4096)
                    t1 = clock()
                    await ctx.release_buffer(bid)
                else:
                    await echo.call(echo_req)
                    t1 = clock()
                    await echo.call(echo_rel)
                t2 = clock()
                parts["first"].append(t1 - t0)
                parts["second"].append(t2 - t1)
                pairs.append(t2 - t0)
            return pairs

        return run, parts

    async def rp_pair() -> None:
        await ctx.release_buffer(await ctx.request_buffer(4096))

    async def echo_pair() -> None:
        await echo.call(echo_req)
        await echo.call(echo_rel)

    def pipelined(pair: Callable[[], Awaitable[None]]) -> Round:
        async def run(n: int) -> list[float]:
            workers = min(plan.concurrency, n)

            async def worker(k: int) -> None:
                for _ in range(k):
                    check_interrupted()
                    await pair()

            t0 = clock()
            await asyncio.gather(*(worker(n // workers + (i < n % workers))
                                   for i in range(workers)))
            return [clock() - t0]

        return run

    rp_run, rp_parts = sequential("rpcbuf")
    echo_run, echo_parts = sequential("echo")
    await rp_run(50)  # warm-up
    await echo_run(50)
    for parts in (rp_parts, echo_parts):
        parts["first"].clear()
        parts["second"].clear()
    rp_pairs, echo_pairs = await alternate(rp_run, echo_run, plan.control_pairs, plan.rounds)

    await pipelined(rp_pair)(plan.concurrency * 4)  # warm-up
    await pipelined(echo_pair)(plan.concurrency * 4)
    rp_pipe, echo_pipe = await alternate(pipelined(rp_pair), pipelined(echo_pair),
                                         plan.pipelined_pairs, plan.rounds)
    pipe_ops = 2 * plan.pipelined_pairs
    return {
        "sequential": {
            "rpcbuf": {"pair": summarize(rp_pairs),
                       "request_buffer": summarize(rp_parts["first"]),
                       "release_buffer": summarize(rp_parts["second"])},
            "echo": {"pair": summarize(echo_pairs),
                     "first": summarize(echo_parts["first"]),
                     "second": summarize(echo_parts["second"])},
        },
        "pipelined": {
            "concurrency": plan.concurrency,
            "pairs": plan.pipelined_pairs,
            "rpcbuf": {"seconds": sum(rp_pipe), "ops_per_s": pipe_ops / sum(rp_pipe)},
            "echo": {"seconds": sum(echo_pipe), "echos_per_s": pipe_ops / sum(echo_pipe)},
        },
    }


async def idle_cpu(pid: int, seconds: float) -> dict[str, Any]:
    """Share of one core the daemon (and this client) used over ``seconds`` of
    nothing to do: this process only sleeps on its event loop meanwhile."""
    clock = time.perf_counter
    d0, t0 = process_cpu_seconds(pid), clock()
    c0 = os.times()
    await asyncio.sleep(seconds)
    d1, t1 = process_cpu_seconds(pid), clock()
    c1 = os.times()
    wall = t1 - t0
    client = (c1.user + c1.system) - (c0.user + c0.system)
    return {"seconds": wall, "daemon_cpu_seconds": d1 - d0,
            "daemon_percent": 100.0 * (d1 - d0) / wall,
            "client_cpu_seconds": client, "client_percent": 100.0 * client / wall,
            "clock_ticks_per_s": os.sysconf("SC_CLK_TCK")}

