"""Mooncake's transfer engine as a ``bench_peers.py`` peer: both ends, run by its venv's python.

Used the way Mooncake's own Python quick start uses it
(doc/en/transfer-engine-python.md, docs/source/getting_started/quick-start.md):
``TransferEngine().initialize(hostname, "P2PHANDSHAKE", "tcp", "")`` on each
end (no metadata server: the target's session name is
``hostname:get_rpc_port()``), ``register_memory(ptr, nbytes)`` of a numpy
buffer on each end, the target's buffer address handed to the initiator
out of band (here: the ready file, where the quick start uses ZMQ), and
then ``transfer_sync_write(session, src, dst, n)`` for one write and
``batch_transfer_sync_write(session, srcs, dsts, lengths)`` for the batch.
A sync write returns once the target has the bytes: that is its "write
and ack".  The 10,000-item batch needs ``MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER``
raised (the parent sets it; the tcp transport's default queue is smaller).

The batch is 10,000 slices of 4 KiB of one registered region into 10,000
slices of the target's (one registration each side: what the engine is
built for).  After the warm-up one 4 KiB write is read back with
``transfer_sync_read`` and compared: the numbers measure writes that land.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from _bench_peers_child import (
    BATCH_ITEM_BYTES,
    BATCH_ITEMS,
    BIG,
    MID,
    SMALL,
    Clock,
    PeerPlan,
    main,
    read_ready,
    region,
    stay_alive,
    timed,
    write_json_atomic,
)

HOST = "127.0.0.1"


def engine() -> Any:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    ret = te.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    if ret != 0:
        raise RuntimeError(f"TransferEngine.initialize returned {ret}")
    return te


def register(te: Any, buf: np.ndarray) -> None:
    ret = te.register_memory(buf.ctypes.data, buf.nbytes)
    if ret != 0:
        raise RuntimeError(f"register_memory returned {ret}")


def target(args: argparse.Namespace) -> None:
    te = engine()
    buf = region()
    register(te, buf)
    write_json_atomic(args.ready_file, {"session": f"{HOST}:{te.get_rpc_port()}",
                                        "addr": buf.ctypes.data, "nbytes": buf.nbytes})
    stay_alive(args.deadline)


def initiator(args: argparse.Namespace, plan: PeerPlan, clock: Clock) -> dict[str, Any]:
    ready = read_ready(args.ready_file)
    session, remote = str(ready["session"]), int(ready["addr"])
    te = engine()
    buf = region()
    register(te, buf)
    local = buf.ctypes.data

    def write(n: int) -> None:
        ret = te.transfer_sync_write(session, local, remote, n)
        if ret != 0:
            raise RuntimeError(f"transfer_sync_write({n}) returned {ret}")

    srcs = [local + i * BATCH_ITEM_BYTES for i in range(BATCH_ITEMS)]
    dsts = [remote + i * BATCH_ITEM_BYTES for i in range(BATCH_ITEMS)]
    lengths = [BATCH_ITEM_BYTES] * BATCH_ITEMS

    def batch() -> None:
        ret = te.batch_transfer_sync_write(session, srcs, dsts, lengths)
        if ret != 0:
            raise RuntimeError(f"batch_transfer_sync_write returned {ret}")

    out: dict[str, Any] = {"peer": "mooncake", "session": session}
    for key, n, iters, warm in (("write_4k", SMALL, plan.small, plan.small_warm),
                                ("write_1m", MID, plan.mid, plan.mid_warm),
                                ("write_64m", BIG, plan.big, plan.big_warm)):
        timed(lambda n=n: write(n), warm, clock)
        out[key] = timed(lambda n=n: write(n), iters, clock)
    back = np.zeros(SMALL, dtype=np.uint8)
    scratch = buf[BIG - SMALL:]  # read into the registered region's tail, then compare
    ret = te.transfer_sync_read(session, scratch.ctypes.data, remote, SMALL)
    back[:] = scratch
    if ret != 0 or not np.array_equal(back, buf[:SMALL]):
        raise RuntimeError(f"a 4 KiB write did not read back (transfer_sync_read: {ret})")
    timed(batch, plan.batch_warm, clock)
    out["batch_10000x4k"] = timed(batch, plan.batch, clock)
    return out


if __name__ == "__main__":
    main("Mooncake transfer engine", target, initiator)
