"""UCX's failures as rpcbuf's errors: the one map from the data plane's
exceptions (``dataplane.ucx``, which knows no error codes) to wire errors,
used around every UCX wait on both sides (as httpcore's ``map_exceptions``).

* ``Truncated`` (a peer sent more than announced): BAD_REQUEST where
  ``truncated`` says what it means, else CONNECTION_LOST;
* ``Dropped`` (the janitor dropped a payload that waited unexpected too long):
  TIMEOUT, reason ``payload_dropped``: nothing was stored, send it again;
* any other ``TransferError``: CONNECTION_LOST, naming ``what`` failed;
* ``UnusableUCX`` (the UCX ``RPCBUF_UCX`` chose): UCX_UNUSABLE.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from rpcbuf.control.wire.errors import BadRequest, ConnectionLost, Timeout, UcxUnusable
from rpcbuf.dataplane.ucx import Dropped, TransferError, Truncated, UnusableUCX


@contextlib.contextmanager
def ucx_errors(what: str, truncated: str | None = None) -> Iterator[None]:
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
