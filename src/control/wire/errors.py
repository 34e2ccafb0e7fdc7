"""One exception tree for rpcbuf, shared by the daemon and the client.

Every error has a stable ``code`` string which is exactly what travels on the
wire as ``{code, message, details}``.  A registry maps each code to its class so
that the client can rebuild the same exception the daemon raised; an unknown
code becomes the root class.  Foreign errors (UCX, OSError, msgpack) are
translated once, at the I/O edge, with ``raise ... from exc``.
"""

from __future__ import annotations

from typing import Any, ClassVar

_REGISTRY: dict[str, type[RpcBufError]] = {}


class RpcBufError(Exception):
    """Root of every rpcbuf error; ``code`` is the wire code."""

    code: ClassVar[str] = "ERROR"

    def __init__(self, message: str = "", details: dict[str, Any] | None = None) -> None:
        super().__init__(message or self.code)
        self.message = message or self.code
        self.details: dict[str, Any] = dict(details or {})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _REGISTRY.setdefault(cls.code, cls)  # a subclass sharing a code keeps the first

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


class ShuttingDown(RpcBufError):
    code = "SHUTTING_DOWN"


class ConnectionLost(RpcBufError):
    code = "CONNECTION_LOST"


def error_from_wire(err: Any) -> RpcBufError:
    """Rebuild an exception from a wire ``{code, message, details}`` map."""
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
