"""Tokens: HMAC-SHA256 over (tenant, expiry) with a per-node secret.

A token reads ``rpcbuf1.<payload>.<mac>`` (both base64url); the payload is
msgpack ``[tenant, expires_at, nonce]``.  Verification recomputes the MAC and
compares in constant time before looking at the payload, so a forged token and
a garbled one fail the same way (``AUTH_FAILED``); a genuine token past its
expiry fails with ``TOKEN_EXPIRED``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import logging
import os
import re
import secrets
import stat
import time
from pathlib import Path

import msgpack

from .errors import AuthFailed, TokenExpired

log = logging.getLogger("rpcbuf.auth")
PREFIX = "rpcbuf1"
SECRET_BYTES = 32
TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def load_or_create_secret(path: str | os.PathLike[str], create: bool = True) -> bytes:
    """Read the node secret; create it (0600, 32 random bytes as hex) when missing."""
    p = Path(path)
    if not p.exists():
        if not create:
            raise FileNotFoundError(f"secret file {p} does not exist")
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(SECRET_BYTES) + "\n")
    mode = stat.S_IMODE(p.stat().st_mode)
    if mode & 0o077:
        log.warning("secret file %s is readable by others (mode %o); chmod 600 it", p, mode)
    secret = p.read_bytes().strip()
    if len(secret) < SECRET_BYTES:
        raise ValueError(f"secret file {p} holds fewer than {SECRET_BYTES} bytes")
    return secret


def create_token(secret: bytes, tenant: str, ttl: float | None = None) -> str:
    if not TENANT_RE.fullmatch(tenant):
        raise ValueError(
            f"bad tenant name {tenant!r}: letters, digits and _.@- only, at most 128 characters"
        )
    expires = 0 if ttl is None else int(time.time() + ttl)
    payload = msgpack.packb([tenant, expires, secrets.token_bytes(8)])
    mac = hmac.new(secret, payload, hashlib.sha256).digest()
    return f"{PREFIX}.{_b64(payload)}.{_b64(mac)}"


def verify_token(secret: bytes, token: str, now: float | None = None) -> str:
    """Return the tenant the token was made for. Raises AuthFailed / TokenExpired."""
    try:
        prefix, payload_b64, mac_b64 = token.split(".")
        payload, mac = _unb64(payload_b64), _unb64(mac_b64)
    except (ValueError, AttributeError):
        raise AuthFailed("malformed token") from None
    expected = hmac.new(secret, payload, hashlib.sha256).digest()
    if not hmac.compare_digest(expected, mac) or prefix != PREFIX:
        raise AuthFailed("token signature does not match this node's secret")
    try:
        tenant, expires, _nonce = msgpack.unpackb(payload)
    except Exception:
        raise AuthFailed("malformed token payload") from None
    if expires and (now if now is not None else time.time()) >= expires:
        raise TokenExpired("token expired", {"expired_at": expires})
    return str(tenant)
