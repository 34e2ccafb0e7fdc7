"""A session's hello and what comes with it: the token's proof checked, the
session's slot taken (``--max-sessions``, ``--max-sessions-per-tenant``, or
the slot of the TCP session a Unix socket session replaces), its token's
deadline set, and the same-host path granted to a Unix socket session that
asks for it; then the handle channel that path needs, bound by the client's
second connection (``bind_handles``, ``take_handles``).  Functions of the
session they serve (``session.py``, seen through ``GreetedSession`` here), which calls
them from its dispatch.

Hello is two frames (protocol 4; ``wire/auth.py`` has the design): the
``challenge`` names the token's claims and a client nonce, and is answered
with our nonce and our proof, so the client knows it reached a holder of the
node's key; the ``hello`` then carries the client's proof over the same
transcript.  The challenge is said once per connection, and a hello uses it
up (right or wrong): a captured hello, or a proof for another connection's
nonce, opens nothing.  The bearer token itself never arrives: a hello that
carries one (a development build's, versions 1 to 3) has a field protocol 4
does not know, and is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from rpcbuf.control.daemon.accounting.registry import Pool, Registry
from rpcbuf.control.daemon.data.handles import HandleChannel, same_process
from rpcbuf.control.daemon.data.paths import StagedPath
from rpcbuf.control.daemon.ops.node import Node
from rpcbuf.control.daemon.sessions.hello import answer as hello_answer
from rpcbuf.control.daemon.sessions.intake import Intake
from rpcbuf.control.wire import auth, protocol as P
from rpcbuf.control.wire.auth import Grant
from rpcbuf.control.wire.errors import AuthFailed, BadRequest, QuotaExceeded
from rpcbuf.dataplane import staging
from rpcbuf.dataplane.ucx import NONCE_BYTES

log = logging.getLogger("rpcbuf.daemon")


class GreetedSession(Protocol):
    """What a hello sets and reads of its session (``session.Session``)."""

    daemon: Node
    registry: Registry
    writer: asyncio.StreamWriter
    intake: Intake
    session_id: str
    nonce: bytes
    unix: bool
    peer: Any
    peer_pid: int | None
    tenant: str | None
    grant: Grant | None
    challenged: Challenged | None
    token_deadline: float
    token_timer: asyncio.TimerHandle | None
    handles: HandleChannel | None
    handles_nonce: bytes | None
    same_host: StagedPath | None
    staging_charge: Pool | None
    slot_charged: bool  # its session slot is charged to its tenant (charges' "sessions")
    copy_stop: threading.Event
    transfers: set[asyncio.Task[None]]

    @property
    def closed(self) -> bool: ...
    @property
    def owner(self) -> str: ...
    def abort(self, why: str) -> None: ...
    def send(self, message: dict[str, Any]) -> None: ...
    def token_ran_out(self) -> None: ...
    def transfer_expired(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Challenged:
    """A challenge answered, waiting for its hello: what the proof covers."""

    claims: str
    said: bytes  # the transcript (auth.transcript)
    version: int


USED = Challenged("", b"", 0)  # a hello took it: no second challenge on this connection


def challenge(s: GreetedSession, req: P.Challenge) -> dict[str, Any]:
    """Our nonce and our proof for the claims the client names; one try per
    connection, whatever its outcome.  Raises BAD_REQUEST (said twice, or
    after hello; versions that do not meet; a nonce not 32 bytes) or
    AUTH_FAILED (claims that name no key we hold)."""
    if s.tenant is not None or s.challenged is not None:
        raise BadRequest("challenge is said once per connection, before hello")
    s.challenged = USED  # once, right or wrong: no probing key ids on one connection
    version = P.negotiate(P.challenge_versions(req))  # else BAD_REQUEST naming both
    if len(req.nonce) != auth.NONCE_BYTES:
        raise BadRequest(f"challenge: nonce must be {auth.NONCE_BYTES} bytes")
    _, secret = auth.signature(s.daemon.keys, req.claims)
    ours = os.urandom(auth.NONCE_BYTES)
    said = auth.transcript(version, req.claims, req.nonce, ours)
    s.challenged = Challenged(req.claims, said, version)
    return {"version": version, "versions": [P.PROTOCOL_MIN, P.PROTOCOL_VERSION],
            "nonce": ours, "proof": auth.prove(secret, auth.DAEMON, said)}


def hello(s: GreetedSession, req: P.Hello) -> dict[str, Any]:
    if s.tenant is not None:
        raise BadRequest("hello was already said on this connection")
    if req.proof is None:
        raise BadRequest("hello carries a proof over the challenge's nonces (protocol "
                         f"{P.PROTOCOL_VERSION}); the token itself is never sent",
                         {"reason": "no_proof"})
    said, s.challenged = s.challenged, USED  # one hello per challenge, right or wrong
    if said is None or said is USED:
        raise BadRequest("say challenge before hello (once per connection)",
                         {"reason": "no_challenge"})
    version = said.version
    grant = auth.check_proof(s.daemon.keys, said.claims, req.proof, said.said,
                             cluster=s.daemon.cluster, node=s.daemon.node_id)
    tenant = grant.tenant
    take_slot(s, tenant, req.replaces)
    s.tenant, s.grant = tenant, grant
    s.daemon.unauthenticated.discard(s)  # counts toward --max-sessions from now
    s.intake.said_hello()
    if grant.expires_at is not None:
        left = grant.expires_at - time.time()
        s.token_deadline = time.perf_counter() + left
        s.token_timer = asyncio.get_running_loop().call_later(
            max(0.0, left), s.token_ran_out)
    same_host, why = _same_host(s, req)
    log.info("session %s tenant=%s from %s%s", s.session_id, s.tenant,
             s.peer or f"pid {s.peer_pid}", " (same host)" if same_host else "")
    return hello_answer(s.daemon, s.session_id, grant, s.nonce, s.unix,
                        s.handles_nonce, why, version)

def take_slot(s: GreetedSession, tenant: str, replaces: bytes | None) -> None:
    """A Unix socket session may take over the slot of the TCP session it
    replaces (which ends now); any other checks --max-sessions and
    --max-sessions-per-tenant, and past either gets a connection-level
    QUOTA_EXCEEDED and is closed."""
    old = s.daemon.by_nonce.get(replaces) if replaces and s.unix else None
    if old is not None and old is not s and old.tenant == tenant:
        s.daemon.by_nonce.pop(old.nonce, None)
        s.daemon.sessions.pop(old.session_id, None)  # it no longer counts
        s.slot_charged, old.slot_charged = old.slot_charged, False  # its charge is ours
        log.debug("session %s replaces %s", s.session_id, old.session_id)
        with contextlib.suppress(Exception):
            old.writer.close()  # its run loop ends, close() cleans up
        return
    error: QuotaExceeded | None
    if s.daemon.authenticated() >= s.daemon.limits.max_sessions:
        error, reason = s.daemon.too_many_sessions(), "max_sessions"
    else:
        error, reason = _too_many_of(s, tenant), "max_sessions_per_tenant"
    if error is not None:
        log.warning("refusing connection from %s: %s", s.peer or f"pid {s.peer_pid}",
                    error)
        s.daemon.metrics.refused(reason)
        s.send(P.error_response(None, error))
        with contextlib.suppress(Exception):
            s.writer.close()  # its hello is read: nothing unread to reset the frame
        raise error
    s.daemon.charges.charge(tenant, "sessions")  # checked above: the table counts it
    s.slot_charged = True

def _too_many_of(s: GreetedSession, tenant: str) -> QuotaExceeded | None:
    """QUOTA_EXCEEDED when ``tenant`` holds its --max-sessions-per-tenant
    already (so one tenant cannot take every session of the node)."""
    limit = s.daemon.limits.max_sessions_per_tenant
    held = s.daemon.charges.held(tenant, "sessions")
    if held < limit:
        return None
    return QuotaExceeded(
        f"tenant {tenant!r} has {held} sessions on this node, at most {limit} at once; "
        "close one or try again later",
        {"limit": "max_sessions_per_tenant", "max_sessions_per_tenant": limit,
         "sessions": held})

def _same_host(s: GreetedSession, req: P.Hello) -> tuple[bool, str]:
    """Grant the same-host path to a Unix socket session that asks for it
    (``handles``): the client binds the handle channel next
    with ``handles_nonce``.  Nothing of the client's is trusted: the
    daemon only hands out handles and copies its own memory."""
    if not req.handles:
        return False, ""
    if not s.unix:
        return False, "the same-host path needs the daemon's Unix socket"
    # The staging area is the tenant's memory while the session lives: a
    # tenant whose quota cannot spare it gets the network path instead.
    pool = s.registry.host_pool()
    if pool is not None:
        assert s.tenant is not None
        try:
            s.registry.charge(s.tenant, pool, staging.SIZE)
        except QuotaExceeded as exc:
            return False, f"no room in this tenant's quota for its staging area: {exc}"
        s.staging_charge = pool
    s.handles_nonce = os.urandom(NONCE_BYTES)
    s.daemon.by_handles_nonce[s.handles_nonce] = s
    return True, ""

def bind_handles(s: GreetedSession, req: P.BindHandles) -> None:
    """This connection is a session's handle channel: check it, hand its
    socket to that session, and let this one go (it never says hello)."""
    if s.tenant is not None or not s.unix:
        raise BadRequest("bind_handles is the only frame of a second connection to the "
                         "daemon's Unix socket")
    owner = s.daemon.by_handles_nonce.get(req.nonce)
    mine = s.writer.get_extra_info("socket")
    if owner is None or owner.closed or owner.handles is not None:
        raise AuthFailed("no session waits for this handle channel")
    if not same_process(mine, owner.writer.get_extra_info("socket")):
        raise AuthFailed("the handle channel must come from the session's own process")
    s.daemon.by_handles_nonce.pop(req.nonce, None)
    owner.handles_nonce = None
    sock = mine.dup()
    s.daemon.unauthenticated.discard(s)
    _closed_quietly(s)
    take_handles(owner, sock)

def _closed_quietly(s: GreetedSession) -> None:
    """Drop this connection's transport (its socket lives on as a dup)."""
    with contextlib.suppress(Exception):
        s.writer.transport.abort()

def take_handles(s: GreetedSession, sock: socket.socket) -> None:
    """Our handle channel is bound: make the staging area, send it, and
    turn on the same-host path."""
    try:
        channel = HandleChannel(sock)
    except OSError as exc:
        sock.close()
        log.warning("session %s: no staging area: %s", s.session_id, exc)
        return
    if s.closed:
        channel.close()
        return
    s.handles = channel
    limits, tenant = s.daemon.limits, s.owner
    s.same_host = StagedPath(
        channel.staging, s.daemon.copies, tenant, timeout=limits.transfer_timeout,
        stop=s.copy_stop, expired=s.transfer_expired,
        stopped=lambda: s.daemon.stopped)
    task = asyncio.get_running_loop().create_task(_send_staging(s, channel))
    s.transfers.add(task)
    task.add_done_callback(s.transfers.discard)
    log.debug("session %s bound its handle channel", s.session_id)

async def _send_staging(s: GreetedSession, channel: HandleChannel) -> None:
    try:
        await channel.start()
    except (OSError, TimeoutError) as exc:
        log.warning("session %s: sending the staging area failed: %s", s.session_id, exc)
        s.abort("the handle channel failed")
