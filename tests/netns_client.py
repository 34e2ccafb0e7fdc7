"""A client run in a subprocess by test_netns.py (its UCX needs the veths, not lo).

``python tests/netns_client.py ENDPOINTS TOKEN MODEL SPEC KILL_ENDPOINT KILL_PID``
loads MODEL and, once KILL_ENDPOINT has taken its first batch, SIGKILLs the
daemon KILL_PID (that node dies mid-upload).  Prints one JSON object: the
ClusterError's per-node codes and what was cleaned up, and the buffers left
on the nodes that still answer.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys

import rpcbuf


async def main(endpoints: str, token: str, model: str, spec: str, victim: str,
               pid: int) -> dict[str, object]:
    def kill(addr: str, done: int, total: int) -> None:
        if addr == victim:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    out: dict[str, object] = {}
    async with rpcbuf.Cluster.connect(endpoints, token, timeout=10) as cluster:
        try:
            await rpcbuf.load_model(cluster, model, spec, progress=False, batch_bytes=16 << 10,
                                    on_progress=kill)
            out["loaded"] = True
        except rpcbuf.ClusterError as exc:
            out["failed"] = {a: e.code for a, e in exc.errors.items()}
            out["cleaned"] = exc.details.get("cleaned")
        left = await cluster.each(lambda c: c.list_buffers())
        out["left"] = {a: [b["name"] for b in r] for a, r in left.items()
                       if not isinstance(r, rpcbuf.RpcBufError)}
    return out


if __name__ == "__main__":
    a = sys.argv[1:]
    print(json.dumps(asyncio.run(asyncio.wait_for(main(*a[:5], int(a[5])), 60))))
