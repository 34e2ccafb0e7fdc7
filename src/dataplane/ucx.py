"""Everything UCX, behind one module: environment defaults, the process-wide
context, listeners, endpoints, and the translation of UCX's exceptions.

Defaults (each overridable by the user's own environment variable, because we
only ``setdefault``): blocking progress (no busy polling: an idle daemon uses
no CPU; lowest small-message latency measured here), one-sided ``put_zcopy``
rendezvous and 2 MiB TCP segments (together 3-6x faster than ucxx's defaults
over tcp in the brief's measurements), and host bounce buffers for
rendezvous fragments (ucxx's own default, ``cuda``, needs a GPU).

Both sides of a connection bind their UCX endpoint to an authenticated control
session with a small handshake on the reserved tag ``BIND_TAG``: the client
sends the 16-byte nonce it got in ``hello``; the daemon answers one byte.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

UCX_DEFAULTS: dict[str, str] = {
    "UCXPY_PROGRESS_MODE": "blocking",
    "UCX_RNDV_SCHEME": "put_zcopy",
    "UCX_TCP_TX_SEG_SIZE": "2m",
    "UCX_TCP_RX_SEG_SIZE": "2m",
    "UCX_RNDV_FRAG_MEM_TYPE": "host",
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}

BIND_TAG = 0  # request ids start at 1, so tag 0 never carries a payload
NONCE_BYTES = 16

_ucxx: Any = None


def apply_defaults(env: dict[str, str] | None = None) -> dict[str, str]:
    """Put rpcbuf's UCX defaults into ``env`` (os.environ by default) where unset."""
    target: Any = os.environ if env is None else env
    for key, value in UCX_DEFAULTS.items():
        target.setdefault(key, value)
    return dict(target)


def ucxx() -> Any:
    """Import ucxx after the defaults are in place (UCX reads them at import)."""
    global _ucxx
    if _ucxx is None:
        apply_defaults()
        import ucxx as _mod

        _ucxx = _mod
    return _ucxx


class TransferError(Exception):
    """A data-plane transfer failed; the endpoint may be unusable."""


class Truncated(TransferError):
    """The peer sent more bytes than the receive buffer holds (or a refusal drained it)."""


class PeerGone(TransferError):
    """The endpoint is closed or its peer vanished."""


def _translate(exc: BaseException) -> TransferError:
    ex = ucxx().exceptions
    if isinstance(exc, ex.UCXMessageTruncatedError):
        return Truncated(str(exc))
    if isinstance(exc, (ex.UCXCanceled, ex.UCXCloseError, ex.UCXConnectionResetError,
                        ex.UCXNotConnectedError, ex.UCXEndpointTimeoutError)):
        return PeerGone(str(exc) or type(exc).__name__)
    return TransferError(f"{type(exc).__name__}: {exc}")


class DataEndpoint:
    """A UCX endpoint with tagged send/recv that raise ``TransferError``s only."""

    def __init__(self, ep: Any) -> None:
        self._ep = ep

    @property
    def closed(self) -> bool:
        return self._ep is None or bool(self._ep.closed)

    async def send(self, buf: Any, tag: int) -> None:
        if self._ep is None:
            raise PeerGone("endpoint closed")
        try:
            await self._ep.send(buf, tag=tag)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _translate(exc) from exc

    async def recv(self, buf: Any, tag: int) -> None:
        if self._ep is None:
            raise PeerGone("endpoint closed")
        try:
            await self._ep.recv(buf, tag=tag)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            raise _translate(exc) from exc

    def abort(self) -> None:
        """Close at once; UCX cancels every request still posted on it."""
        ep, self._ep = self._ep, None
        if ep is not None:
            try:
                ep.abort()
            except Exception:  # already broken: nothing left to close
                pass

    async def close(self) -> None:
        ep, self._ep = self._ep, None
        if ep is not None:
            try:
                await ep.close()
            except Exception:
                ep.abort()


class DataListener:
    """A UCX listener; ``on_endpoint(DataEndpoint)`` runs for each new peer."""

    def __init__(self, on_endpoint: Any, port: int = 0) -> None:
        async def _accept(ep: Any) -> None:
            await on_endpoint(DataEndpoint(ep))

        self._listener: Any = ucxx().create_listener(_accept, port=port)

    @property
    def port(self) -> int:
        return int(self._listener.port)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None


async def connect(host: str, port: int, timeout: float = 10.0) -> DataEndpoint:
    try:
        async with asyncio.timeout(timeout):
            ep = await ucxx().create_endpoint(host, port)
    except TimeoutError as exc:
        raise PeerGone(f"UCX connect to {host}:{port} timed out") from exc
    except Exception as exc:
        raise _translate(exc) from exc
    return DataEndpoint(ep)
