"""The daemon: its listeners (TCP control, the same-host Unix socket, UCX
data), its lifecycle, and the state its sessions share (``node.Node``).

- Each control connection is a ``Session``, made by the listener.
- Shutdown goes in order: stop accepting, let in-flight transfers finish
  (bounded by ``drain_timeout``), close every session.
- The Unix socket is abstract by default (only this network namespace sees
  it); TCP clients are told its name and this kernel's boot id in ``hello``.
- A UCX endpoint binds to its session with the 16-byte nonce the client got
  in ``hello``, sent on ``BIND_TAG`` and answered with one byte; until then
  it is one of a bounded few (``admission.Pending``: the oldest goes).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import os
import resource
import secrets
import socket
import ssl
import stat
import time
from collections.abc import Iterator
from types import TracebackType
from typing import Any

import numpy as np

from rpcbuf.control.daemon.accounting.admission import Pending
from rpcbuf.control.daemon.accounting.charges import Charges, Limit, fd_reserve, handle_limits
from rpcbuf.control.daemon.accounting.registry import Registry
from rpcbuf.control.daemon.content.blocks import BlockStore
from rpcbuf.control.daemon.content.index import ContentIndex
from rpcbuf.control.daemon.content.modeldirs import ModelFiles
from rpcbuf.control.daemon.observe import logs
from rpcbuf.control.daemon.observe.metrics import Metrics
from rpcbuf.control.daemon.ops.node import Limits
from rpcbuf.control.daemon.service.gauges import StateCollector
from rpcbuf.control.daemon.sessions.inflight import SessionOps
from rpcbuf.control.daemon.sessions.intake import (
    BACKLOG,
    Acceptor,
    Handshaking,
    handshake,
    listen_tcp,
)
from rpcbuf.control.daemon.sessions.session import Session
from rpcbuf.control.ucx_errors import ucx_errors
from rpcbuf.control.wire.auth import Keyring
from rpcbuf.control.wire.errors import AuthFailed, QuotaExceeded, RpcBufError
from rpcbuf.control.wire.membership import DEFAULT_CLUSTER
from rpcbuf.dataplane import shm, sockets
from rpcbuf.dataplane.copypool import CopyPool
from rpcbuf.dataplane.janitor import Janitor
from rpcbuf.dataplane.kept import MAX_KEPT
from rpcbuf.dataplane.ucx import (
    BIND_TAG,
    NONCE_BYTES,
    DataEndpoint,
    DataListener,
    library as ucx_library,
)

__all__ = ["Daemon", "Limits"]
log = logging.getLogger("rpcbuf.daemon")
# The janitor's allowance for the daemon's own heap (``Daemon._own_heap``):
# generous, so that a daemon holding many blocks is never taken for a UCX flood.
OWN_HEAP_PER_BUFFER = 8 << 10
OWN_HEAP_PER_SESSION = 512 << 10


@contextlib.contextmanager
def binding(named: str, port: int | None = None) -> Iterator[None]:
    """A listener that cannot bind (``named``: the setting as the user gave
    it, ``--listen 0.0.0.0:7700``) says which it is and what to do about a
    port (or socket name) another program holds (an OSError: exit 2)."""
    try:
        yield
    except OSError as exc:
        if exc.errno != errno.EADDRINUSE:
            raise OSError(f"{named}: {exc.strerror or exc}") from None
        if port is None:
            raise OSError(f"{named}: the socket is in use (another rpcbufd still running?): "
                          "stop it, or name another socket") from None
        raise OSError(f"{named}: port {port} is already in use (another rpcbufd still "
                      f"running? `ss -ltnp 'sport = :{port}'` names the program): stop it, or "
                      "choose another port (0 picks a free one)") from None


class Daemon:
    """One node's daemon: serves ``registry`` to the holders of ``keys``."""

    def __init__(self, registry: Registry, keys: Keyring, *, node_id: str,
                 cluster: str = DEFAULT_CLUSTER, limits: Limits | None = None,
                 model_files: ModelFiles | None = None) -> None:
        """``node_id``: "" for ``default_node_id`` of the listener, once it
        listens; ``cluster``: the one this node is of (``--cluster``), which a
        token's audience must name (or this node in it); ``model_files``: the
        ``--model-dir`` directories node-local loads may read (None: such
        loads are refused)."""
        self.registry = registry
        self.blocks = BlockStore(registry)
        self.keys = keys
        self.node_id = node_id
        self.cluster = cluster
        self.limits = limits or Limits()
        self.sessions: dict[str, Session] = {}  # every connection, authenticated or not
        self.by_nonce: dict[bytes, Session] = {}
        self.by_handles_nonce: dict[bytes, SessionOps] = {}
        lim = self.limits
        self.unauthenticated: Pending[Session | Handshaking] = Pending(
            lim.max_unauthenticated, lim.max_unauthenticated_per_source)
        self.pending_endpoints: Pending[DataEndpoint] = Pending(lim.max_unauthenticated)
        self.charges = registry.charges  # what each tenant holds, and the limit of each
        set_limits(self.charges, lim, sum(p.holds_fds for p in registry.pools.values()))
        self.copies = CopyPool(lim.copy_threads)
        self.sweeps = CopyPool(lim.sweep_threads, name="rpcbuf-sweep")
        self.started_at = time.time()
        self.shutting_down = False
        self.stopped = False  # shutdown is done: tasks left are cancelled and let go
        self._server: asyncio.AbstractServer | Acceptor | None = None
        self._tls: ssl.SSLContext | None = None  # --tls-cert: each connection's handshake
        self._listener: DataListener | None = None
        self.janitor: Janitor | None = None
        self.listening: list[str] = []  # every TCP socket this process listens on
        self.ucx_library: dict[str, Any] = {}  # which UCX this process runs on
        self._local_server: asyncio.AbstractServer | None = None
        self.local_socket: str | None = None  # "@name" (abstract) or a path
        self._expiry_timer: asyncio.TimerHandle | None = None
        self.ucx_port = 0
        self.counters: dict[str, int] = {"bytes_stored": 0, "bytes_read": 0,
                                         "bytes_loaded_local": 0, "verify_failures": 0,
                                         "sessions_total": 0}
        # The same counts per tenant: what ``stats`` shows a tenant (see _stats)
        self.tenant_counters: dict[str, dict[str, int]] = {}
        self.metrics = Metrics(StateCollector(
            registry, self.blocks, self.counters, self.sessions, self.limits,
            self.unauthenticated, self.pending_endpoints))
        self.content = ContentIndex()  # dedup: main.py attaches the --cache-dir cache
        self.model_files = model_files

    # -- lifecycle --------------------------------------------------------------

    async def __aenter__(self) -> Daemon:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.shutdown()

    async def start(self, host: str, port: int, ucx_port: int,
                    tls: ssl.SSLContext | None = None, local_socket: str | None = "auto") -> None:
        """``local_socket``: "auto" (an abstract Unix socket named after our
        pid), None (no same-host path), "@name" (abstract) or a path."""
        with binding(f"--ucx-port {ucx_port}", ucx_port):
            self._listener = DataListener(self._on_endpoint, port=ucx_port)
        self.ucx_port = self._listener.port
        # Patience of one round: a store that waits longer for its buffer's
        # lock holds no one's sweep off; if its payload went, it fails TIMEOUT.
        self.janitor = Janitor(self.limits.hello_timeout, self.limits.hello_timeout,
                               self._claimable, self._dropped, allowance=self._own_heap)
        await self.janitor.start()
        self._tls = tls
        with binding(f"--listen {host}:{port}", port):
            if tls is None:
                self._server = await asyncio.get_running_loop().create_server(
                    functools.partial(Session, self), host, port, backlog=BACKLOG)
            else:  # the handshake is ours, counted from accept (_on_tls_socket)
                self._server = Acceptor(listen_tcp(host, port), self._on_tls_socket)
        self.address = self._server.sockets[0].getsockname()[:2]
        if not self.node_id:  # before the first await: no hello goes out without it
            self.node_id = default_node_id(self.address[1])
        if local_socket is not None:
            await self._start_local(local_socket)
        # Read once (one readlink per open fd, one memfd per buffer: 200 ms
        # at 20,000 buffers); what listens does not change after this.
        self.listening = sockets.listening()
        self.ucx_library = ucx_library()  # logged when UCX loaded (ucx.ucxx)
        log.info("listening control=%s:%d ucx=%d devices=%s node=%s", self.address[0],
                 self.address[1], self.ucx_port, ",".join(self.registry.pools), self.node_id)

    async def _start_local(self, name: str) -> None:
        if name == "auto":
            name = f"@rpcbufd-{os.getpid()}-{secrets.token_hex(4)}"
        path = "\0" + name[1:] if name.startswith("@") else name
        if not name.startswith("@"):
            _unlink_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:  # bound here: uvloop refuses abstract names (EINVAL)
            with binding(f"--local-socket {name}"):
                sock.bind(path)
        except BaseException:
            sock.close()
            raise
        self._local_server = await asyncio.get_running_loop().create_unix_server(
            functools.partial(Session, self), sock=sock, backlog=BACKLOG)
        if not name.startswith("@"):
            os.chmod(path, 0o666)  # tokens authenticate, as on TCP
        self.local_socket = name
        self.boot_id = shm.boot_id()

    def local_info(self) -> dict[str, Any] | None:
        """What a TCP client needs to find the same-host path."""
        if self.local_socket is None:
            return None
        return {"socket": self.local_socket, "boot_id": self.boot_id, "pid": os.getpid()}

    async def shutdown(self) -> None:
        """Stop accepting, let in-flight transfers finish (bounded), close all."""
        if self.shutting_down:
            return
        self.shutting_down = True
        log.info("shutting down: %d sessions", len(self.sessions))
        if self._server is not None:
            self._server.close()
        if self._local_server is not None:
            self._local_server.close()
            if self.local_socket and not self.local_socket.startswith("@"):
                with contextlib.suppress(OSError):
                    os.unlink(self.local_socket)
        if self._listener is not None:
            self._listener.close()
        if self.janitor is not None:
            await self.janitor.stop()
        busy = [t for s in self.sessions.values() for t in s.ops.transfers]
        if busy:
            log.info("waiting for %d in-flight transfers", len(busy))
            await asyncio.wait(busy, timeout=self.limits.drain_timeout)
        closing = [s.close("daemon shutting down") for s in list(self.sessions.values())]
        await asyncio.gather(*closing, return_exceptions=True)
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
        self.copies.close()
        await self.content.aclose(self.limits.drain_timeout)  # its disk writes run on sweeps
        self.sweeps.close()
        if self.model_files is not None:
            self.model_files.close()
        self.metrics.close()
        self.stopped = True
        log.info("stopped")

    @property
    def devices(self) -> list[dict[str, Any]]:
        """Each device's figures (what the registry entry advertises)."""
        return [p.describe() for p in self.registry.pools.values()]

    def status_line(self) -> str:
        """One line for systemd's STATUS=."""
        used = sum(p.allocator.stats().used for p in self.registry.pools.values())
        total = sum(p.arena.size for p in self.registry.pools.values())
        return (f"serving {len(self.sessions)} sessions, {used} of {total} bytes held; "
                f"control {self.address[0]}:{self.address[1]}, ucx {self.ucx_port}")

    # -- keys -------------------------------------------------------------------

    def set_keys(self, keys: Keyring) -> int:
        """SIGHUP re-read the secret file: new hellos are checked against
        ``keys``, and a session whose token's key is gone (or now holds another
        secret) ends at once with AUTH_FAILED: revoking a key revokes its
        sessions too.  Returns how many ended."""
        self.keys = keys
        ended = 0
        for session in list(self.sessions.values()):
            grant = session.grant
            if grant is not None and keys.keys.get(grant.kid) != grant.key:
                session.end(AuthFailed(f"the key {grant.kid!r} that signed this session's "
                                       "token was revoked"))
                ended += 1
        return ended

    # -- leases -----------------------------------------------------------------

    def schedule_expiry(self) -> None:
        times = [t for t in (self.registry.next_expiry(), self.blocks.next_expiry())
                 if t is not None]
        when = min(times) if times else None
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
            self._expiry_timer = None
        if when is None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, when - time.time())
        self._expiry_timer = loop.call_later(delay, self._expire)

    def _expire(self) -> None:
        self._expiry_timer = None
        for buf in self.registry.expire():
            logs.write({"op": "expire", "tenant": buf.tenant, "session": None,
                        "buffer": buf.buffer_id, "device": buf.pool.key, "offset": 0,
                        "bytes": buf.alloc_size, "code": "OK", "duration_s": 0.0,
                        "note": "lease ran out"})
        for block in self.blocks.expire():
            buf = block.buf
            logs.write({"op": "block_expire", "tenant": buf.tenant, "session": None,
                        "buffer": buf.buffer_id, "device": buf.pool.key, "offset": 0,
                        "bytes": block.nbytes, "code": "OK", "duration_s": 0.0,
                        "note": "ttl ran out"})
        self.schedule_expiry()

    # -- connections ------------------------------------------------------------

    async def _on_tls_socket(self, sock: socket.socket) -> None:
        """A TLS connection, just accepted: one of the unauthenticated ones
        from now, its handshake included, within the hello deadline."""
        tls = self._tls
        if self.shutting_down or tls is None:
            sock.close()
            return
        loop = asyncio.get_running_loop()
        accepted = loop.time()
        try:
            peer = sock.getpeername()
        except OSError:  # gone already
            sock.close()
            return
        handshaking = Handshaking(sock, peer, accepted)
        for old in self.unauthenticated.add(handshaking, ("ip", peer[0])):
            old.evict()
        handshaking.task = task = loop.create_task(handshake(
            functools.partial(Session, self, handshaking), sock, tls, self.limits.hello_timeout))
        try:
            await task
        except (ssl.SSLError, OSError, TimeoutError, ConnectionError,
                asyncio.CancelledError) as exc:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # we are cancelled, not only the handshake
            # A flood of these must not flood the log: said at debug.
            log.debug("TLS handshake with %s:%s failed: %r", peer[0], peer[1], exc)
        finally:
            self.unauthenticated.discard(handshaking)

    def authenticated(self) -> int:
        """Sessions whose hello succeeded (what --max-sessions bounds)."""
        return sum(1 for s in self.sessions.values() if s.tenant is not None)

    def too_many_sessions(self) -> QuotaExceeded:
        """QUOTA_EXCEEDED, not SHUTTING_DOWN: the node is healthy and stays up;
        a configured allowance is used up and frees as other sessions close."""
        limit = self.limits.max_sessions
        return QuotaExceeded(
            f"this node serves at most {limit} sessions at once; try again later",
            {"limit": "max_sessions", "max_sessions": limit})

    def _own_heap(self) -> int:
        """A generous estimate of the heap the daemon grew by for what tenants
        hold (the janitor's byte budget comes on top): the most records there
        have been, each session, and the frame bytes charged to tenants."""
        return (OWN_HEAP_PER_BUFFER * self.registry.records_peak
                + OWN_HEAP_PER_SESSION * len(self.sessions)
                + self.charges.total("frame_bytes"))

    def _claimable(self, since: float) -> bool:
        """Whether a session with a data endpoint may own an unexpected UCX
        message older than ``since``."""
        return any(s.ops.ep is not None and s.ops.may_claim(since)
                   for s in self.sessions.values())

    def _dropped(self, count: int, nbytes: int) -> None:
        self.metrics.unexpected_dropped(count, nbytes)
        log.warning("dropped %d UCX messages (%d bytes) that no request asked for within "
                    "%.0fs", count, nbytes, self.limits.hello_timeout)

    async def _on_endpoint(self, ep: DataEndpoint) -> None:
        # Until it binds, an endpoint is one of a bounded few (the oldest goes).
        for old in self.pending_endpoints.add(ep):
            log.warning("data endpoint dropped before binding: %d others wait to bind",
                        self.limits.max_unauthenticated)
            old.abort()
        nonce = np.zeros(NONCE_BYTES, dtype=np.uint8)
        try:
            with ucx_errors("receiving the bind nonce"):
                await asyncio.wait_for(ep.recv(nonce, BIND_TAG), self.limits.hello_timeout)
        except (TimeoutError, RpcBufError) as exc:
            if ep in self.pending_endpoints:  # (else: dropped above, and said so)
                log.warning("data endpoint dropped before binding: %s", exc or "timeout")
            ep.abort()
            return
        finally:
            self.pending_endpoints.discard(ep)
        session = self.by_nonce.pop(nonce.tobytes(), None)
        ok = session is not None and session.tenant is not None and session.ops.ep is None
        try:
            with ucx_errors("the bind answer"):
                await ep.send(np.array([1 if ok else 0], dtype=np.uint8), BIND_TAG)
        except RpcBufError:
            ok = False
        if not ok or session is None:
            log.warning("data endpoint with an unknown nonce refused")
            ep.abort()
            return
        if self.janitor is not None:  # a receive for a message it dropped fails at once
            ep.dropped = self.janitor.was_dropped
        session.bind(ep)


def set_limits(charges: Charges, lim: Limits, host_pools: int) -> None:
    """The daemon's limits in the table of what each tenant holds: fds and
    mappings (from what this process may open and map), sessions and
    buffered control bytes (at least one whole frame)."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            map_count = int(f.read())
    except (OSError, ValueError):
        map_count = 65530  # the kernel's default
    reserve = lim.fd_reserve
    if reserve is None:
        reserve = fd_reserve(lim.max_sessions, lim.max_unauthenticated)
    for kind, limit in handle_limits(nofile, reserve, host_pools * MAX_KEPT,
                                     lim.max_fds_per_tenant, map_count).items():
        charges.set_limit(kind, limit)
    charges.set_limit("sessions", Limit(lim.max_sessions_per_tenant, lim.max_sessions,
                                        "--max-sessions-per-tenant", "--max-sessions"))
    charges.set_limit("frame_bytes", Limit(
        max(lim.max_buffered_per_tenant, lim.max_frame + 4),  # a whole frame and its length
        None, "--max-buffered-per-tenant"))


def _unlink_stale(path: str) -> None:
    """Remove a socket file an earlier run left behind (nothing else)."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def default_node_id(port: int) -> str:
    """``host:port``: this host's name and the control listener's port.
    Unique per daemon on a host (two cannot listen on one port) and the same
    across restarts (a restarted daemon takes its own id back), with nothing
    to persist; the host name alone made two daemons on a host one node."""
    return f"{socket.gethostname()[:120]}:{port}"
