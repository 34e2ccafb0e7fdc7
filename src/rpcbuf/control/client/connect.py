"""``rpcbuf.connect``: a session with one rpcbufd, awaited or used with
``async with``.
"""

from __future__ import annotations

from rpcbuf.control.client.context import RpcContext
from rpcbuf.control.client.opening import Opening, TlsOption


class Connector(Opening[RpcContext]):
    """What ``connect()`` returns: awaited or used with ``async with``."""

    def __init__(self, addr: str, token: str, timeout: float | None,
                 max_inflight: int | None = None, tls: TlsOption = None,
                 same_host: bool | None = None, insecure: bool | None = None) -> None:
        super().__init__(lambda: RpcContext.connect(addr, token, timeout, max_inflight, tls,
                                                    same_host, insecure))


def connect(addr: str, token: str, timeout: float | None = 30.0,
            max_inflight: int | None = None, *, tls: TlsOption = None,
            same_host: bool | None = None, insecure: bool | None = None) -> Connector:
    """Open a session with the rpcbufd at ``addr`` ("host:port", "unix:PATH"
    or "unix:@NAME").

    ``same_host``: on the daemon's host, host arrays move through shared
    memory (None: when it can, env ``RPCBUF_SAME_HOST``; True: required).
    ``timeout`` bounds each control call; ``max_inflight`` caps this client's
    requests on the wire.  The token is never sent: hello proves we hold it,
    after the daemon proved it holds the node's key (docs/tokens.md).

    ``tls``: True (system CAs), a CA file, an ``ssl.SSLContext``, None
    (``$RPCBUF_CA`` when set) or False.  Plain TCP to an address that is not
    loopback is BAD_REQUEST (``insecure_transport``) unless ``insecure``
    (``$RPCBUF_INSECURE``): a relay could use the session.  UCX is not
    encrypted; with TLS the same-host path needs ``same_host=True``.

    Raises AUTH_FAILED (``daemon_unproven``: an impostor), TOKEN_EXPIRED,
    CONNECTION_LOST (a failed TLS handshake too), TIMEOUT, QUOTA_EXCEEDED,
    SHUTTING_DOWN, FORBIDDEN (an untrusted process behind a Unix socket),
    BAD_REQUEST."""
    return Connector(addr, token, timeout, max_inflight, tls, same_host, insecure)


def create_rpc_context(server_addr: str, auth_token: str,
                       timeout: float | None = 30.0) -> Connector:
    """The tutorial's name for ``connect``."""
    return connect(server_addr, auth_token, timeout)
