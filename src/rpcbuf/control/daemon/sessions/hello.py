"""What a hello decides besides the token (``greeting.hello``): who is on
the other end of a Unix socket (for the logs), and the answer that tells the
client what it got.

Same host: a Unix socket session that asks for it (``handles``) is granted
the same-host path at once: the answer carries ``handles_nonce``, which the
client's second connection presents to bind the session's handle channel
(``handles.py``).  Nothing needs proving first: the path never touches the
client's memory, it hands out handles of the daemon's own.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rpcbuf.control.daemon.ops.node import Node
from rpcbuf.control.wire import protocol as P
from rpcbuf.control.wire.auth import Grant
from rpcbuf.dataplane import shm
from rpcbuf.dataplane.cuda_arena import is_device_arena


def peer_pid(writer: asyncio.StreamWriter) -> int | None:
    """The pid of the process that connected to our Unix socket (the
    kernel's ``SO_PEERCRED``, as of connect; for the logs only)."""
    try:
        return shm.peer_cred(writer.get_extra_info("socket"))[0]
    except OSError:
        return None


def answer(node: Node, session_id: str, grant: Grant, nonce: bytes, unix: bool,
           handles_nonce: bytes | None, why: str,
           version: int = P.PROTOCOL_VERSION) -> dict[str, Any]:
    """The hello's answer: the session, the node, how to reach its data paths."""
    result: dict[str, Any] = {
        "session_id": session_id,
        "tenant": grant.tenant,
        "token_expires_at": grant.expires_at,  # the session ends then (None: never)
        "node_id": node.node_id,
        "version": version,  # what both speak (see protocol.negotiate)
        "versions": [P.PROTOCOL_MIN, P.PROTOCOL_VERSION],
        # Each device's own checksum (what a plain store into it is verified with).
        "checksum_kinds": {p.key: "devsum" if is_device_arena(p.arena) else "xxh3"
                           for p in node.registry.pools.values()},
        "ucx": {"port": node.ucx_port},
        "bind_nonce": nonce,
        "devices": [p.describe() for p in node.registry.pools.values()],
        "limits": node.limits.to_wire(),
        "same_host": handles_nonce is not None,
        # Stores and reads up to this many bytes may carry their bytes in
        # their frames (path "inline": ``Store.data``, the answer's) instead of UCX.
        "inline_max": P.inline_max(node.limits.max_frame),
        # ... and so may block puts and gets (``BlockPut.data``, the answer's).
        "block_inline": True,
    }
    if handles_nonce is not None:
        result["handles_nonce"] = handles_nonce
    if why:
        result["same_host_why"] = why
    local = node.local_info()
    if local is not None and not unix:
        result["local"] = local
    return result
