"""One exception tree for daemon and client.  Each error's stable ``code`` is what
travels as ``{code, message, details}``; a registry maps codes to classes (an
unknown code is the root class).  Declaring a registered code again is a
TypeError at import.  A subclass without its own code refines its parent's and
is never built from the wire; ``wire=False`` marks a client-only error no peer
can make a client raise.
"""

from __future__ import annotations

from typing import Any, ClassVar

_REGISTRY: dict[str, type[RpcBufError]] = {}  # wire codes
_LOCAL: dict[str, type[RpcBufError]] = {}  # client-only codes: never built from the wire


class RpcBufError(Exception):
    """Root of every rpcbuf error; ``code`` is the wire code."""

    code: ClassVar[str] = "ERROR"

    def __init__(self, message: str = "", details: dict[str, Any] | None = None) -> None:
        super().__init__(message or self.code)
        self.message = message or self.code
        self.details: dict[str, Any] = dict(details or {})

    def __init_subclass__(cls, wire: bool = True, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "code" not in cls.__dict__:
            return  # a refinement of its parent's code
        if cls.code in _REGISTRY or cls.code in _LOCAL:
            raise TypeError(f"error code {cls.code!r} is taken by "
                            f"{(_REGISTRY.get(cls.code) or _LOCAL[cls.code]).__qualname__}")
        (_REGISTRY if wire else _LOCAL)[cls.code] = cls

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def to_wire(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "details": self.details}


class AuthFailed(RpcBufError):
    code = "AUTH_FAILED"


class TokenExpired(RpcBufError):
    code = "TOKEN_EXPIRED"


class Forbidden(RpcBufError):
    code = "FORBIDDEN"


class NotFound(RpcBufError):
    code = "NOT_FOUND"


class OutOfRange(RpcBufError):
    code = "OUT_OF_RANGE"


class OutOfMemory(RpcBufError):
    code = "OUT_OF_MEMORY"


class QuotaExceeded(RpcBufError):
    code = "QUOTA_EXCEEDED"


class Timeout(RpcBufError):
    code = "TIMEOUT"


class BadRequest(RpcBufError):
    code = "BAD_REQUEST"


class VerifyFailed(RpcBufError):
    code = "VERIFY_FAILED"


class UnsupportedDevice(RpcBufError):
    code = "UNSUPPORTED_DEVICE"


class Busy(RpcBufError):
    """The buffer is attached in place by a session of its tenant: a store,
    clear or copy into it is refused at once (``details["attached"]``)."""

    code = "BUSY"


class ShuttingDown(RpcBufError):
    code = "SHUTTING_DOWN"


class ConnectionLost(RpcBufError):
    code = "CONNECTION_LOST"


class UcxUnusable(RpcBufError, wire=False):
    """The UCX library ``RPCBUF_UCX`` chose cannot be used here."""

    code = "UCX_UNUSABLE"


def error_from_wire(err: Any) -> RpcBufError:
    if not isinstance(err, dict):
        return RpcBufError(f"malformed error from peer: {err!r}")
    code = err.get("code")
    message = err.get("message")
    details = err.get("details")
    cls = _REGISTRY.get(code, RpcBufError) if isinstance(code, str) else RpcBufError
    exc = cls(
        message if isinstance(message, str) else "",
        details if isinstance(details, dict) else None,
    )
    if cls is RpcBufError and isinstance(code, str):
        exc.details.setdefault("code", code)
    return exc


ALL_CODES = tuple(sorted(c for c in _REGISTRY))
