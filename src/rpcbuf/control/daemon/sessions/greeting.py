"""What a hello decides, as functions of what they read: the challenge's
answer, the token's proof, the session caps, the hello's answer.  The
session keeps the state (``Session.challenged``, its tenant, its slot).

Hello is two frames (protocol 4; ``wire/auth.py`` has the design): the
``challenge`` names the token's claims and a client nonce, and is answered
with our nonce and our proof, so the client knows it reached a holder of the
node's key; the ``hello`` carries the client's proof over the same
transcript.  A challenge is said once per connection and a hello uses it up,
right or wrong: a captured hello, or a proof for another connection's nonce,
opens nothing.  The bearer token itself never arrives.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from rpcbuf.control.daemon.ops.node import Node
from rpcbuf.control.wire import auth, protocol as P
from rpcbuf.control.wire.auth import Grant
from rpcbuf.control.wire.errors import BadRequest, QuotaExceeded
from rpcbuf.dataplane import shm
from rpcbuf.dataplane.cuda_arena import is_device_arena

log = logging.getLogger("rpcbuf.daemon")


@dataclass(frozen=True, slots=True)
class Challenged:
    """A challenge answered, waiting for its hello: what the proof covers."""

    claims: str
    said: bytes  # the transcript (auth.transcript)
    version: int


USED = Challenged("", b"", 0)  # a hello took it: no second challenge on this connection


def challenge(node: Node, req: P.Challenge) -> tuple[Challenged, dict[str, Any]]:
    """Our nonce and proof for the claims the client names.  Raises
    BAD_REQUEST (versions that do not meet; a nonce not 32 bytes) or
    AUTH_FAILED (claims that name no key we hold)."""
    version = P.negotiate(P.challenge_versions(req))
    if len(req.nonce) != auth.NONCE_BYTES:
        raise BadRequest(f"challenge: nonce must be {auth.NONCE_BYTES} bytes")
    _, secret = auth.signature(node.keys, req.claims)
    ours = os.urandom(auth.NONCE_BYTES)
    said = auth.transcript(version, req.claims, req.nonce, ours)
    return Challenged(req.claims, said, version), {
        "version": version, "versions": [P.PROTOCOL_MIN, P.PROTOCOL_VERSION],
        "nonce": ours, "proof": auth.prove(secret, auth.DAEMON, said)}


def check(node: Node, said: Challenged | None, req: P.Hello) -> Grant:
    """The grant a hello's proof over ``said`` (the challenge it used up)
    earns.  Raises BAD_REQUEST (no challenge) or what ``auth.check_proof``
    raises (AUTH_FAILED, TOKEN_EXPIRED)."""
    if said is None or said is USED:
        raise BadRequest("say challenge before hello (once per connection)",
                         {"reason": "no_challenge"})
    assert req.proof is not None
    return auth.check_proof(node.keys, said.claims, req.proof, said.said,
                            cluster=node.cluster, node=node.node_id)


def replaced(node: Node, session_id: str, tenant: str, replaces: bytes | None) -> Any:
    """The other session of ``tenant`` whose bind nonce is ``replaces``,
    taken off the node's books (it no longer counts), or None."""
    old = node.by_nonce.get(replaces) if replaces else None
    if old is None or old.session_id == session_id or old.tenant != tenant:
        return None
    node.by_nonce.pop(old.nonce, None)
    node.sessions.pop(old.session_id, None)
    log.debug("session %s replaces %s", session_id, old.session_id)
    return old


def refused(node: Node, tenant: str, who: str) -> QuotaExceeded | None:
    """QUOTA_EXCEEDED (counted and logged) when the node holds --max-sessions,
    or ``tenant`` its --max-sessions-per-tenant."""
    limit = node.limits.max_sessions_per_tenant
    held = node.charges.held(tenant, "sessions")
    if node.authenticated() >= node.limits.max_sessions:
        error, reason = node.too_many_sessions(), "max_sessions"
    elif held >= limit:
        error, reason = QuotaExceeded(
            f"tenant {tenant!r} has {held} sessions on this node, at most {limit} at once; "
            "close one or try again later",
            {"limit": "max_sessions_per_tenant", "max_sessions_per_tenant": limit,
             "sessions": held}), "max_sessions_per_tenant"
    else:
        return None
    log.warning("refusing connection from %s: %s", who, error)
    node.metrics.refused(reason)
    return error


def peer_pid(sock: Any) -> int | None:
    """The pid of the process that connected to our Unix socket (as of
    connect; for the logs only)."""
    try:
        return shm.peer_cred(sock)[0]
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
        "version": version,
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
        # their frames (path "inline") instead of UCX; block puts and gets too.
        "inline_max": P.inline_max(node.limits.max_frame),
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
