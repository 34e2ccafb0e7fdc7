"""Tokens, the node's keys, and hello's proof of possession.

- A token is a JWT, HS256-signed with one of the node's keys (header ``kid``
  names it; none means ``default``); claims ``sub`` (tenant), ``aud``, ``iat``,
  ``jti`` and ``exp``, or ``"never_expires": true`` instead (a token with neither
  is refused, so a hand-minted one never lives forever by accident).
- Verification trusts the unverified header only to pick a key, pins the
  algorithm list to HS256 (no ``none``, no key confusion) and checks the MAC in
  constant time before any claim: forged and garbled tokens are both
  ``AUTH_FAILED``; only a genuine one can say ``TOKEN_EXPIRED``.
- ``aud`` lists clusters (``prod``) or nodes of one (``prod/n1``); a node takes a
  token naming its cluster or itself, so a token stolen by a fake node cannot be
  replayed on another cluster or node, even one sharing the key.  No ``aud``:
  good nowhere.
- The secret file holds ``KEY_ID SECRET`` lines (UTF-8; a bare secret is key
  ``default``); the last line signs new tokens.  Rotation: add a line, SIGHUP,
  mint, delete the old line, SIGHUP.  ``rpcbuf1.`` development tokens are refused.
- The token never crosses the wire.  Its HS256 signature ``S`` is a secret shared
  with the nodes holding the key; hello sends only ``header.payload`` and a
  client nonce, the daemon answers a server nonce and HMAC(S, "daemon" |
  transcript), checked before the client sends HMAC(S, "client" | transcript).
  The transcript holds fixed-size fields and the claims last, so no two read
  alike.  A captured hello opens nothing; an active relay to a live daemon gets
  that one session (only TLS stops it).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jwt

from rpcbuf.control.wire.errors import AuthFailed, TokenExpired
from rpcbuf.control.wire.membership import DEFAULT_CLUSTER, check_name, check_node_id

LEGACY_PREFIX = "rpcbuf1"
SECRET_BYTES = 32
DEFAULT_KID = "default"
ALGORITHMS = ["HS256"]  # the only one decode accepts: no "none", no key confusion
NEVER = "never_expires"
MAX_TOKEN = 4096  # characters; ours are ~200
MINT_MAX = 3072  # what create_token makes at most: the hello that carries it fits 4 KiB
MAX_EXP = 2**40  # seconds since 1970 (year 36812): beyond, or NaN, is not a date
TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}")
KID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")


@dataclass(frozen=True)
class Keyring:
    """The node's keys, key id -> secret, in file order (the last signs new
    tokens); the secrets are kept out of ``repr``."""

    keys: Mapping[str, bytes] = field(repr=False)

    def __post_init__(self) -> None:
        if not self.keys:
            raise ValueError("a keyring needs at least one key")

    @classmethod
    def single(cls, secret: bytes) -> Keyring:
        return cls({DEFAULT_KID: secret})

    @property
    def newest(self) -> str:
        return list(self.keys)[-1]

    @property
    def kids(self) -> list[str]:
        return list(self.keys)


@dataclass(frozen=True)
class Grant:
    """A verified token: tenant, expiry (None: never), key id and secret
    (to tell on reload whether the key is still there)."""

    tenant: str
    expires_at: float | None
    kid: str
    key: bytes = field(repr=False)


def _ring(keys: Keyring | bytes) -> Keyring:
    return keys if isinstance(keys, Keyring) else Keyring.single(keys)


# -- tokens ----------------------------------------------------------------------


def audience(clusters: Sequence[str] = (DEFAULT_CLUSTER,),
             nodes: Sequence[str] = ()) -> list[str]:
    """``aud`` for any node of ``clusters``, or only ``nodes`` of them.
    Raises ValueError for a bad name."""
    if not clusters:
        raise ValueError("a token needs at least one cluster")
    for c in clusters:
        check_name("cluster", c)
    for n in nodes:
        check_node_id("node id", n)
    return [f"{c}/{n}" for c in clusters for n in nodes] if nodes else list(clusters)


def create_token(keys: Keyring | bytes, tenant: str, ttl: float | None = None,
                 kid: str | None = None, clusters: Sequence[str] = (DEFAULT_CLUSTER,),
                 nodes: Sequence[str] = ()) -> str:
    """A token for ``tenant``, valid ``ttl`` seconds (None: forever), signed
    with ``kid`` (default: the newest key). Raises ValueError."""
    if not TENANT_RE.fullmatch(tenant):
        raise ValueError(
            f"bad tenant name {tenant!r}: letters, digits and _.@- only, at most 128 characters"
        )
    aud = audience(clusters, nodes)
    ring = _ring(keys)
    kid = ring.newest if kid is None else kid
    if kid not in ring.keys:
        raise ValueError(f"no key {kid!r} in the secret file (it has: {', '.join(ring.kids)})")
    now = time.time()
    claims: dict[str, Any] = {"sub": tenant, "aud": aud, "iat": int(now),
                              "jti": secrets.token_urlsafe(9)}
    if ttl is None:
        claims[NEVER] = True
    else:
        claims["exp"] = int(now + ttl)
    token = jwt.encode(claims, ring.keys[kid], algorithm=ALGORITHMS[0], headers={"kid": kid})
    if len(token) > MINT_MAX:  # every node would refuse it (hello's frame, MAX_TOKEN)
        raise ValueError(f"the token would be {len(token)} characters (at most {MINT_MAX}): "
                         f"its audience names {len(aud)} cluster/node pairs; name fewer nodes")
    return token


def verify(keys: Keyring | bytes, token: str, now: float | None = None,
           cluster: str = DEFAULT_CLUSTER, node: str | None = None) -> Grant:
    """Raises AuthFailed (forged, garbled, unknown or revoked key, no tenant,
    no expiry, no or another audience) or TokenExpired."""
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN:
        raise AuthFailed("malformed token")
    ring = _ring(keys)
    if token.startswith(LEGACY_PREFIX + "."):
        raise AuthFailed(f"an old-format ({LEGACY_PREFIX}.) token, no longer accepted: "
                         "mint a new one with 'rpcbuf token create'")
    try:
        kid = jwt.get_unverified_header(token).get("kid", DEFAULT_KID)
    except Exception:  # whatever hostile JSON makes PyJWT raise, it is a bad token
        raise AuthFailed("malformed token") from None
    secret = ring.keys.get(kid) if isinstance(kid, str) else None
    if secret is None:
        name = repr(kid) if isinstance(kid, str) and KID_RE.fullmatch(kid) else "(bad key id)"
        raise AuthFailed(f"token is signed with key {name}, which this node does not know "
                         "(unknown or revoked)")
    try:
        claims = jwt.decode(token, secret, algorithms=ALGORITHMS, leeway=0, audience=[
            cluster, *([f"{cluster}/{node}"] if node is not None else [])], options={
            "require": ["sub", "aud"],
            "verify_exp": False,  # checked below, against ``now``
            "verify_iat": False,  # informational: a node's clock may lag the minter's
        })
    except jwt.InvalidSignatureError:
        raise AuthFailed("token signature does not match this node's key") from None
    except jwt.MissingRequiredClaimError as exc:
        if exc.claim != "aud":
            raise AuthFailed(f"bad token: {exc}") from None
        raise AuthFailed("token names no audience (aud), so no node takes it: mint it "
                         "with 'rpcbuf token create --cluster NAME'") from None
    except jwt.InvalidAudienceError:  # the signature held: the token is ours, not for here
        where = f"cluster {cluster!r}" + ("" if node is None else f", node {node!r}")
        raise AuthFailed(f"token is not for this node ({where}): its audience (aud) names "
                         "other clusters or nodes") from None
    except jwt.PyJWTError as exc:  # a genuine token with a bad claim (nbf, aud, ...)
        raise AuthFailed(f"bad token: {exc}") from None
    except Exception:  # e.g. OverflowError from an nbf of Infinity, RecursionError
        raise AuthFailed("malformed token") from None
    tenant = claims.get("sub")
    if not isinstance(tenant, str) or not TENANT_RE.fullmatch(tenant):
        raise AuthFailed("token names no valid tenant (sub)")
    exp = claims.get("exp")
    if exp is None:
        if claims.get(NEVER) is not True:
            raise AuthFailed("token has no expiry (exp); one that never expires says so "
                             f"with \"{NEVER}\": true ('rpcbuf token create --ttl never')")
        return Grant(tenant, None, kid, secret)
    if isinstance(exp, bool) or not isinstance(exp, (int, float)) or not abs(exp) < MAX_EXP:
        raise AuthFailed("token expiry (exp) is not a number of seconds since 1970")
    if (time.time() if now is None else now) >= exp:
        raise TokenExpired("token expired", {"expired_at": exp})
    return Grant(tenant, float(exp), kid, secret)


def verify_token(keys: Keyring | bytes, token: str, now: float | None = None) -> str:
    return verify(keys, token, now).tenant


# -- proof of possession: hello without the token (protocol 4) ------------------

NONCE_BYTES = 32  # each side's fresh nonce
PROOF_BYTES = 32  # an HMAC-SHA256
LABEL = b"rpcbuf hello"
CLIENT, DAEMON = b"client", b"daemon"  # whose proof (same length: no prefix of another)


def split_token(token: str) -> tuple[str, bytes]:
    """``(header.payload, S)``: S, the 32-byte signature, is never sent.
    Raises AuthFailed before anything is dialed."""
    if not isinstance(token, str) or not token or len(token) > MAX_TOKEN:
        raise AuthFailed("malformed token")
    if token.startswith(LEGACY_PREFIX + "."):
        raise AuthFailed(f"an old-format ({LEGACY_PREFIX}.) token, no longer accepted: "
                         "mint a new one with 'rpcbuf token create'")
    claims, _, sig = token.rpartition(".")
    try:
        secret = base64.urlsafe_b64decode(sig + "=" * (-len(sig) % 4))
    except (ValueError, TypeError):
        secret = b""
    if claims.count(".") != 1 or len(secret) != PROOF_BYTES:
        raise AuthFailed("malformed token")  # not header.payload.(32-byte HS256 signature)
    return claims, secret


def transcript(version: int, claims: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    """What both proofs cover: label, version, both nonces (fixed size),
    then the claims last (no field boundary to shift)."""
    if len(client_nonce) != NONCE_BYTES or len(server_nonce) != NONCE_BYTES:
        raise ValueError(f"hello nonces are {NONCE_BYTES} bytes")
    return b"%s\0%d\0" % (LABEL, version) + client_nonce + server_nonce + claims.encode()


def prove(secret: bytes, who: bytes, said: bytes) -> bytes:
    return hmac.new(secret, who + b"\0" + said, hashlib.sha256).digest()


def signature(keys: Keyring | bytes, claims: str) -> tuple[str, bytes]:
    """``(kid, S)`` for ``claims`` under the key it names. Raises AuthFailed
    (malformed, unknown or revoked key)."""
    if not isinstance(claims, str) or not claims or len(claims) > MAX_TOKEN:
        raise AuthFailed("malformed token")
    if claims.startswith(LEGACY_PREFIX + "."):
        raise AuthFailed(f"an old-format ({LEGACY_PREFIX}.) token, no longer accepted: "
                         "mint a new one with 'rpcbuf token create'")
    if claims.count(".") != 1:
        raise AuthFailed("malformed token: claims are header.payload")
    try:
        kid = jwt.get_unverified_header(claims + ".").get("kid", DEFAULT_KID)
        data = claims.encode("ascii")
    except Exception:  # whatever hostile JSON makes PyJWT raise, it is a bad token
        raise AuthFailed("malformed token") from None
    secret = _ring(keys).keys.get(kid) if isinstance(kid, str) else None
    if secret is None:
        name = repr(kid) if isinstance(kid, str) and KID_RE.fullmatch(kid) else "(bad key id)"
        raise AuthFailed(f"token is signed with key {name}, which this node does not know "
                         "(unknown or revoked)")
    return kid, _HS256.sign(data, _HS256.prepare_key(secret))


def check_proof(keys: Keyring | bytes, claims: str, proof: bytes, said: bytes,
                now: float | None = None, cluster: str = DEFAULT_CLUSTER,
                node: str | None = None) -> Grant:
    """The proof first, in constant time, then every check of ``verify``.
    Raises AuthFailed (forged, another key, replayed or altered hello) or TokenExpired."""
    _, secret = signature(keys, claims)
    if not isinstance(proof, bytes) or not hmac.compare_digest(
            proof, prove(secret, CLIENT, said)):
        raise AuthFailed("the hello's proof does not match this node's key: the token is "
                         "forged or signed by another key (or the hello was replayed)")
    token = claims + "." + base64.urlsafe_b64encode(secret).rstrip(b"=").decode()
    return verify(keys, token, now, cluster, node)


_HS256: Any = jwt.algorithms.get_default_algorithms()["HS256"]
