"""A client the fault tests SIGKILL at chosen points: it says what it is doing
on stdout ("connected", "requested ID", "acked K", "reading"), one line each.

usage: fault_client.py ADDR TOKEN NAME CHUNK CHUNKS"""

from __future__ import annotations

import asyncio
import os
import sys

import numpy as np

os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import rpcbuf


def say(line: str) -> None:
    print(line, flush=True)


async def main(addr: str, token: str, name: str, chunk: int, chunks: int) -> None:
    async with rpcbuf.connect(addr, token, timeout=30) as ctx:
        say("connected")
        scoped = await ctx.request_buffer(chunk)  # session-scoped: must go when we die
        bid = await ctx.request_buffer(chunk * chunks, name=name, ttl=120)
        say(f"requested {bid} {scoped}")
        for k in range(chunks):
            await ctx.store_tensor(bid, np.full(chunk, k % 251, dtype=np.uint8), offset=k * chunk)
            say(f"acked {k}")
        say("reading")
        out = np.empty(chunk * chunks, dtype=np.uint8)
        while True:
            await ctx.read_buffer(bid, out=out)


if __name__ == "__main__":
    a = sys.argv[1:]
    asyncio.run(main(a[0], a[1], a[2], int(a[3]), int(a[4])))
