"""UCX's failures as rpcbuf's errors, translated in this one place.

The data plane (``rpcbuf.dataplane.ucx``) raises its own exceptions and knows
nothing of rpcbuf's error codes; the client and the daemon wrap every UCX
wait in ``ucx_errors`` (in the manner of httpcore's ``map_exceptions``):

* ``Truncated`` (a peer sent more than was announced) is the peer's fault:
  BAD_REQUEST, where ``truncated`` says what it means there;
* ``Dropped`` (the daemon's janitor dropped a store's payload that waited
  unexpected past its limit while the store waited for its buffer's lock,
  ``dataplane/janitor.py``) is TIMEOUT with reason ``payload_dropped``: the
  store did nothing and may be sent again;
* every other ``TransferError`` (the endpoint broke, the peer vanished, we
  stopped waiting) is CONNECTION_LOST, naming ``what`` failed;
* ``UnusableUCX`` (the UCX that ``RPCBUF_UCX`` chose cannot be loaded or is
  too old, ``dataplane/ucxlib.py``) is UCX_UNUSABLE, its sentence as it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rpcbuf.control.wire.errors import BadRequest, ConnectionLost, Timeout, UcxUnusable
from rpcbuf.dataplane.ucx import Dropped, TransferError, Truncated, UnusableUCX


@contextlib.contextmanager
def ucx_errors(what: str, truncated: str | None = None) -> Iterator[None]:
    """Raise rpcbuf's error for a UCX failure inside the block."""
    try:
        yield
    except Truncated as exc:
        if truncated is None:
            raise ConnectionLost(f"{what} failed: {exc}") from exc
        raise BadRequest(truncated) from exc
    except Dropped as exc:
        raise Timeout(f"{what}: the payload waited longer than the daemon keeps messages "
                      "nobody has asked for yet (the buffer was locked by another request) "
                      "and was dropped; send it again", {"reason": "payload_dropped"}) from exc
    except TransferError as exc:
        raise ConnectionLost(f"{what} failed: {exc}") from exc
    except UnusableUCX as exc:
        raise UcxUnusable(str(exc)) from None
