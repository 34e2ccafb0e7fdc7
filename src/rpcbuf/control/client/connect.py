"""``rpcbuf.connect``: a session with one rpcbufd, as an ``RpcContext``
(``context.py``), awaited or used with ``async with``.
"""

from __future__ import annotations

from rpcbuf.control.client.context import RpcContext
from rpcbuf.control.client.opening import Opening, TlsOption


class Connector(Opening[RpcContext]):
    """What ``connect()`` returns: ``await`` it, or use it with ``async with``."""

    def __init__(self, addr: str, token: str, timeout: float | None,
                 max_inflight: int | None = None, tls: TlsOption = None,
                 same_host: bool | None = None, insecure: bool | None = None) -> None:
        super().__init__(lambda: RpcContext.connect(addr, token, timeout, max_inflight, tls,
                                                    same_host, insecure))


def connect(addr: str, token: str, timeout: float | None = 30.0,
            max_inflight: int | None = None, *, tls: TlsOption = None,
            same_host: bool | None = None, insecure: bool | None = None) -> Connector:
    """Open a session with the rpcbufd at ``addr`` ("host:port", or
    "unix:PATH" / "unix:@NAME" for the daemon's Unix socket).

    On the daemon's own host the session takes the same-host path (host
    arrays are copied through shared memory the daemon made, with no network
    stack between; see docs/performance.md): ``same_host=None`` (default; env
    ``RPCBUF_SAME_HOST``) takes it when it can, ``False`` never (UCX over the
    network stack), ``True`` requires it (BAD_REQUEST saying why if not).
    ``ctx.same_host`` tells which path the context got.

    ``timeout`` bounds each control call; ``max_inflight`` caps this client's
    requests on the wire (at most the daemon's limit): more calls wait their
    turn instead of queueing without bound.

    The token itself is never sent: hello proves this client holds it,
    after the daemon proved it holds the node's key (docs/tokens.md).

    ``tls`` puts the control channel (hello first) under TLS, the
    daemon's certificate verified (its chain, and that it names the host in
    ``addr``): ``True`` against the system's CAs, a CA file's path against
    that CA, an ``ssl.SSLContext`` as it is (a client certificate too);
    ``None`` (default) takes the CA file in ``$RPCBUF_CA`` when set, else
    plain TCP; ``False`` plain TCP.  Plain TCP to an address that is not
    loopback is refused before anything is dialed (BAD_REQUEST,
    ``details["reason"] == "insecure_transport"``): requests would go in
    the clear, and a relay on the path could use the session.  ``insecure=True`` (default
    ``$RPCBUF_INSECURE``) allows it on a network you trust.  The data plane
    (UCX) is not encrypted by this; with TLS the same-host path is used only
    when ``same_host=True`` (it leaves TLS out).
    Raises AUTH_FAILED (``details["reason"] == "daemon_unproven"``: the peer
    could not prove it holds the key that signed the token, an impostor or
    another node's), TOKEN_EXPIRED, CONNECTION_LOST (also for a failed TLS
    handshake: the token was not sent), TIMEOUT, QUOTA_EXCEEDED (the
    daemon's --max-sessions), SHUTTING_DOWN, FORBIDDEN (the process behind
    a Unix socket is not trusted, ``check_unix_peer``: with "unix:..." or
    ``same_host=True``; the token was not sent), BAD_REQUEST (as above, a
    bad address, or a CA file that cannot be loaded)."""
    return Connector(addr, token, timeout, max_inflight, tls, same_host, insecure)


def create_rpc_context(server_addr: str, auth_token: str,
                       timeout: float | None = 30.0) -> Connector:
    """The tutorial's name for ``connect``."""
    return connect(server_addr, auth_token, timeout)
