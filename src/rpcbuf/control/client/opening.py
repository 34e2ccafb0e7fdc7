"""Opening a session: reach the daemon, say hello, maybe switch to its Unix socket.

The token never crosses the wire (``wire/auth.py``): the client sends its
claims and a nonce, checks the daemon's proof that it holds the node's key,
then proves it holds the token's signature over both nonces.  An impostor
gets no token and nothing to replay; TLS stops an active relay.  So the
session goes only to a peer that proved who it is before hello:

- TLS: a certificate from the trusted CAs for the host dialed (an
  SSLContext that checks less counts as plaintext);
- a Unix socket: the kernel's peer credentials (``check_unix_peer``);
- plain TCP: loopback only, unless ``insecure`` (``InsecureTransport``).

On the daemon's host the session reconnects on its Unix socket; a second
connection there becomes the handle channel.  Hello is said once, with
``versions: [oldest, newest]``: a refusal is raised as it came, never
retried "the old way".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import os
import socket
import ssl
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

from rpcbuf.control.client.connection import ControlConnection, result_of
from rpcbuf.control.client.handles import Handles
from rpcbuf.control.client.hello import HelloAnswer, Local, check_challenge, parse_hello
from rpcbuf.control.wire import auth, protocol as P
from rpcbuf.control.wire.errors import (
    BadRequest,
    ConnectionLost,
    Forbidden,
    RpcBufError,
    Timeout,
)
from rpcbuf.control.wire.fields import Claims
from rpcbuf.control.wire.units import join_host_port, split_host_port
from rpcbuf.dataplane import shm

DEFAULT_PORT = 7700
SILENT_PEER = 5.0  # seconds a hello may go without a byte back (see _hello)
log = logging.getLogger("rpcbuf.client")

# ``tls=``: True (the system's CAs), a CA file, an SSLContext (your own CA,
# a client certificate), False (plain TCP), None ($RPCBUF_CA, else plain TCP).
TlsOption: TypeAlias = bool | ssl.SSLContext | str | os.PathLike[str] | None
_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


class InsecureTransport(BadRequest):
    """Plain TCP to an address that is not loopback: the token was not sent."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is loopback (127/8, ::1, localhost) as a literal,
    never resolved: no name server can make it one."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def insecure_default() -> bool:
    return os.environ.get("RPCBUF_INSECURE", "").strip().lower() in _YES


def tls_context(tls: TlsOption) -> ssl.SSLContext | None:
    """The TLS context ``tls`` asks for (None: plain TCP); server
    verification always on.  Raises BAD_REQUEST for a CA file that cannot be
    loaded."""
    if tls is None:
        env = os.environ.get("RPCBUF_CA", "").strip()
        if not env or env.lower() in _NO:
            return None
        return _with_ca(env, "$RPCBUF_CA")
    if tls is True:
        return ssl.create_default_context()
    if tls is False:
        return None
    if isinstance(tls, ssl.SSLContext):
        return tls
    return _with_ca(os.fspath(tls), "tls")


def _with_ca(path: str, given: str) -> ssl.SSLContext:
    try:
        return ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise BadRequest(f"{given}: cannot load the CA file {path!r}: {exc}",
                         {"reason": "bad_ca", "ca": path}) from None


def _verifies(ctx: ssl.SSLContext | None) -> bool:
    """Whether ``ctx`` checks the peer's chain and its name."""
    return ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname


def _refuse_unproven(addr: str, host: str, tls: ssl.SSLContext | None) -> None:
    how = "in plaintext" if tls is None else ("over TLS that does not verify the node "
                                              "(CERT_NONE or check_hostname off)")
    raise InsecureTransport(
        f"refusing to send the token {how} to {addr} (not a loopback address): "
        "anyone on the path could read it, and whoever answers there would get it. Use "
        "TLS (the daemon's --tls-cert/--tls-key; here tls= a CA file, True or an "
        "ssl.SSLContext, or $RPCBUF_CA, or the CLI's --ca), or pass insecure=True (CLI "
        "--insecure, $RPCBUF_INSECURE=1) on a network you trust",
        {"reason": "insecure_transport", "host": host})


def same_host_default() -> bool | None:
    """``RPCBUF_SAME_HOST``: 0 = never, 1 = required, unset/auto = when possible."""
    value = os.environ.get("RPCBUF_SAME_HOST", "auto").strip().lower()
    if value in ("0", "false", "no", "off", "never"):
        return False
    if value in ("1", "true", "yes", "on", "always"):
        return True
    return None


def parse_addr(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT``; ``HOST``: ``DEFAULT_PORT``) -> ``(host,
    port)``.  Raises BAD_REQUEST."""
    try:
        return split_host_port(addr, DEFAULT_PORT)
    except ValueError as exc:
        raise BadRequest(f"bad address {addr!r}: {exc} (want HOST:PORT)") from None


def with_port(addr: str) -> str:
    """``addr`` with the port tried (``HOST`` -> ``HOST:7700``); anything
    else as it is."""
    if "://" in addr or addr.startswith("unix:"):
        return addr
    try:
        return join_host_port(*parse_addr(addr))
    except BadRequest:
        return addr


@dataclass(frozen=True, slots=True)
class Opened:
    """A session whose hello succeeded, and the host its UCX endpoint dials."""

    conn: ControlConnection
    hello: HelloAnswer
    raw: dict[str, Any]
    host: str
    handles: Handles | None = None  # the same-host path's handle channel, when bound


async def open_session(addr: str, token: str, timeout: float | None,
                       tls: TlsOption, same_host: bool | None,
                       insecure: bool | None = None) -> Opened:
    """Connect and say hello; on the daemon's host, switch to its Unix
    socket (``same_host``).  Raises AUTH_FAILED, TOKEN_EXPIRED,
    CONNECTION_LOST, TIMEOUT, QUOTA_EXCEEDED, SHUTTING_DOWN, FORBIDDEN,
    BAD_REQUEST."""
    if same_host is None:
        same_host = same_host_default()
    if addr.startswith("unix:"):  # the daemon's Unix socket itself: unix:PATH, unix:@NAME
        host, path = "127.0.0.1", addr[len("unix:"):]
        opened = await _open(addr, timeout, token, unix=path, handles=same_host is not False)
    else:
        host, port = parse_addr(addr)
        addr = join_host_port(host, port)  # errors name the port tried, given or not
        tls_ctx = tls_context(tls)
        if not _verifies(tls_ctx) and not is_loopback(host) \
                and not (insecure_default() if insecure is None else insecure):
            _refuse_unproven(addr, host, tls_ctx)  # before anything is dialed
        if host.lower() == "localhost" and not _verifies(tls_ctx):
            host = "127.0.0.1"  # the name, resolved, could point anywhere: dial the literal
        opened = await _open(addr, timeout, token, tcp=(host, port, tls_ctx))
        local = opened[1].local
        # Under TLS the same-host path only when asked for: it leaves TLS out.
        if local is not None and same_host is not False and (tls_ctx is None or same_host):
            try:
                switched = await _same_host(addr, timeout, token, local, same_host,
                                            replaces=opened[1].bind_nonce)
            except BaseException:  # refused, or connect's deadline
                opened[0].close()
                raise
            if switched is not None:
                opened[0].close()  # the TCP session held nothing yet
                opened = switched
    conn, hello, raw, handles = opened
    if same_host and handles is None:
        conn.close()
        why = hello.same_host_why or "the daemon offers no same-host socket"
        raise BadRequest(f"same_host=True, but the same-host path is not available: {why}")
    return Opened(conn, hello, raw, host, handles)


_Hello = tuple[ControlConnection, HelloAnswer, dict[str, Any], Handles | None]


async def _hello(conn: ControlConnection, req: P.Request, timeout: float | None,
                 addr: str) -> dict[str, Any]:
    """Say hello within ``timeout``.  Raises the daemon's refusal, and
    TIMEOUT (``silent_peer``) after ``SILENT_PEER`` s without a byte: a UCX
    listener takes the connection and says nothing, so a wrong port shows at
    once."""
    fut = conn.submit(conn.next_id(), req)
    async with asyncio.timeout(timeout):
        if timeout is None or timeout > SILENT_PEER:
            await asyncio.wait([fut], timeout=SILENT_PEER)
            if not fut.done() and not conn.heard:
                fut.cancel()
                raise Timeout(f"took the connection but said nothing to the hello in "
                              f"{SILENT_PEER:g} s (rpcbufd answers at once)",
                              {"reason": "silent_peer", "addr": addr})
        return result_of(await fut)


async def _open(addr: str, timeout: float | None, token: str, *,
                tcp: tuple[str, int, ssl.SSLContext | None] | None = None,
                unix: str | None = None, handles: bool = False, replaces: bytes | None = None,
                daemon_pid: int | None = None) -> _Hello:
    """Connect and say hello; with ``handles`` (a Unix socket) ask for the
    same-host path and bind its channel.  A Unix socket's peer is checked
    before the token goes out; the answer before anything trusts it."""
    peer_pid = 0
    try:
        async with asyncio.timeout(timeout):
            loop = asyncio.get_running_loop()
            if unix is not None:
                sock = await _unix_socket(unix)
                try:
                    peer_pid = check_unix_peer(sock, unix, daemon_pid)
                except BaseException:
                    sock.close()
                    raise
                _, conn = await loop.create_unix_connection(ControlConnection, sock=sock)
            else:
                assert tcp is not None
                _, conn = await loop.create_connection(ControlConnection, tcp[0], tcp[1],
                                                       ssl=tcp[2])
    except TimeoutError:
        raise Timeout(f"connecting to {addr} timed out") from None
    except OSError as exc:
        raise _unreached(addr, tcp, exc) from exc
    try:
        claims, secret = auth.split_token(token)
        nonce = os.urandom(auth.NONCE_BYTES)
        said = await _hello(conn, P.Challenge(
            claims=Claims(claims), nonce=nonce, versions=[P.PROTOCOL_MIN, P.PROTOCOL_VERSION]),
            timeout, addr)
        version, transcript = check_challenge(said, addr, claims, nonce, secret)
        conn.proven()
        hello = P.Hello(proof=auth.prove(secret, auth.CLIENT, transcript),
                        handles=True if handles and unix is not None else None,
                        replaces=replaces)
        answer = await _hello(conn, hello, timeout, addr)
        parsed = parse_hello(answer, unix=unix is not None)
        if parsed.version != version:
            raise BadRequest(f"the daemon at {addr} chose protocol {version} in the "
                             f"challenge and {parsed.version} in hello",
                             {"reason": "bad_hello", "field": "version"})
        channel = None
        if unix is not None and parsed.handles_nonce is not None:
            channel, why = await _bind(unix, peer_pid, parsed.handles_nonce, timeout)
            if channel is None:
                answer = {**answer, "same_host": False, "same_host_why": why}
                parsed = dataclasses.replace(parsed, same_host=False, same_host_why=why)
        return conn, parsed, answer, channel
    except TimeoutError:
        conn.close()
        raise Timeout(f"handshake with {addr} timed out") from None
    except ConnectionLost:
        conn.close()
        if conn.lost is not None and not isinstance(conn.lost, ConnectionLost):
            raise conn.lost from None  # the daemon said why: QUOTA_EXCEEDED, SHUTTING_DOWN
        raise
    except BaseException:
        conn.close()
        raise


def _unreached(addr: str, tcp: tuple[str, int, ssl.SSLContext | None] | None,
               exc: OSError) -> ConnectionLost:
    """CONNECTION_LOST for a failed dial (``reason: tls``: a failed handshake)."""
    if tcp is not None and tcp[2] is not None and isinstance(
            exc, (ssl.SSLError, ConnectionResetError)):
        why = exc if isinstance(exc, ssl.SSLError) else \
            "the peer hung up during the handshake: does it speak TLS?"
        return ConnectionLost(f"TLS with {addr} failed ({why}): the peer did not prove it is "
                              f"the node (a certificate for {tcp[0]} signed by a CA this "
                              "client trusts); the token was not sent", {"reason": "tls"})
    return ConnectionLost(f"cannot reach rpcbufd at {addr}: {exc or type(exc).__name__}")


async def _bind(unix: str, daemon_pid: int, nonce: bytes, timeout: float | None
                ) -> tuple[Handles | None, str]:
    """The handle channel: a second connection to the same daemon process,
    bound with ``nonce``; (None, why) when it cannot be had."""
    try:
        sock = await _unix_socket(unix)
    except OSError as exc:
        return None, f"cannot open the handle channel: {exc}"
    try:
        check_unix_peer(sock, unix, daemon_pid or None)
        return await Handles.bind(sock, nonce, timeout or 30.0), ""
    except (RpcBufError, OSError) as exc:
        sock.close()
        log.debug("handle channel at unix:%s refused: %s", unix, exc)
        return None, f"the handle channel was refused: {exc}"


async def _unix_socket(name: str) -> socket.socket:
    """A socket connected to a path or "@NAME" (uvloop refuses abstract
    names, so we connect it ourselves)."""
    path = "\0" + name[1:] if name.startswith("@") else name
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, path)
    except BaseException:
        sock.close()
        raise
    return sock


def check_unix_peer(sock: socket.socket, name: str, daemon_pid: int | None,
                    trusted: frozenset[int] | None = None) -> int:
    """Check who listens on ``name`` before our token goes to it; return the
    peer's pid (0: outside our pid namespace).  Trusted (by ``SO_PEERCRED``):
    root, us, or the socket file's owner; the peer must be alive, and the pid
    the TCP hello named (``daemon_pid``) when given: an abstract name has no
    owner, so there the pid is the proof.  Raises FORBIDDEN."""
    pid, uid, _ = shm.peer_cred(sock)
    ok_uids = {0, os.getuid()} if trusted is None else set(trusted)
    if not name.startswith("@"):
        with contextlib.suppress(OSError):
            ok_uids.add(os.stat(name).st_uid)
    who = f"the process behind unix:{name} (pid {pid}, uid {uid})"
    if pid and not _alive(pid):
        raise Forbidden(f"{who} does not exist; the token was not sent")
    if daemon_pid is not None and pid and pid != daemon_pid:
        raise Forbidden(f"{who} is not the daemon (pid {daemon_pid}); the token was not sent")
    if uid not in ok_uids and (daemon_pid is None or not pid):
        raise Forbidden(f"{who} is not trusted (root, this user, or the socket file's "
                        f"owner); the token was not sent", {"uid": uid})
    return pid


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists (signal 0; works under hidepid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    return True


async def _same_host(addr: str, timeout: float | None, token: str, local: Local,
                     required: bool | None, replaces: bytes | None) -> _Hello | None:
    """Reconnect on the daemon's Unix socket if it is on this host.  None: stay."""
    if local.boot_id != shm.boot_id():
        return None  # another host (or kernel)
    sock = local.socket
    try:
        return await _open(f"unix:{sock}", timeout, token, unix=sock, handles=True,
                           replaces=replaces, daemon_pid=local.pid)
    except RpcBufError as exc:
        # Another network namespace (abstract sockets are per namespace), a
        # socket we may not open, a refused hello: the network path still works.
        if required:
            raise
        log.debug("same-host socket %s of %s unreachable: %s", sock, addr, exc)
        return None


class _Closable(Protocol):
    async def close(self) -> None: ...


_C = TypeVar("_C", bound=_Closable)


class Opening(Generic[_C]):
    """Something being opened: ``await`` it, or ``async with`` (closed on exit)."""

    def __init__(self, open_: Callable[[], Awaitable[_C]]) -> None:
        self._open = open_
        self._opened: _C | None = None

    def __await__(self) -> Generator[Any, None, _C]:
        return self._open().__await__()

    async def __aenter__(self) -> _C:
        self._opened = await self._open()
        return self._opened

    async def __aexit__(self, *exc: object) -> None:
        if self._opened is not None:
            await self._opened.close()
