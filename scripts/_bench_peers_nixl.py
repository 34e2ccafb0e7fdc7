"""NIXL as a ``bench_peers.py`` peer: both ends, run by its venv's python.

Used the way NIXL's own examples use it (examples/python/nixl_api_example.py,
2proc/nixl_api_2proc.py): one ``nixl_agent(name, nixl_agent_config(backends=["UCX"]))``
per process (its progress thread on, the default), ``register_memory`` of
``get_reg_descs([(addr, nbytes, 0, "")], "DRAM")`` on each end, the target's
agent metadata (``get_agent_metadata()``) and buffer address handed over out
of band (here: the ready file; the examples use a TCP side server or etcd),
``add_remote_agent`` on the initiator, then
``initialize_xfer("WRITE", local_descs, remote_descs, "target")``,
``transfer(handle)`` and ``check_xfer_state(handle)`` until ``"DONE"``.

Done right by the peer: each size's handle is made once and posted again
for every timed write (NIXL allows re-posting a finished handle; the
examples make one per transfer, which only adds time), and completion is
polled in a tight loop (the examples sleep 1 ms between polls, which would
put a floor of 1 ms under every write).  The batch is one handle of 10,000
descriptors (4 KiB slices of one registered region each side), made once,
posted and polled like the rest.  A WRITE is "DONE" once UCX has flushed it
to the target: that is its "write and ack".  The transport is whatever
``UCX_TLS`` the parent sets (``tcp`` or shared memory).
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

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

POLL_BOUND = 60.0  # seconds one transfer may stay in "PROC"


def agent(name: str) -> Any:
    """The agent with its UCX backend.  Over shared memory (``UCX_TLS`` without
    tcp) the backend is created with ``ucx_error_handling_mode=none``, as NIXL's
    docs show (``get_plugin_params`` / ``create_backend``): its default, peer
    error handling, rules out every shared-memory transport (none has a peer
    failure handler) and endpoint creation fails."""
    from nixl._api import nixl_agent, nixl_agent_config

    if "tcp" in os.environ.get("UCX_TLS", "tcp"):
        return nixl_agent(name, nixl_agent_config(backends=["UCX"]))
    nx = nixl_agent(name, nixl_agent_config(backends=[]))
    params = nx.get_plugin_params("UCX")
    params["ucx_error_handling_mode"] = "none"
    nx.create_backend("UCX", params)
    return nx


def target(args: argparse.Namespace) -> None:
    nx = agent("target")
    buf = region()
    if nx.register_memory(nx.get_reg_descs([(buf.ctypes.data, buf.nbytes, 0, "")],
                                           "DRAM")) is None:
        raise RuntimeError("register_memory failed")
    write_json_atomic(args.ready_file, {"metadata": nx.get_agent_metadata().hex(),
                                        "addr": buf.ctypes.data, "nbytes": buf.nbytes})
    stay_alive(args.deadline)


def initiator(args: argparse.Namespace, plan: PeerPlan, clock: Clock) -> dict[str, Any]:
    ready = read_ready(args.ready_file)
    nx = agent("initiator")
    remote_name = nx.add_remote_agent(bytes.fromhex(str(ready["metadata"])))
    remote = int(ready["addr"])
    buf = region()
    local = buf.ctypes.data
    if nx.register_memory(nx.get_reg_descs([(local, buf.nbytes, 0, "")], "DRAM")) is None:
        raise RuntimeError("register_memory failed")

    def handle(pairs: list[tuple[int, int, int]]) -> Any:
        """One WRITE handle: local slices ``(offset, nbytes)`` onto the same remote ones."""
        src = nx.get_xfer_descs([(local + off, n, 0) for off, n, _ in pairs], "DRAM")
        dst = nx.get_xfer_descs([(remote + off, n, 0) for off, n, _ in pairs], "DRAM")
        deadline = time.monotonic() + POLL_BOUND
        while True:  # the remote's metadata may still be loading: retried, bounded
            h = nx.initialize_xfer("WRITE", src, dst, remote_name)
            if h:
                return h
            if time.monotonic() > deadline:
                raise RuntimeError("initialize_xfer kept failing")
            time.sleep(0.01)

    def post(h: Any) -> None:
        state = nx.transfer(h)
        deadline = time.monotonic() + POLL_BOUND
        while state != "DONE":  # a tight poll, bounded
            if state == "ERR":
                raise RuntimeError("NIXL transfer failed")
            if time.monotonic() > deadline:
                raise TimeoutError("NIXL transfer did not finish")
            state = nx.check_xfer_state(h)

    out: dict[str, Any] = {"peer": "nixl", "ucx_tls": os.environ.get("UCX_TLS"),
                           "remote_agent": str(remote_name)}
    for key, n, iters, warm in (("write_4k", SMALL, plan.small, plan.small_warm),
                                ("write_1m", MID, plan.mid, plan.mid_warm),
                                ("write_64m", BIG, plan.big, plan.big_warm)):
        h = handle([(0, n, 0)])
        timed(lambda h=h: post(h), warm, clock)
        out[key] = timed(lambda h=h: post(h), iters, clock)
        nx.release_xfer_handle(h)
    h = handle([(i * BATCH_ITEM_BYTES, BATCH_ITEM_BYTES, 0) for i in range(BATCH_ITEMS)])
    timed(lambda: post(h), plan.batch_warm, clock)
    out["batch_10000x4k"] = timed(lambda: post(h), plan.batch, clock)
    nx.release_xfer_handle(h)
    nx.remove_remote_agent(remote_name)
    return out


if __name__ == "__main__":
    main("NIXL", target, initiator)
