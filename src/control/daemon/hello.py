"""What a hello decides besides the token (``Session._hello``): whose
process is on the other end of a Unix socket, whether the same-host path is
on for it, and the answer that tells the client what it got.

Same host: the kernel names the connecting process (``SO_PEERCRED``, pinned
by a pidfd at accept, ``cma.Peer.of_socket``: never looked up again by pid),
and the hello carries a probe (bytes and their address in the client's
memory) that the daemon reads back with ``process_vm_readv`` on a probe
thread, never on the loop: the client chose the address, and its memory may
never arrive.  Only a probe read back in time turns the path on.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from control.daemon.node import Node
from control.wire import protocol as P
from control.wire.auth import Grant
from dataplane import cma
from dataplane.cuda_arena import is_device_arena

PROBE_WAIT = 0.05  # seconds the loop waits for a hello's probe (16 bytes) at most


def accept_peer(writer: asyncio.StreamWriter) -> tuple[cma.Peer | None, str]:
    """On a Unix socket: the connecting process (``cma.Peer.of_socket``), or
    None and why it cannot be had.  Not a Unix socket: (None, "")."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return None, ""
    try:
        return cma.Peer.of_socket(sock), ""
    except OSError as exc:
        return None, exc.strerror or str(exc)


def same_host_why(req: P.Hello, unix: bool, node: Node, tenant: str,
                  peer: cma.Peer | None, peer_why: str) -> str | None:
    """Why the same-host path stays off for this hello ("": it was not
    asked for); None: the client proved we can read its memory."""
    if req.probe is None or req.probe_addr is None:
        return ""
    if not unix:
        return "the same-host path needs the daemon's Unix socket"
    if node.same_host_off:
        return node.same_host_off
    if peer is None:
        return f"cannot watch the client process: {peer_why}"
    return _probe(node, tenant, peer, req.probe_addr, req.probe)


def _probe(node: Node, tenant: str, peer: cma.Peer, addr: int, expected: bytes) -> str | None:
    """``peer.probe`` on a probe thread, the loop waiting for it at most
    PROBE_WAIT (a stuck probe's thread is written off)."""
    probes = node.probes
    job = probes.submit(tenant, peer.probe, addr, expected)
    job.future.add_done_callback(_consume)
    if probes.wait(job, PROBE_WAIT, alone=False):
        result: str | None = job.future.result()
        return result
    if not probes.cancel(job):
        probes.written_off(job)
    return (f"reading the probe from the client's memory took over "
            f"{PROBE_WAIT * 1e3:.0f} ms")


def _consume(fut: asyncio.Future[Any]) -> None:
    """A probe nobody waits for any more: its outcome does not matter."""
    if not fut.cancelled():
        fut.exception()


def answer(node: Node, session_id: str, grant: Grant, nonce: bytes, unix: bool,
           same_host: bool, why: str, version: int = P.PROTOCOL_VERSION) -> dict[str, Any]:
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
        "same_host": same_host,
    }
    if why:
        result["same_host_why"] = why
    local = node.local_info()
    if local is not None and not unix:
        if node.same_host_off:  # no point reconnecting: say why here
            result["same_host_why"] = node.same_host_off
        else:
            result["local"] = local
    return result
